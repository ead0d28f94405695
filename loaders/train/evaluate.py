"""Packed evaluation: per-example loss and perplexity from the shards of a held-out split.

Evaluation data packs like training data, so it runs as fast: every row of every shard is read
once, in order (no shuffle, nothing dropped), ``batch_rows`` rows per forward; with
``distributed=True`` the ranks share the batches and every rank gets the whole result.
Its shards are checked as training's are (``loaders/verify.py``): size, sha256 (once per host),
place in the build and every row invariant.
Each target token's cross-entropy (fp32) is summed per packed sequence, and the sequences are
summed per source example (``example_ids``), so the result is reported by example id (the
source row number, rows the build left out included), in source order. An example's loss is
the mean over its target tokens, its perplexity ``exp`` of that; an example with no target
token has neither (``None``, never NaN).

    >>> result = evaluate_packed(model, "shards/DIR-validation")
    >>> result.summary["mean_token_loss"], result.summary["mean_example_loss"]
    >>> by_source = evaluate_sources(model, {"gsm8k": "shards/gsm8k-...", "flan": "shards/flan-..."})

The packed numbers equal running each example alone: the attention backend must keep examples
apart (``python -m loaders.check``). A chunk of an example split at packing time does not see
the chunk before it, as in training.

Imports only torch, numpy and the read side.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loaders.collate import IGNORE_INDEX, NUM_LOSS_TOKENS, NUM_REAL_TOKENS, collate_rows
from loaders.remote import locate
from loaders.shard_reader import Shard, open_build_shard
from loaders.train import loss_head
from loaders.verify import checked_shards


@dataclass(frozen=True)
class EvalResult:
    """Per-example losses (indexed by example id) and the summary over the split."""

    example_ids: np.ndarray  # int64, ascending: every example of the build that has a packed token
    loss_sum: np.ndarray  # float64: summed cross-entropy of each example's target tokens
    target_tokens: np.ndarray  # int64: each example's target tokens
    seconds: float

    @property
    def example_loss(self) -> np.ndarray:
        """Mean loss per target token of each example; NaN where it has none (see ``records``)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.target_tokens > 0, self.loss_sum / np.maximum(self.target_tokens, 1), np.nan)

    def records(self) -> Iterator[dict]:
        """One dict per example, in source order: id, target tokens, loss and perplexity (None without targets)."""
        for example, tokens, loss in zip(self.example_ids.tolist(), self.target_tokens.tolist(),
                                         self.example_loss.tolist()):
            trained = tokens > 0
            yield {"example_id": example, "target_tokens": tokens, "loss": loss if trained else None,
                   "perplexity": math.exp(loss) if trained else None}

    @property
    def summary(self) -> dict:
        """Mean token loss (over all target tokens), mean example loss (over examples with targets), perplexities."""
        tokens = int(self.target_tokens.sum())
        trained = self.target_tokens > 0
        mean_token = float(self.loss_sum.sum() / tokens) if tokens else None
        mean_example = float(self.example_loss[trained].mean()) if trained.any() else None
        return {
            "examples": int(self.example_ids.size),
            "examples_without_targets": int((~trained).sum()),
            "target_tokens": tokens,
            "mean_token_loss": mean_token,
            "token_perplexity": math.exp(mean_token) if mean_token is not None else None,
            "mean_example_loss": mean_example,
            "seconds": self.seconds,
        }


def packed_batches(source: str | os.PathLike[str], batch_rows: int, rank: int = 0,
                   world_size: int = 1) -> Iterator[tuple[dict, np.ndarray]]:
    """Every row of the build in order, ``batch_rows`` a batch: (batch, example id of each sequence).

    With ``world_size`` ranks, this rank's share: batch ``i`` of the build goes to rank ``i % world_size``.
    """
    location = locate(source)
    manifest = location.read_manifest()
    paths, identities = checked_shards(location, manifest, None, verify_checksum=True)
    index = 0
    for shard_index, path in enumerate(paths):
        shard: Shard = open_build_shard(path, manifest, shard_index, verified=identities[shard_index])
        for first in range(0, shard.num_rows, batch_rows):
            index += 1
            if (index - 1) % world_size != rank:
                continue
            rows = range(first, min(first + batch_rows, shard.num_rows))
            examples = shard.example_ids[shard.segment_offsets[rows.start] : shard.segment_offsets[rows.stop]]
            yield collate_rows([(shard, i) for i in rows]), examples


def at_labelled_positions(model: torch.nn.Module) -> bool:
    """Whether the loss-position head applies to ``model`` (``loss_head.check_supported``): its LM head may then run
    at the labelled positions only."""
    try:
        loss_head.check_supported(loss_head.causal_lm(model))
    except ValueError:
        return False
    return True


def batch_sequence_losses(model: torch.nn.Module, inputs: dict, batch: dict,
                          labelled_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 cross-entropy and target count of each packed sequence of one batch.

    ``labelled_only`` (``at_labelled_positions``): the LM head runs at the labelled positions only, chunk by chunk,
    as in training, with no ``[tokens, vocab]`` logits; otherwise the model's own logits over every token."""
    if not labelled_only:
        return sequence_losses(model(**inputs).logits, batch["labels"], batch["cu_seq_lens_q"])
    lm = loss_head.causal_lm(model)
    hidden = cast(torch.nn.Module, lm.base_model)(**inputs)[0]
    labels = batch["labels"].to(hidden.device)
    _, by_sequence = loss_head.loss_position_loss(lm, hidden, labels, num_loss_tokens=batch[NUM_LOSS_TOKENS],
                                                  per_sequence=True, cu_seqlens=batch["cu_seq_lens_q"])
    loss, count = cast(torch.Tensor, by_sequence).double().cpu()
    return loss, count


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 cross-entropy and target count of each packed sequence of one batch ([1, T] labels), from the
    logits of every token."""
    targets = labels[0, 1:].to(logits.device)
    per_token = F.cross_entropy(logits[0, :-1].float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    positions = torch.arange(targets.numel(), device=per_token.device)
    loss, count = loss_head.sequence_losses(per_token.double(), positions, labels.shape, cu_seqlens, targets != IGNORE_INDEX).cpu()
    return loss, count


def evaluate_packed(model: torch.nn.Module, source: str | os.PathLike[str], batch_rows: int = 1,
                    distributed: bool = False) -> EvalResult:
    """Per-example loss of ``model`` (an HF causal LM, on its device, any backend that keeps examples apart).

    ``distributed``: under an initialised ``torch.distributed``, every rank evaluates its share of
    the batches, and every rank returns the whole split's result (one gather of per-example sums).
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed and dist.is_initialized() else (0, 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    example_chunks, loss_chunks, count_chunks = [], [], []
    start = time.perf_counter()
    labelled_only = at_labelled_positions(model)
    try:
        with torch.no_grad():
            for batch, examples in packed_batches(source, batch_rows, rank, world):
                inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
                          if k not in ("labels", NUM_REAL_TOKENS, NUM_LOSS_TOKENS)}
                loss, count = batch_sequence_losses(model, inputs, batch, labelled_only)
                example_chunks.append(examples)
                loss_chunks.append(loss.numpy())
                count_chunks.append(count.numpy())
    finally:
        model.train(was_training)
    parts = [(np.concatenate(example_chunks or [np.zeros(0, np.int64)]), np.concatenate(loss_chunks or [np.zeros(0)]),
              np.concatenate(count_chunks or [np.zeros(0)]))]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, parts[0])
        parts = gathered
    examples, losses, counts = (np.concatenate(column) for column in zip(*parts))
    ids, where = np.unique(examples, return_inverse=True)
    loss_sum = np.bincount(where, weights=losses, minlength=ids.size)
    targets = np.bincount(where, weights=counts, minlength=ids.size).astype(np.int64)
    return EvalResult(ids.astype(np.int64), loss_sum, targets, time.perf_counter() - start)


def evaluate_sources(model: torch.nn.Module, builds: Mapping[str, str | os.PathLike[str]], batch_rows: int = 1,
                     distributed: bool = False) -> dict[str, EvalResult]:
    """``evaluate_packed`` over each build of a mixture (``PackedMixture.builds``): the loss of every source."""
    return {name: evaluate_packed(model, build, batch_rows, distributed) for name, build in builds.items()}


def pooled_summary(results: Mapping[str, EvalResult]) -> dict:
    """The summary over several results' examples together: the token mean weighs each source by its targets."""
    parts = list(results.values())
    pooled = EvalResult(np.arange(sum(r.example_ids.size for r in parts), dtype=np.int64),
                        np.concatenate([r.loss_sum for r in parts]), np.concatenate([r.target_tokens for r in parts]),
                        sum(r.seconds for r in parts))
    return pooled.summary
