"""What the report's figures show, read from a build's shards: example and segment lengths, and rows."""

from __future__ import annotations


from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline import storage
from schemas import Manifest, ShardError, ShardInfo, list_parts, validate_table
from schemas.arrow_file import open_arrow_file


def read_shard_table(build_dir: str, info: ShardInfo, capacity: int) -> pa.Table:
    """One shard of the build as an Arrow table (memory-mapped when local), checked against the row schema."""
    path = storage.join(build_dir, info.path)
    try:
        table = open_arrow_file(path).read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ShardError(path, f"is missing or not a readable Arrow IPC file ({err}); rebuild the build") from err
    validate_table(table, capacity, path)
    return table


@dataclass(frozen=True)
class Profile:
    """What the figures show, read from the shards: the lengths before and after overflow handling, and the rows."""

    capacity: int
    example_lengths: np.ndarray  # int64 [examples in the shards]: split examples' chunks joined
    segment_lengths: np.ndarray  # int64 [segments]: what attention sees, at most capacity
    row_tokens: np.ndarray  # int64 [rows]
    row_segments: np.ndarray  # int64 [rows]


def read_profile(build_dir: str, manifest: Manifest) -> Profile:
    """Lengths and row sizes of every row of the build, read shard by shard (boundaries only, not tokens)."""
    split = bool(manifest.stats.examples_split)
    shards = [_shard_profile(build_dir, info, manifest.capacity, split) for info in manifest.shards]
    segment_lengths, example_ids, row_tokens, row_segments = (list(parts) for parts in zip(*shards))
    segments = np.concatenate(segment_lengths)
    if split:
        _, example_of_segment = np.unique(np.concatenate(example_ids), return_inverse=True)
        examples = np.bincount(example_of_segment, weights=segments).astype(np.int64)
    else:
        examples = segments
    return Profile(manifest.capacity, examples, segments, np.concatenate(row_tokens), np.concatenate(row_segments))


def _shard_profile(
    build_dir: str, info: ShardInfo, capacity: int, with_ids: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """One shard's segment lengths, example ids (when ``with_ids``), row tokens and row segments, each a copy:
    the shard is unmapped on return, so reading a build holds one shard's pages at a time, not all of them."""
    table = read_shard_table(build_dir, info, capacity)
    cu_offsets, cu = list_parts(table.column("cu_seqlens"))
    steps = np.diff(cu)
    within_row = np.ones(steps.size, dtype=bool)
    within_row[cu_offsets[1:-1] - 1] = False
    ids = list_parts(table.column("example_ids"))[1].copy() if with_ids else None
    return (
        steps[within_row].astype(np.int64),
        ids,
        table.column("num_tokens").to_numpy().astype(np.int64),
        np.diff(cu_offsets).astype(np.int64) - 1,
    )
