"""A mixture's training loss per source: each step's per-sequence losses, summed by source on the device.

A ``PackedMixture`` batch names the source of each sequence (``source_ids``). The model gives
each packed sequence's summed token loss and loss tokens: the loss-position head when called
with ``sequence_losses=True``, or ``logit_sequence_losses`` on the logits of a model that computes
its own loss. ``SourceLosses.add`` adds them up by source with one ``index_add_`` on the device,
so a step waits on nothing; ``pop`` reads the means (one sync), at logging time::

    source_losses = SourceLosses(mixture.names, device)
    for batch in mixture:
        outputs = model(**model_inputs(batch, device, False), sequence_losses=True)
        outputs.loss.backward()
        source_losses.add_outputs(outputs, batch)
        ...
    source_losses.pop()        # {"flan": 2.31, "gsm8k": 1.87, ...}: mean token loss since the last pop

The mean is the plain one, summed cross-entropy over loss tokens, whatever the loss reduction or
``loss_weights`` the training loss uses; a source without loss tokens since the last pop has None.

Imports only torch and the read side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from loaders.collate import NUM_LOSS_TOKENS, SOURCE_IDS
from loaders.train.loss import logit_sequence_losses


class SourceLosses:
    """Each source's summed token loss and loss tokens since the last ``pop``, kept on ``device`` (fp64 [2, k])."""

    def __init__(self, names: Sequence[str], device: torch.device | str) -> None:
        self.names = list(names)
        self.totals = torch.zeros(2, len(self.names), dtype=torch.float64, device=device)

    def add(self, sequence_losses: torch.Tensor, source_ids: torch.Tensor) -> None:
        """Add a batch's per-sequence losses ([2, n], ``loaders.train.loss_head.sequence_losses``) under
        the source of each sequence; a fixed shape's pad sequences, past ``source_ids``, are left out."""
        sources = source_ids.to(self.totals.device, non_blocking=True)
        self.totals.index_add_(1, sources, sequence_losses[:, : sources.numel()].to(self.totals.dtype))

    def add_outputs(self, outputs: Any, batch: dict) -> None:
        """Add the losses of a forward on a mixture ``batch``: the head's ``sequence_losses``, else those of its logits."""
        by_sequence = getattr(outputs, "sequence_losses", None)
        if by_sequence is None:
            by_sequence = logit_sequence_losses(outputs.logits, batch["labels"], batch.get("cu_seq_lens_q"),
                                                batch.get(NUM_LOSS_TOKENS))
        self.add(by_sequence, batch[SOURCE_IDS])

    def pop(self, distributed: bool = False) -> dict[str, float | None]:
        """Each source's mean token loss since the last pop (None without loss tokens), then start again.

        ``distributed``: over every rank of an initialised ``torch.distributed`` (every rank must call it).
        """
        if distributed and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.totals)
        losses, tokens = self.totals.tolist()
        self.totals.zero_()
        return {name: loss / count if count else None for name, loss, count in zip(self.names, losses, tokens)}
