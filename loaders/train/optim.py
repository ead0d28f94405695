"""The optimizer step of a training loop, one for ``scripts/train.py`` and ``scripts/bench_train.py``.

AdamW over the trained parameters, fused (on CUDA and on CPU, as the Hugging Face Trainer's default
``adamw_torch_fused``, so both loops take the same steps); for the whole-step CUDA graph
(``loaders.train.step_graph``) capturable, with its learning rate a tensor on the GPU that the
scheduler fills, so the captured steps see the schedule::

    optimizer, scheduler = adamw_with_warmup(model.parameters(), lr=3e-4, weight_decay=0.0, warmup_steps=10,
                                             device=device)
    ...                                        # forward and backward of the step's micro-batches
    optimizer_step(model.parameters(), optimizer, scheduler, max_grad_norm=1.0)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from loaders.train.models import linear_warmup


def make_adamw(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, device: torch.device,
               step_graph: bool = False) -> torch.optim.AdamW:
    """AdamW over the parameters that require gradients (LoRA's adapters alone, say); fused on CUDA and CPU.

    ``step_graph``: capturable, with the learning rate a tensor on ``device``, as ``GraphedStep`` needs.
    """
    trained = [p for p in parameters if p.requires_grad]
    if step_graph:
        return torch.optim.AdamW(trained, lr=torch.tensor(lr, device=device), weight_decay=weight_decay, fused=True,
                                 capturable=True)
    return torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=device.type in ("cuda", "cpu"))


def adamw_with_warmup(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, warmup_steps: int,
                      device: torch.device, step_graph: bool = False,
                      ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """``make_adamw`` and its schedule: a linear warm-up over ``warmup_steps``, then ``lr``."""
    optimizer = make_adamw(parameters, lr, weight_decay, device, step_graph)
    return optimizer, linear_warmup(optimizer, warmup_steps)


def optimizer_step(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, max_grad_norm: float) -> None:
    """Clip the gradients to ``max_grad_norm``, step the optimizer and the schedule, and drop the gradients."""
    torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
