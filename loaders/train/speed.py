"""The speed options of a training run, one set for ``scripts/train.py`` and ``PackedTrainer``.

Each lever is measured in ``docs/benchmarks.md``:

- ``loss_head``: the LM head and cross-entropy over the labelled positions only
  (``loaders.train.loss_head``); no ``[tokens, vocab]`` logits are held.
- ``compile``: every decoder layer under ``torch.compile`` (``compile_layers``), on batches of
  bucketed fixed shapes (the dataset's ``pad_to_fixed_shape=True, bucket_shapes=True``), compiled
  for every bucket before the first step (``prewarm_buckets``), so no step stops to compile.
- ``activation_memory_budget`` below 1: compiled layers keep that share of the activations they
  save for backward and recompute the rest.
- ``step_graph``: the whole optimizer step as one CUDA graph per batch shape in train.py's plain
  loop (``loaders.train.step_graph.GraphedStep``); in ``PackedTrainer``, each micro-batch's forward
  and backward (``GraphedForwardBackward``), the Trainer's clipping, optimizer and scheduler eager.

    speed = SpeedOptions(compile=True, activation_memory_budget=0.9)
    dataset = PackedIterableDataset("shards/DIR", batch_rows=2, **speed.dataset_options())
    model = speed.apply(model)                     # head and compiled layers
    speed.prewarm(model, first_batch)              # on the device, under the run's autocast

>>> SpeedOptions(compile=True).dataset_options()
{'pad_to_fixed_shape': True, 'bucket_shapes': True}
>>> SpeedOptions(activation_memory_budget=0.9)
Traceback (most recent call last):
ValueError: activation_memory_budget applies to compiled layers; set compile=True as well
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loaders.train.loss_head import use_loss_position_head
from loaders.train.models import compile_layers, prewarm_buckets


@dataclass(frozen=True)
class SpeedOptions:
    """How a run trains fast; the defaults are an eager model with the loss-position head."""

    compile: bool = False
    loss_head: bool = True
    activation_memory_budget: float = 1.0
    step_graph: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.activation_memory_budget <= 1:
            raise ValueError(f"activation_memory_budget is {self.activation_memory_budget}; give a share in (0, 1]")
        if self.activation_memory_budget < 1 and not self.compile:
            raise ValueError("activation_memory_budget applies to compiled layers; set compile=True as well")
        if self.step_graph and not (self.compile and self.loss_head):
            raise ValueError("step_graph captures compiled layers on bucketed shapes with the loss-position head; "
                             "set compile=True and loss_head=True")

    def dataset_options(self) -> dict[str, bool]:
        """The ``PackedIterableDataset`` options these need: bucketed fixed shapes when compiled."""
        return {"pad_to_fixed_shape": self.compile, "bucket_shapes": self.compile}

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """The loss-position head and compiled layers on ``model`` (changed in place, and returned)."""
        if self.loss_head:
            use_loss_position_head(model)
        if self.compile:
            compile_layers(model, activation_memory_budget=self.activation_memory_budget)
        return model

    def prewarm(self, model: torch.nn.Module, batch: dict) -> None:
        """Compile every bucket shape now, from one batch as the model takes it (``prewarm_buckets``); eager: nothing."""
        if self.compile:
            prewarm_buckets(model, batch)

    def check_dataset(self, dataset: object, owner: str) -> None:
        """ValueError naming ``owner`` when compiled layers would meet batches of changing shapes."""
        if self.compile and not getattr(dataset, "bucket_shapes", False):
            raise ValueError(f"{owner}: compile=True needs batches of bucketed fixed shapes, or every new length "
                             "compiles again: make the dataset with pad_to_fixed_shape=True, bucket_shapes=True "
                             "(SpeedOptions.dataset_options())")
