"""The causal-LM loss over a model's logits with the loader's per-token weights (``loaders.loss_weights``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loaders.collate import IGNORE_INDEX


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
