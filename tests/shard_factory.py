"""Build a small shard directory from given example lengths, through the real packer and writer.

For loader tests and benchmarks: random token ids, the first part of each example a prompt
(loss mask 0), packed with best-fit decreasing, written with ``pipeline.shard_writer`` and a
manifest that validates. ``ShardDir`` keeps the source examples so a test can check that the
loader hands back exactly these tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pipeline.packing import pack
from pipeline.shard_writer import build_rows, default_rows_per_shard, shard_name, write_shard
from schemas import BuildInputs, DatasetInputs, Manifest, TokenizerInputs, compute_fingerprint, write_manifest


@dataclass(frozen=True)
class ShardDir:
    """A written build and the examples it was packed from."""

    path: Path
    manifest: Manifest
    tokens: np.ndarray  # int32, every example's tokens back to back
    loss_mask: np.ndarray  # uint8, aligned with tokens
    starts: np.ndarray  # int64 [examples]: where each example begins in tokens
    lengths: np.ndarray  # int64 [examples]

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss_mask) of example ``i``."""
        a, b = int(self.starts[i]), int(self.starts[i] + self.lengths[i])
        return self.tokens[a:b], self.loss_mask[a:b]


def build_shard_dir(
    path: str | Path,
    lengths: np.ndarray | list[int],
    *,
    capacity: int = 64,
    rows_per_shard: int | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
    overflow: str = "split",
) -> ShardDir:
    """Pack examples of ``lengths`` tokens into rows of ``capacity`` and write shards + manifest into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    tokens = rng.integers(1, vocab_size, int(lengths.sum()), dtype=np.int32)
    # A prompt of up to half the example (none for about a third), trained on after it.
    prompt = (lengths * rng.uniform(0.0, 0.5, lengths.size) * (rng.random(lengths.size) > 0.3)).astype(np.int64)
    position = np.arange(tokens.size) - np.repeat(starts, lengths)
    loss_mask = (position >= np.repeat(prompt, lengths)).astype(np.uint8)

    plan = pack(lengths, capacity, overflow=overflow, seed=seed)
    segment_starts = starts[plan.segment_example] + plan.segment_offset
    rows_per_shard = rows_per_shard or default_rows_per_shard(capacity)
    shards = []
    for index, first in enumerate(range(0, plan.num_rows, rows_per_shard)):
        last = min(first + rows_per_shard, plan.num_rows)
        part = plan.row_slice(first, last)
        lo, hi = int(plan.row_offsets[first]), int(plan.row_offsets[last])
        table = build_rows(part, segment_starts[lo:hi], tokens, loss_mask)
        shards.append(write_shard(table, path, shard_name(index), capacity))

    inputs = BuildInputs(
        dataset=DatasetInputs(
            id="synthetic-random",
            split="train",
            content_hash=hashlib.sha256(tokens.tobytes() + loss_mask.tobytes()).hexdigest(),
            num_examples=int(lengths.size),
        ),
        tokenizer=TokenizerInputs(name="synthetic", content_hash=f"vocab-{vocab_size}", vocab_size=vocab_size),
        template="none",
        loss_masking="prompt",
        max_len=capacity,
        overflow=overflow,
        packing="best_fit_decreasing",
        seed=seed,
        package_version="0.1.0",
    )
    manifest = Manifest(
        fingerprint=compute_fingerprint(inputs),
        inputs=inputs,
        capacity=capacity,
        rows_per_shard=rows_per_shard,
        shards=shards,
        stats=plan.stats,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    write_manifest(manifest, path)
    return ShardDir(path=path, manifest=manifest, tokens=tokens, loss_mask=loss_mask, starts=starts, lengths=lengths)
