"""Loss reductions over a packed global batch: per token, per example, and weighted by example.

In a packed batch the mean over tokens lets long examples dominate. ``reduction="sequence"``
gives every example the same weight: the mean over examples of each example's mean token loss.
``example_weights`` (one weight per source example id, e.g. from a column or a data mixture)
scales each example's tokens. Both come down to one weight per target token, ``w_t``, and

    loss = sum_t w_t * CE_t / sum_t w_t

over the whole global batch: every micro-batch of a gradient-accumulation window and every rank.
The loader puts ``w_t`` in the batch (``loss_weights``, aligned with ``labels``) and its sum
(``loss_weight_sum``, a Python float), so the global normaliser is one all-reduce of sums the
host already knows; each micro-batch then divides its weighted sum by it, not by its own count.

For example, two packed examples with 3 and 1 target tokens, under ``"sequence"``: the first's
targets weigh 1/3 each, the second's 1, and ``loss_weight_sum`` is 2 (two examples).

``"token"`` with no ``example_weights`` is the default and adds nothing to the batch:
``num_loss_tokens`` is its normaliser. Under ``"sequence"`` an example split into chunks at
packing time (overflow policy ``split``) still weighs one example: each of its targets weighs
1 / (its targets in all chunks), wherever the chunks land.

The loss over a model's logits with these weights is ``loaders.train.loss.weighted_causal_lm_loss``.
Imports only torch and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from loaders.collate import IGNORE_INDEX, NUM_LOSS_TOKENS
from loaders.shard_reader import Shard
from schemas import one_of


class LossReduction(StrEnum):
    """How a batch's loss is averaged: over target tokens, or over examples (each example's mean)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


# Batch keys: the weight of each label (float32 [1, T], 0 where labels == -100) and their sum.
LOSS_WEIGHTS = "loss_weights"
LOSS_WEIGHT_SUM = "loss_weight_sum"


@dataclass(frozen=True)
class LossWeighting:
    """How a batch's target tokens are weighed: ``reduction`` and optional per-example weights."""

    reduction: str = LossReduction.TOKEN
    example_weights: np.ndarray | None = None  # float64 [example id count], indexed by example id
    example_targets: np.ndarray | None = None  # "sequence": int64 targets of each of example_ids, all chunks
    example_ids: np.ndarray | None = None  # "sequence": the example ids the build holds, sorted (int64)

    def __post_init__(self) -> None:
        one_of("loss_reduction", self.reduction, LossReduction)

    @property
    def is_plain_token_mean(self) -> bool:
        """True when every target weighs 1: the batch needs no weights."""
        return self.reduction == LossReduction.TOKEN and self.example_weights is None


def example_target_counts(shards: Sequence[Shard]) -> tuple[np.ndarray, np.ndarray]:
    """(the example ids present, sorted; the targets of each over all its chunks: its loss-mask tokens but the
    first of each chunk). Sized by the ids present, not by the largest id."""
    per_shard = []
    for shard in shards:
        entry_row = np.repeat(np.arange(shard.num_rows), np.diff(shard.cu_offsets))
        bounds = shard.cu_seqlens.astype(np.int64) + shard.token_offsets[entry_row]
        starts = np.delete(bounds, shard.cu_offsets[1:] - 1)
        ends = np.delete(bounds, shard.cu_offsets[:-1])
        trained = np.concatenate(([0], np.cumsum(shard.loss_mask, dtype=np.int64)))
        per_shard.append((shard.example_ids, trained[ends] - trained[np.minimum(starts + 1, ends)]))
    examples = np.concatenate([ids for ids, _ in per_shard])
    targets = np.concatenate([count for _, count in per_shard])
    ids, index = np.unique(examples, return_inverse=True)
    return ids.astype(np.int64), np.bincount(index, weights=targets, minlength=ids.size).astype(np.int64)


def make_loss_weighting(reduction: str, example_weights, num_example_ids: int, source: str,
                        shards: Sequence[Shard] = ()) -> LossWeighting:
    """A checked LossWeighting: ``example_weights`` must give one finite, non-negative weight per example id.

    Example ids are source row numbers, so there is one weight per source row read
    (``Manifest.num_example_ids``), rows the build left out included.

    Under ``"sequence"`` the examples' target counts are read from ``shards`` (every shard of the build).
    """
    ids, targets = example_target_counts(shards) if reduction == LossReduction.SEQUENCE else (None, None)
    if example_weights is None:
        return LossWeighting(reduction, None, targets, ids)
    weights = np.asarray(example_weights, dtype=np.float64)
    if weights.ndim != 1 or weights.size != num_example_ids:
        raise ValueError(
            f"{source}: example_weights holds {weights.size} values, the build has {num_example_ids} example ids "
            "(source rows, those left out included); give one weight per source row, in input order"
        )
    bad = np.flatnonzero(~np.isfinite(weights) | (weights < 0))
    if bad.size:
        raise ValueError(f"example_weights[{int(bad[0])}] is {weights[bad[0]]}; weights must be finite and >= 0")
    return LossWeighting(reduction, weights, targets, ids)


def target_weights(labels: np.ndarray, cu_seqlens: np.ndarray, weighting: LossWeighting,
                   segment_examples: np.ndarray) -> np.ndarray:
    """The weight of every label (float32 [T]): 0 where it is -100, else its sequence's weight.

    ``segment_examples`` holds the example id of each real sequence of ``cu_seqlens``; any
    sequences after them (a fixed shape's pad) have no targets. Under ``"sequence"`` a sequence's
    weight is divided by its example's number of targets (``weighting.example_targets`` of its id
    in ``weighting.example_ids``, all chunks; by default the sequence's own).

    >>> labels = np.array([-100, 5, 7, 8, -100, 9])
    >>> target_weights(labels, np.array([0, 4, 6]), LossWeighting("sequence"), np.array([0, 1])).tolist()
    [0.0, 0.3333333432674408, 0.3333333432674408, 0.3333333432674408, 0.0, 1.0]
    """
    lengths = np.diff(cu_seqlens).astype(np.int64)
    sequence = np.repeat(np.arange(lengths.size), lengths)
    is_target = labels != IGNORE_INDEX
    weights = np.zeros(lengths.size, dtype=np.float64)
    if weighting.example_weights is None:
        weights[: segment_examples.size] = 1.0
    else:
        weights[: segment_examples.size] = weighting.example_weights[segment_examples]
    if weighting.reduction == LossReduction.SEQUENCE:
        if weighting.example_targets is None:
            targets = np.bincount(sequence, weights=is_target, minlength=lengths.size)
        else:
            targets = np.zeros(lengths.size, dtype=np.int64)
            assert weighting.example_ids is not None  # set with example_targets
            found = np.searchsorted(weighting.example_ids, segment_examples)
            targets[: segment_examples.size] = weighting.example_targets[found]
        weights /= np.maximum(targets, 1)
    return (weights[sequence] * is_target).astype(np.float32)


def add_loss_weights(batch: dict, rows: Sequence[tuple[Shard, int]], weighting: LossWeighting,
                     id_offsets: Sequence[int] | None = None) -> dict:
    """``batch`` (collated from ``rows``) with its ``loss_weights`` and ``loss_weight_sum`` added.

    ``id_offsets``: one per row, added to its example ids (a mixture numbers each build's examples after the last's).
    """
    offsets = [0] * len(rows) if id_offsets is None else id_offsets
    segment_examples = np.concatenate(
        [shard.example_ids[shard.segment_offsets[i] : shard.segment_offsets[i + 1]] + offset
         for (shard, i), offset in zip(rows, offsets)]
    )
    weights = target_weights(batch["labels"][0].numpy(), batch["cu_seq_lens_q"].numpy(), weighting, segment_examples)
    return {**batch, LOSS_WEIGHTS: torch.from_numpy(weights).unsqueeze(0), LOSS_WEIGHT_SUM: float(weights.sum(dtype=np.float64))}


def batch_normalizer(batch: dict) -> float:
    """What a batch adds to its global batch's normaliser: its weight sum, or its count of loss tokens."""
    return float(batch.get(LOSS_WEIGHT_SUM, batch[NUM_LOSS_TOKENS]))
