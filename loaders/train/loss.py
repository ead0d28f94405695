"""The causal-LM loss over a model's logits with the loader's per-token weights (``loaders.loss_weights``),
and each packed sequence's loss from the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loaders.collate import IGNORE_INDEX
from loaders.train.loss_head import loss_positions, sequence_losses


def weighted_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None,
                            num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
    """The causal-LM loss of any model's ``logits`` [B, S, V]: ``sum w * CE / num_items_in_batch`` in fp32.

    ``labels`` are unshifted, as transformers takes them; ``loss_weights`` (the batch's, same
    shape) weigh each label, 1 where not given. ``num_items_in_batch``: the global batch's sum of
    weights (``loaders.train.distributed.global_loss_tokens`` over ``batch_normalizer``); by default
    this batch's own. Without weights it equals transformers' ``ForCausalLMLoss``.
    """
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets,
                                ignore_index=IGNORE_INDEX, reduction="none")
    if loss_weights is None:
        weights = (targets != IGNORE_INDEX).float()
    else:
        weights = loss_weights[:, 1:].reshape(-1).to(per_token.device, torch.float32)
    total = (per_token * weights).sum()
    if num_items_in_batch is None:
        num_items_in_batch = weights.sum()
    elif isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def logit_sequence_losses(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                          num_loss_tokens: int | None = None) -> torch.Tensor:
    """Each packed sequence's summed fp32 cross-entropy and loss tokens (``loaders.train.loss_head.sequence_losses``)
    from any model's ``logits`` [B, S, V], detached: the loss-position head's ``sequence_losses`` for a
    model that computes its own loss. ``num_loss_tokens`` (the batch's count) spares a host sync."""
    with torch.no_grad():
        index, targets = loss_positions(labels.to(logits.device, non_blocking=True), num_loss_tokens)
        # Flat position p of labels[:, 1:] is token p + p // (S - 1) of the flattened logits.
        rows = logits.reshape(-1, logits.shape[-1])[index + index // (labels.shape[1] - 1)]
        token_losses = F.cross_entropy(rows.float(), targets, reduction="none")
        return sequence_losses(token_losses, index, labels.shape, cu_seqlens)
