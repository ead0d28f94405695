"""Pack a group of examples, then send each example's tokens to the shard that holds its row.

The packing plan of a group is cut into shards of ``rows_per_shard`` rows. Each tokenized
batch gets a ``Route`` listing, for its segments (whole examples, or chunks of split ones),
the shard and the position within the shard's segment list. ``route_tokens`` turns a route
into one ``Piece`` per shard: where each segment's tokens lie in the batch's spill file.
``assemble_shard`` gathers a shard's tokens from the spill files of its pieces in one
vectorised step each, puts them in plan order and builds its rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.layout import BatchKey
from pipeline.packing import PackingPlan, pack
from pipeline.shard_writer import build_rows, gather_index
from pipeline.spill import SpilledBatch, read_spilled
from schemas import PackingStats


@dataclass(frozen=True)
class GroupPlan:
    """The packing plan of one group; ``plan.segment_example`` holds dataset-wide example ids."""

    group: int
    plan: PackingPlan
    batch_keys: tuple[BatchKey, ...]  # the group's batches in source order
    batch_first_ids: np.ndarray  # int64: id of each batch's first example

    def num_shards(self, rows_per_shard: int) -> int:
        return -(-self.plan.num_rows // rows_per_shard)


@dataclass(frozen=True)
class Route:
    """Segments of one batch, sorted by shard then position: where each one goes and which tokens it takes."""

    shard: np.ndarray  # int64: shard index
    position: np.ndarray  # int64: index of the segment within the shard's plan
    example: np.ndarray  # int64: example index within the batch
    offset: np.ndarray  # int64: first token of the segment within the example
    length: np.ndarray  # int64


@dataclass(frozen=True)
class Piece:
    """The segments one batch contributes to one shard: their places in the shard and in the batch's spill file."""

    position: np.ndarray  # int64 [segments]: index of the segment within the shard's plan
    length: np.ndarray  # int64 [segments]
    source: str  # the batch's spill file
    token_start: np.ndarray  # int64 [segments]: first token of the segment in the spill file


def pack_group(
    group: int,
    batches: list[tuple[BatchKey, int, np.ndarray]],
    capacity: int,
    overflow: str,
    algorithm: str,
    seed: int,
) -> GroupPlan:
    """Pack the examples of ``(key, first id, lengths)`` batches, consecutive in the dataset, as one group."""
    batches = sorted(batches, key=lambda b: b[1])
    lengths = np.concatenate([b[2] for b in batches]) if batches else np.zeros(0, dtype=np.int64)
    first_ids = np.array([b[1] for b in batches], dtype=np.int64)
    plan = pack(lengths, capacity, overflow=overflow, algorithm=algorithm, seed=seed)
    group_first = int(first_ids[0]) if batches else 0
    plan = dataclasses.replace(plan, segment_example=plan.segment_example + group_first)
    return GroupPlan(group, plan, tuple(b[0] for b in batches), first_ids)


def shard_plans(group_plan: GroupPlan, first_shard: int, rows_per_shard: int) -> list[tuple[int, PackingPlan]]:
    """``(shard index, plan of its rows)`` for each shard of the group."""
    rows = group_plan.plan.num_rows
    return [
        (first_shard + i, group_plan.plan.row_slice(start, min(start + rows_per_shard, rows)))
        for i, start in enumerate(range(0, rows, rows_per_shard))
    ]


def routes(group_plan: GroupPlan, first_shard: int, rows_per_shard: int) -> list[tuple[BatchKey, Route]]:
    """The route of every batch of the group that has segments in it."""
    plan = group_plan.plan
    segments = plan.segment_example.size
    if segments == 0:
        return []
    row_of_segment = np.repeat(np.arange(plan.num_rows), np.diff(plan.row_offsets))
    local_shard = row_of_segment // rows_per_shard
    position = np.arange(segments) - plan.row_offsets[local_shard * rows_per_shard]
    batch = np.searchsorted(group_plan.batch_first_ids, plan.segment_example, side="right") - 1
    order = np.lexsort((position, local_shard, batch))
    batch, local_shard, position = batch[order], local_shard[order], position[order]
    example = plan.segment_example[order] - group_plan.batch_first_ids[batch]
    offset, length = plan.segment_offset[order], plan.segment_length[order]
    cuts = np.flatnonzero(np.diff(batch)) + 1
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [segments]))
    return [
        (
            group_plan.batch_keys[int(batch[a])],
            Route(first_shard + local_shard[a:b], position[a:b], example[a:b], offset[a:b], length[a:b]),
        )
        for a, b in zip(starts.tolist(), ends.tolist())
    ]


def route_tokens(batch: SpilledBatch, route: Route) -> list[tuple[int, Piece]]:
    """Split a batch's routed segments into one Piece per shard that needs some of them."""
    token_start = batch.starts[route.example] + route.offset
    cuts = np.flatnonzero(np.diff(route.shard)) + 1
    bounds = zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [route.shard.size])).tolist())
    return [
        (int(route.shard[a]), Piece(route.position[a:b], route.length[a:b], batch.path, token_start[a:b]))
        for a, b in bounds
    ]


def assemble_shard(plan: PackingPlan, pieces: list[Piece]) -> pa.Table:
    """The rows of a shard from its plan and the pieces of every batch that feeds it."""
    position = np.concatenate([p.position for p in pieces])
    length = np.concatenate([p.length for p in pieces])
    segments = plan.segment_length.size
    if position.size != segments or np.bincount(position, minlength=segments).max(initial=0) != 1:
        raise RuntimeError(f"a shard received {position.size} segments for a plan of {segments}: routing is broken")
    if not np.array_equal(length, plan.segment_length[position]):
        raise RuntimeError("a shard received segments whose lengths differ from its plan: routing is broken")
    segment_starts = np.empty(segments, dtype=np.int64)
    segment_starts[position] = np.cumsum(length) - length
    tokens, loss_mask = [], []
    for piece in pieces:
        source_tokens, source_mask = read_spilled(piece.source)
        index = gather_index(piece.token_start, piece.length)
        tokens.append(source_tokens[index])
        loss_mask.append(source_mask[index])
    return build_rows(plan, segment_starts, np.concatenate(tokens), np.concatenate(loss_mask))


def merge_stats(parts: list[PackingStats]) -> PackingStats:
    """The statistics of the whole dataset from those of its groups."""
    total = PackingStats()
    for part in parts:
        for field in dataclasses.fields(PackingStats):
            if field.name == "segments_per_row":
                for count, rows in part.segments_per_row.items():
                    total.segments_per_row[count] = total.segments_per_row.get(count, 0) + rows
            else:
                setattr(total, field.name, getattr(total, field.name) + getattr(part, field.name))
    total.segments_per_row = dict(sorted(total.segments_per_row.items(), key=lambda item: int(item[0])))
    return total
