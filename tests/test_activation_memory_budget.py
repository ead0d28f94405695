"""``compile_layers`` refuses an activation memory budget outside (0, 1] before compiling anything.

That a budget below 1 keeps fewer activations and trains the same is tested on the GPU
(``tests/test_gpu.py``), where the layers compile in seconds.
"""

from __future__ import annotations

import pytest
from tiny_model import tiny_llama

from loaders.train.models import compile_layers

pytest.importorskip("transformers")


@pytest.mark.parametrize("budget", [0.0, 1.5])
def test_a_budget_outside_0_1_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="activation_memory_budget"):
        compile_layers(tiny_llama(300, 256), activation_memory_budget=budget)
