"""One optimizer step of a plain training loop: the step ``scripts/train.py`` runs and ``scripts/bench_train.py`` times.

A step takes a window of micro-batches (gradient accumulation) and the window's normaliser, its
loss tokens (or loss weight) counted from the batches on the host. Each micro-batch's summed loss
is divided by the whole step's normaliser (every rank's, ``loaders.train.distributed``), so the
step's gradient is that of one batch holding the window; then the gradients are clipped and
AdamW and the schedule step. Under DDP the gradients are averaged once, on the last micro-batch.
With a ``GraphedStep`` (one micro-batch, one GPU) the whole step is one CUDA graph replay. On a
mixture, ``source_losses`` adds up each source's loss of every step (``loaders.train.source_loss``)::

    optimizer, scheduler = adamw_with_warmup(model.parameters(), lr, weight_decay, warmup_steps, device)
    step = TrainStep(model, optimizer, scheduler, max_grad_norm=1.0)
    for window in windows:                      # lists of batches as the model takes them
        loss = step(window, sum(batch_normalizer(b) for b in window))   # the step's loss, on the device
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from loaders.collate import SOURCE_IDS
from loaders.train.distributed import step_normalizer, world_size
from loaders.train.models import count_on_device
from loaders.train.optim import optimizer_step
from loaders.train.source_loss import SourceLosses
from loaders.train.step_graph import GraphedStep

# The loss of one micro-batch to call backward on: (model, batch, the batch's model inputs, the step's normaliser).
MicroBatchLoss = Callable[[torch.nn.Module, dict, dict, torch.Tensor], torch.Tensor]


class TrainStep:
    """``step(window, normalizer)``: forward and backward over the window's micro-batches, then one optimizer step.

    ``model`` is what the forward runs through: the model, or its ``DistributedDataParallel`` wrapper.
    ``loss``: the loss of a micro-batch (default: ``model(**inputs, num_items_in_batch=...).loss``), such as a
    preference objective's ``loaders.train.preference.PairLoss``.
    ``autocast_dtype``: forward under ``torch.autocast`` to that dtype (fp32 weights trained in bf16).
    ``graphed``: a ``GraphedStep`` of the same model and optimizer, to replay instead of running the step eagerly;
    ``inputs`` turns a batch into what the model takes (default: the batch as it is).
    ``source_losses``: on a mixture, each micro-batch's loss by source is added to it (the batch's ``inputs`` ask the
    loss-position head for ``sequence_losses``, or the model gives logits).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, max_grad_norm: float, *,
                 loss: MicroBatchLoss | None = None, autocast_dtype: torch.dtype | None = None,
                 graphed: GraphedStep | None = None, inputs: Callable[[dict], dict] | None = None,
                 source_losses: SourceLosses | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.loss = loss or self.model_loss
        self.graphed = graphed
        self.inputs = inputs or (lambda batch: batch)
        self.source_losses = source_losses
        self.device = next(model.parameters()).device
        self.autocast = torch.autocast(self.device.type, dtype=autocast_dtype or torch.bfloat16,
                                       enabled=autocast_dtype is not None)

    def model_loss(self, model: torch.nn.Module, batch: dict, inputs: dict, num_items: torch.Tensor) -> torch.Tensor:
        """The model's own loss of ``batch``, its summed token loss divided by ``num_items``; on a mixture each
        source's loss is added up first, so that full logits are not kept through the backward pass."""
        outputs = model(**inputs, num_items_in_batch=num_items)
        if self.source_losses is not None:
            self.source_losses.add_outputs(outputs, batch)
        return outputs.loss

    def __call__(self, window: Sequence[dict], normalizer: float) -> torch.Tensor:
        """One optimizer step over ``window``; the step's loss (the micro-batches' losses summed), on the device."""
        if self.graphed is not None:  # one GPU, one micro-batch: the whole step is a graph replay
            (batch,) = window
            loss = self.graphed(self.inputs(batch), normalizer)
            if self.source_losses is not None:
                assert self.graphed.sequence_losses is not None  # the batch asked for them
                self.source_losses.add(self.graphed.sequence_losses, batch[SOURCE_IDS])
            self.scheduler.step()
            return loss
        # DDP averages gradients over ranks: dividing by the global count / ranks makes them the global mean.
        num_items = step_normalizer(normalizer, self.device) if world_size() > 1 else count_on_device(normalizer, self.device)
        total = torch.zeros((), device=self.device)
        for index, batch in enumerate(window):
            with self._gradient_sync(last=index == len(window) - 1):
                with self.autocast:
                    loss = self.loss(self.model, batch, self.inputs(batch), num_items)
                loss.backward()
            total += loss.detach()
        optimizer_step(self.model.parameters(), self.optimizer, self.scheduler, self.max_grad_norm)
        return total

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces the gradients on the window's last micro-batch only."""
        if last or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()
