"""Pack a group of examples, then write down, for each shard, where its segments' tokens lie.

Packing a group gives a plan of rows. The plan is cut into shards of ``rows_per_shard`` rows,
and each shard's part of it is written to a small file in the spill directory (a ``ShardPlan``:
the shard's segments, and for each one the spill file and position of its tokens). Only the
file's path travels on to the shard's writer, which reads the plan, gathers the tokens from
the spill files through memory maps and builds the rows. So after packing, nothing the size
of the dataset is held in memory or moved through a shuffle.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.packing.algorithms import PackingPlan, pack
from pipeline.packing.groups import BatchKey
from pipeline.packing.pairs import pair_segments, pair_stats
from pipeline.packing.rows import build_rows
from pipeline.packing.spill import SpilledExamples, read_examples, read_spilled
from pipeline.ranges import gather_index
from schemas import PackingStats


@dataclass(frozen=True)
class GroupBatch:
    """The rows of one tokenized batch that fall in a packing group: rows ``[start_row, end_row)`` of the batch
    with key ``key``, first source row ``first_row`` and spill file ``path`` (rows past ``end_row`` are in later
    groups or past ``--num-examples``). An example's id is ``first_row`` plus its row in the batch."""

    key: BatchKey
    first_row: int
    end_row: int
    path: str
    start_row: int = 0

    def examples(self) -> SpilledExamples:
        """The lengths, rows and (pairs) segments of the part's examples, read from beside the batch's spill file."""
        return read_examples(self.path).between(self.start_row, self.end_row)


@dataclass(frozen=True)
class PackedGroup:
    """A packed group: its statistics and the plan file of each of its shards, in order."""

    group: int
    stats: PackingStats
    shard_plans: tuple[str, ...]


@dataclass(frozen=True)
class ShardPlan:
    """The rows of one shard, and where each of their segments' tokens lie in the spill files.

    ``plan.segment_example`` holds dataset-wide example ids (source row numbers). Segment ``j`` is tokens
    ``token_start[j] : token_start[j] + plan.segment_length[j]`` of spill file ``sources[source[j]]``.
    """

    plan: PackingPlan
    source: np.ndarray  # int64 [segments]: index into ``sources``
    token_start: np.ndarray  # int64 [segments]
    sources: np.ndarray  # str [files]

    def save(self, path: str) -> None:
        """Write the plan to ``path`` (a local path or a URL)."""
        buffer = io.BytesIO()
        np.savez(
            buffer,
            capacity=np.int64(self.plan.capacity),
            segment_example=self.plan.segment_example,
            segment_offset=self.plan.segment_offset,
            segment_length=self.plan.segment_length,
            row_offsets=self.plan.row_offsets,
            source=self.source,
            token_start=self.token_start,
            sources=self.sources,
        )
        storage.write_scratch(path, lambda local: Path(local).write_bytes(buffer.getbuffer()))

    @classmethod
    def load(cls, path: str) -> ShardPlan:
        with storage.open_read(path) as f:
            arrays = np.load(io.BytesIO(f.read()), allow_pickle=False)
        plan = PackingPlan(
            capacity=int(arrays["capacity"]),
            segment_example=arrays["segment_example"],
            segment_offset=arrays["segment_offset"],
            segment_length=arrays["segment_length"],
            row_offsets=arrays["row_offsets"],
            stats=PackingStats(),
        )
        return cls(plan, arrays["source"], arrays["token_start"], arrays["sources"])


def shard_plan_path(plan_dir: str, group: int, local_shard: int) -> str:
    """Where the plan of a group's ``local_shard``-th shard is written."""
    return storage.join(plan_dir, f"plan-{group:06d}-{local_shard:06d}.npz")


def pack_group(
    group: int,
    batches: list[GroupBatch],
    capacity: int,
    overflow: str,
    algorithm: str,
    seed: int,
    rows_per_shard: int,
    plan_dir: str,
) -> PackedGroup | None:
    """Pack the examples of a group's parts of batches (consecutive in the dataset) and write one plan file per
    shard; None when the group's kept rows made no example (all bad rows, or past ``--num-examples``)."""
    read = [(b, b.examples()) for b in sorted(batches, key=lambda b: b.first_row + b.start_row)]
    read = [(b, e) for b, e in read if e.lengths.size]
    if not read:
        return None
    batches, examples = [b for b, _ in read], [e for _, e in read]
    lengths = np.concatenate([e.lengths for e in examples]).astype(np.int64)
    plan = pack(lengths, capacity, overflow=overflow, algorithm=algorithm, seed=seed)
    del lengths
    if any(e.segments is not None for e in examples):
        # A pair is one item to pack and two or three segments in its row: the statistics count those.
        plan = dataclasses.replace(plan, stats=pair_stats(plan, np.concatenate([e.segments for e in examples])))
    # Where each example's tokens start in its batch's spill file.
    starts = [e.token_start + np.cumsum(e.lengths, dtype=np.int64) - e.lengths for e in examples]
    example_start = np.concatenate(starts)
    batch_of_example = np.repeat(np.arange(len(batches)), [e.lengths.size for e in examples])
    ids = [b.first_row + e.rows.astype(np.int64) for b, e in zip(batches, examples)]
    example_ids = np.concatenate(ids)
    del read, examples, starts, ids
    paths = np.array([b.path for b in batches], dtype=str)
    shard_paths = []
    for local, start in enumerate(range(0, plan.num_rows, rows_per_shard)):
        rows = plan.row_slice(start, min(start + rows_per_shard, plan.num_rows))
        batch = batch_of_example[rows.segment_example]
        used, source = np.unique(batch, return_inverse=True)
        token_start = example_start[rows.segment_example] + rows.segment_offset
        rows = dataclasses.replace(rows, segment_example=example_ids[rows.segment_example], stats=PackingStats())
        path = shard_plan_path(plan_dir, group, local)
        ShardPlan(rows, source.astype(np.int64), token_start, paths[used]).save(path)
        shard_paths.append(path)
    return PackedGroup(group, plan.stats, tuple(shard_paths))


def assemble_shard(shard_plan: ShardPlan) -> pa.Table:
    """The rows of a shard, its segments' tokens gathered from the spill files its plan names."""
    plan = shard_plan.plan
    order = np.argsort(shard_plan.source, kind="stable")
    bounds = np.flatnonzero(np.diff(shard_plan.source[order])) + 1
    tokens, loss_mask, roles = [], [], []
    for segments in np.split(order, bounds) if order.size else []:
        source_tokens, source_mask, source_roles = read_spilled(str(shard_plan.sources[shard_plan.source[segments[0]]]))
        index = gather_index(shard_plan.token_start[segments], plan.segment_length[segments])
        if index.size and index[-1] >= source_tokens.size:
            source = shard_plan.sources[shard_plan.source[segments[0]]]
            raise RuntimeError(f"a shard plan points past the end of {source}: routing is broken")
        tokens.append(source_tokens[index])
        loss_mask.append(source_mask[index])
        if source_roles is not None:
            roles.append(source_roles[index])
    lengths = plan.segment_length[order]
    segment_starts = np.empty(order.size, dtype=np.int64)
    segment_starts[order] = np.cumsum(lengths) - lengths
    if not roles:
        return build_rows(plan, segment_starts, np.concatenate(tokens), np.concatenate(loss_mask))
    # Preference pairs: tokens in plan order, each pair then cut into its segments.
    gather = gather_index(segment_starts, plan.segment_length)
    pairs, segment_roles = pair_segments(plan, np.concatenate(roles)[gather])
    in_order = np.cumsum(pairs.segment_length) - pairs.segment_length
    return build_rows(pairs, in_order, np.concatenate(tokens)[gather], np.concatenate(loss_mask)[gather], roles=segment_roles)

