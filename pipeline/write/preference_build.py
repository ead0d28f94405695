"""A build of preference pairs of given token ids, written without a tokenizer or Beam: for tests and benchmarks.

Each pair is laid out as the preference contract lays it out (``schemas.PreferenceLayout``), packed whole
with best-fit decreasing by the project's packer, cut into its segments by ``pipeline.packing.pairs`` and
written with the pipeline's own two steps, ``publish_shard`` and ``finish_build``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.packing.algorithms import pack
from pipeline.packing.pairs import pair_segments
from pipeline.packing.rows import build_rows
from pipeline.ranges import gather_index
from pipeline.write.shard_writer import finish_build, publish_shard
from schemas import (
    BuildInputs,
    DatasetInputs,
    LossMasking,
    Manifest,
    Overflow,
    PackingAlgorithm,
    PackingStats,
    PreferenceLayout,
    Role,
    TokenizerInputs,
    compute_fingerprint,
)
from schemas.manifest import BuildFormat
from schemas.shard_identity import ShardIdentity


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair's token ids."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def laid_out(pair: PreferencePair, layout: str) -> tuple[list[int], list[int], list[int]]:
    """``pair``'s tokens in ``layout``, with each token's loss mask and role (``schemas.Role``). A shared
    prompt of one token gives the separate shape, as the pipeline lays it out.

    >>> laid_out(PreferencePair([5, 6], [7], [8, 9]), "shared-prompt")
    ([5, 6, 7, 6, 8, 9], [0, 0, 1, 0, 1, 1], [0, 1, 1, 2, 2, 2])
    >>> laid_out(PreferencePair([5], [7], [8]), "separate")
    ([5, 7, 5, 8], [0, 1, 0, 1], [1, 1, 2, 2])
    """
    p, c, r = pair.prompt, pair.chosen, pair.rejected
    if layout not in tuple(PreferenceLayout):
        raise ValueError(f"unknown preference layout {layout!r}; layouts are {', '.join(PreferenceLayout)}")
    head = p[:-1] if layout == PreferenceLayout.SHARED_PROMPT else []
    shared = p[len(head) :]
    tokens = head + shared + c + shared + r
    loss_mask = [0] * (len(head) + len(shared)) + [1] * len(c) + [0] * len(shared) + [1] * len(r)
    roles = [Role.PROMPT] * len(head) + [Role.CHOSEN] * (len(shared) + len(c)) + [Role.REJECTED] * (len(shared) + len(r))
    return tokens, loss_mask, [int(role) for role in roles]


def preference_build(
    out_dir: str | os.PathLike[str],
    pairs: list[PreferencePair],
    layout: str = PreferenceLayout.SEPARATE,
    capacity: int = 64,
    rows_per_shard: int = 4,
    vocab_size: int = 128,
) -> Manifest:
    """Pack whole ``pairs`` (best-fit decreasing over each pair's tokens in ``layout``) into rows of
    ``schemas.PREFERENCE_ROW_SCHEMA`` and write shards and a manifest into ``out_dir``; pair ids are the
    pairs' indices. A pair longer than ``capacity`` raises ValueError."""
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tokens, loss_mask, roles = (list(part) for part in zip(*(laid_out(pair, layout) for pair in pairs)))
    sizes = np.array([len(t) for t in tokens], dtype=np.int64)
    plan = pack(sizes, capacity, overflow=Overflow.DROP, algorithm=PackingAlgorithm.BEST_FIT_DECREASING)
    if plan.stats.examples_dropped:
        raise ValueError(f"{plan.stats.examples_dropped} pairs are longer than a row of {capacity} tokens")
    starts = np.cumsum(sizes) - sizes
    order = gather_index(starts[plan.segment_example], sizes[plan.segment_example])  # the pairs' tokens in plan order
    flat_roles = np.concatenate([np.asarray(r, np.uint8) for r in roles])[order]
    segments, segment_roles = pair_segments(plan, flat_roles)
    segment_starts = np.cumsum(segments.segment_length) - segments.segment_length
    table = build_rows(
        segments,
        segment_starts,
        np.concatenate([np.asarray(t, np.int64) for t in tokens])[order],
        np.concatenate([np.asarray(m, np.uint8) for m in loss_mask])[order],
        roles=segment_roles,
    )
    inputs = BuildInputs(
        dataset=DatasetInputs(
            id=f"synthetic-pairs-{layout}",
            split="train",
            content_hash=hashlib.sha256(json.dumps([layout, [asdict(p) for p in pairs]]).encode()).hexdigest(),
            num_examples=len(pairs),
        ),
        tokenizer=TokenizerInputs(name="synthetic", content_hash=f"vocab-{vocab_size}", vocab_size=vocab_size),
        template="none",
        loss_masking=LossMasking.GIVEN,
        max_len=capacity,
        overflow=Overflow.DROP,
        packing=PackingAlgorithm.BEST_FIT_DECREASING,
        seed=0,
        package_version="0.1.0",
        format=BuildFormat.PREFERENCE,
        preference_layout=layout,
    )
    fingerprint = compute_fingerprint(inputs)
    starts_of_shards = range(0, table.num_rows, rows_per_shard)
    shards = [
        publish_shard(
            table.slice(start, rows_per_shard),
            out_dir,
            capacity,
            ShardIdentity(fingerprint, index, start + rows_per_shard >= table.num_rows),
        )
        for index, start in enumerate(starts_of_shards)
    ]
    segments_in_row = np.diff(segments.row_offsets)
    counts = np.bincount(segments_in_row)
    stats = PackingStats(
        examples=len(pairs),
        segments=int(segments_in_row.sum()),
        tokens=int(sizes.sum()),
        rows=table.num_rows,
        capacity_tokens=capacity * table.num_rows,
        num_example_ids=len(pairs),
        pairs=len(pairs),
        segments_per_row={str(n): int(counts[n]) for n in np.flatnonzero(counts)},
    )
    return finish_build(out_dir, inputs, rows_per_shard, shards, stats)
