"""Bin packing of example lengths into fixed-capacity rows: lengths in, a plan out.

Pure functions over integer arrays: no files, no Beam. ``pack`` applies the overflow policy,
runs one of the packers, and returns a ``PackingPlan`` that lists each row's segments (example,
offset within the example, length) in row order, so the shard writer can gather tokens once.

Best-fit decreasing runs over counts, not items: with integer sizes, the bins that share a
remaining capacity are interchangeable, so items of one size are placed into a whole level of
bins with a few array operations. The work grows with the number of distinct (size, level)
pairs met, not with the number of items, which keeps it well above a million examples a second.
Its memory grows with the number of items alone: levels are kept only for the rooms that open
bins have, in a sorted list, so a capacity of 2**31 costs what a capacity of 64 does.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from schemas import Overflow, PackingAlgorithm, PackingError, PackingStats, one_of, positive_int


@dataclass(frozen=True)
class PackingPlan:
    """Rows of segments. Row ``i`` holds segments ``row_offsets[i]:row_offsets[i + 1]``."""

    capacity: int
    segment_example: np.ndarray  # int64 [S]: index of the source example
    segment_offset: np.ndarray  # int64 [S]: first token of the segment within its example
    segment_length: np.ndarray  # int64 [S]
    row_offsets: np.ndarray  # int64 [R + 1]
    stats: PackingStats

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.size - 1)

    def row_lengths(self) -> np.ndarray:
        """Tokens in each row."""
        ends = np.cumsum(self.segment_length)
        bounds = np.concatenate(([0], ends))[self.row_offsets]
        return np.diff(bounds)

    def row_slice(self, start: int, stop: int) -> PackingPlan:
        """The plan of rows ``start:stop``, for writing one shard; statistics stay those of the whole plan."""
        lo, hi = int(self.row_offsets[start]), int(self.row_offsets[stop])
        return PackingPlan(
            capacity=self.capacity,
            segment_example=self.segment_example[lo:hi],
            segment_offset=self.segment_offset[lo:hi],
            segment_length=self.segment_length[lo:hi],
            row_offsets=self.row_offsets[start : stop + 1] - lo,
            stats=self.stats,
        )


def _check_lengths(lengths: np.ndarray | list[int], capacity: int) -> np.ndarray:
    """Validate the inputs of ``pack`` and return the lengths as int64.

    Lengths are a 1-D sequence of positive whole numbers (floats such as 3.0 are accepted);
    an empty sequence is valid and packs into no rows.
    """
    if positive_int("capacity", capacity, PackingError) > np.iinfo(np.int64).max:
        raise PackingError(f"capacity must fit int64 (at most {np.iinfo(np.int64).max}), got {capacity}")
    try:
        array = np.asarray(lengths)
    except ValueError as err:
        raise PackingError(f"lengths must be a 1-D sequence of integers ({err})") from err
    if array.ndim != 1:
        raise PackingError(f"lengths must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        _check_whole_numbers(array)
    array = array.astype(np.int64)
    nonpositive = np.flatnonzero(array <= 0)
    if nonpositive.size:
        i = int(nonpositive[0])
        raise PackingError(
            f"example {i} has length {int(array[i])}: every example needs at least one token "
            f"({nonpositive.size} such examples); filter empty examples before packing"
        )
    return array


def _check_whole_numbers(array: np.ndarray) -> None:
    """Raise PackingError unless every value of a non-integer array is a whole number in int64 range."""
    if not np.issubdtype(array.dtype, np.floating):
        raise PackingError(f"lengths must be integers, got dtype {array.dtype}")
    bad = np.flatnonzero(~(np.abs(array) < 2.0**63) | (array != np.round(array)))
    if bad.size:
        i = int(bad[0])
        raise PackingError(f"lengths must be integers, got {array[i].item()!r} for example {i} (dtype {array.dtype})")


def _check_sizes(sizes: np.ndarray | list[int], capacity: int) -> np.ndarray:
    """Item sizes as int64, each in [1, capacity]: what every packer requires."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.size and (sizes.min() < 1 or sizes.max() > capacity):
        raise PackingError(
            f"item sizes must lie in [1, {capacity}], got [{sizes.min()}, {sizes.max()}]; "
            "pack() applies the overflow policy before packing"
        )
    return sizes


def _stable_argsort(keys: np.ndarray) -> np.ndarray:
    """Indices that sort non-negative integer ``keys``, keeping equal keys in index order.

    A least-significant-digit radix sort over 16-bit digits: numpy sorts 16-bit integers
    stably in linear time, far faster than a comparison sort of int64 keys.
    """
    order = np.arange(keys.size, dtype=np.int64)
    bits = int(keys.max()).bit_length() if keys.size else 0
    for shift in range(0, max(bits, 1), 16):
        digits = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digits, kind="stable")]
    return order


def _decreasing_order(sizes: np.ndarray, capacity: int, seed: int) -> np.ndarray:
    """Item indices by decreasing size; equal sizes in a seeded random order."""
    tiebreak = np.random.default_rng(seed).permutation(sizes.size)
    # by_rank[r] is the item of tiebreak rank r; a stable sort of it keeps that order among ties.
    by_rank = np.empty_like(tiebreak)
    by_rank[tiebreak] = np.arange(sizes.size)
    return by_rank[_stable_argsort(capacity - sizes[by_rank])]


def _apply_overflow(lengths: np.ndarray, capacity: int, overflow: str, stats: PackingStats) -> tuple[np.ndarray, ...]:
    """Turn examples into segments of at most ``capacity`` tokens under the overflow policy."""
    one_of("overflow", overflow, Overflow, PackingError)
    examples = np.arange(lengths.size, dtype=np.int64)
    long = lengths > capacity
    if not long.any():
        return examples, np.zeros_like(lengths), lengths
    if overflow == Overflow.ERROR:
        i = int(np.flatnonzero(long)[0])
        raise PackingError(
            f"example {i} has {int(lengths[i])} tokens, more than max length {capacity} "
            f"({int(long.sum())} such examples); use overflow split, truncate or drop"
        )
    if overflow == Overflow.DROP:
        stats.examples_dropped = int(long.sum())
        stats.tokens_dropped = int(lengths[long].sum())
        keep = ~long
        return examples[keep], np.zeros(int(keep.sum()), dtype=np.int64), lengths[keep]
    if overflow == Overflow.TRUNCATE:
        stats.examples_truncated = int(long.sum())
        stats.tokens_truncated = int((lengths[long] - capacity).sum())
        return examples, np.zeros_like(lengths), np.minimum(lengths, capacity)
    # split: chunks of exactly `capacity` tokens, then the remainder; nothing is lost.
    chunks = -(-lengths // capacity)
    stats.examples_split = int(long.sum())
    stats.tokens_split = int(lengths[long].sum())
    segment_example = np.repeat(examples, chunks)
    first_chunk = np.repeat(np.cumsum(chunks) - chunks, chunks)
    segment_offset = (np.arange(segment_example.size, dtype=np.int64) - first_chunk) * capacity
    segment_length = np.minimum(capacity, lengths[segment_example] - segment_offset)
    return segment_example, segment_offset, segment_length


def _sizes_and_counts(sizes: np.ndarray, order: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct sizes, largest first, and how many items have each; ``order`` sorts ``sizes`` decreasing."""
    if sizes.max() <= 4 * sizes.size:
        # A count per possible size costs no more memory than the items, and is the fastest way.
        items_of_size = np.bincount(sizes)
        distinct = np.flatnonzero(items_of_size)[::-1]
        return distinct.tolist(), items_of_size[distinct].tolist()
    decreasing = sizes[order]
    firsts = np.flatnonzero(np.diff(decreasing, prepend=0))
    return decreasing[firsts].tolist(), np.diff(firsts, append=sizes.size).tolist()


def best_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """Bin of each item under best-fit decreasing; sizes must lie in [1, capacity].

    Items are taken largest first (ties in a seeded random order); each goes to the open bin
    with the least room that still fits it, or to a new bin. Bins are numbered in opening order.
    Memory grows with the number of items, whatever the capacity.
    """
    sizes = _check_sizes(sizes, capacity)
    n = sizes.size
    bin_of_item = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_of_item
    order = _decreasing_order(sizes, capacity, seed)

    # levels[room]: stack of id arrays of bins with exactly `room` tokens left; only rooms that some
    # open bin has are keys, and open_rooms lists them in increasing order.
    levels: dict[int, list[np.ndarray]] = {}
    level_size: dict[int, int] = {}
    open_rooms: list[int] = []
    bin_of_sorted = np.empty(n, dtype=np.int64)
    bins_opened = 0

    def push(room: int, ids: np.ndarray) -> None:
        if room == 0:
            return  # a full bin takes nothing more
        if room in levels:
            levels[room].append(ids)
            level_size[room] += ids.size
        else:
            levels[room], level_size[room] = [ids], ids.size
            bisect.insort(open_rooms, room)

    def pop(room: int, count: int) -> np.ndarray:
        taken: list[np.ndarray] = []
        stack = levels[room]
        need = count
        while need:
            top = stack[-1]
            if top.size <= need:
                taken.append(stack.pop())
                need -= top.size
            else:
                taken.append(top[top.size - need :])
                stack[-1] = top[: top.size - need]
                need = 0
        level_size[room] -= count
        if not level_size[room]:
            del levels[room], level_size[room], open_rooms[bisect.bisect_left(open_rooms, room)]
        return taken[0] if len(taken) == 1 else np.concatenate(taken)

    pos = 0
    for size, remaining in zip(*_sizes_and_counts(sizes, order)):
        while remaining:
            # The tightest level with room for this size. Once a bin there takes an item it is
            # the tightest fit again (levels below were empty), so each bin takes room // size
            # items in a row before the next bin of the level is used.
            tightest = bisect.bisect_left(open_rooms, size)
            if tightest < len(open_rooms):
                room = open_rooms[tightest]
                per_bin = room // size
                available = level_size[room]
                full_bins = min(available, remaining // per_bin)
                rest = remaining - full_bins * per_bin if full_bins < available else 0
                ids = pop(room, full_bins + (1 if rest else 0))
            else:
                # No open bin fits: open as many new ones as this size needs.
                room = capacity
                per_bin = room // size
                full_bins, rest = divmod(remaining, per_bin)
                used = full_bins + (1 if rest else 0)
                ids = np.arange(bins_opened, bins_opened + used, dtype=np.int64)
                bins_opened += used
            placed = full_bins * per_bin + rest
            # per_bin is up to the capacity (items of 1 token in an empty bin): repeat no more than is placed.
            bin_of_sorted[pos : pos + placed] = np.repeat(ids, min(per_bin, placed))[:placed]
            if full_bins:
                push(room - per_bin * size, ids[:full_bins])
            if rest:
                push(room - rest * size, ids[full_bins:])
            pos += placed
            remaining -= placed
    bin_of_item[order] = bin_of_sorted
    return bin_of_item


def first_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """Bin of each item under first-fit decreasing (the lowest-numbered bin that fits); a baseline."""
    sizes = _check_sizes(sizes, capacity)
    n = sizes.size
    bin_of_item = np.empty(n, dtype=np.int64)
    if n == 0:
        return bin_of_item
    order = _decreasing_order(sizes, capacity, seed)
    # A max segment tree over the room of bins 0..leaves-1; unopened bins have full room.
    leaves = 1 << max(0, int(n - 1).bit_length())
    tree = [capacity] * (2 * leaves)
    for item, size in zip(order.tolist(), sizes[order].tolist()):
        node = 1
        while node < leaves:
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        bin_of_item[item] = node - leaves
        tree[node] -= size
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bin_of_item


def sequential(sizes: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """Bin of each item when filling rows in input order, starting a new row when the next does not fit."""
    del seed  # input order decides everything
    sizes = _check_sizes(sizes, capacity)
    bin_of_item = np.empty(sizes.size, dtype=np.int64)
    row, used = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if used + size > capacity:
            row, used = row + 1, 0
        bin_of_item[i] = row
        used += size
    return bin_of_item


PACKERS = {
    PackingAlgorithm.BEST_FIT_DECREASING: best_fit_decreasing,
    PackingAlgorithm.FIRST_FIT_DECREASING: first_fit_decreasing,
    PackingAlgorithm.SEQUENTIAL: sequential,
}


def pack(
    lengths: np.ndarray | list[int],
    capacity: int,
    overflow: str = Overflow.SPLIT,
    algorithm: str = PackingAlgorithm.BEST_FIT_DECREASING,
    seed: int = 0,
) -> PackingPlan:
    """Pack examples of the given token lengths into rows of at most ``capacity`` tokens.

    Rows are put in a seeded random order (except under ``sequential``, which keeps input
    order); segments within a row are ordered by example. The same inputs and seed always
    give the same plan. No lengths give a plan of no rows; bad lengths or settings raise
    PackingError.

    Three examples of 3, 2 and 4 tokens in rows of 5: best-fit decreasing puts 4 alone and 3
    with 2, 9 tokens in 10 slots. Row ``i`` holds segments ``row_offsets[i]:row_offsets[i + 1]``:

    >>> plan = pack([3, 2, 4], capacity=5)
    >>> plan.row_offsets.tolist(), plan.segment_example.tolist(), plan.segment_length.tolist()
    ([0, 1, 3], [2, 0, 1], [4, 3, 2])
    >>> plan.stats.fill
    0.9

    An example longer than a row is cut into chunks under ``split``; ``segment_offset`` says
    where each chunk starts in its example:

    >>> plan = pack([3, 7], capacity=5, overflow="split")
    >>> plan.segment_example.tolist(), plan.segment_offset.tolist(), plan.segment_length.tolist()
    ([1, 0, 1], [0, 0, 5], [5, 3, 2])
    """
    one_of("algorithm", algorithm, PackingAlgorithm, PackingError)
    lengths = _check_lengths(lengths, capacity)
    stats = PackingStats(examples=int(lengths.size))
    segment_example, segment_offset, segment_length = _apply_overflow(lengths, capacity, overflow, stats)

    bin_of_segment = PACKERS[algorithm](segment_length, capacity, seed)
    num_rows = int(bin_of_segment.max()) + 1 if bin_of_segment.size else 0
    if algorithm == PackingAlgorithm.SEQUENTIAL:
        row_of_segment = bin_of_segment
    else:
        row_of_segment = np.random.default_rng([seed, 1]).permutation(num_rows)[bin_of_segment]
    # Segments come in (example, offset) order, which a stable sort by row keeps within each row.
    order = _stable_argsort(row_of_segment)
    segments_in_row = np.bincount(row_of_segment, minlength=num_rows)

    stats.segments = int(segment_length.size)
    stats.tokens = int(segment_length.sum())
    stats.rows = num_rows
    stats.capacity_tokens = num_rows * int(capacity)
    rows_with = np.bincount(segments_in_row)
    stats.segments_per_row = {str(c): int(rows_with[c]) for c in np.flatnonzero(rows_with).tolist()}
    return PackingPlan(
        capacity=int(capacity),
        segment_example=segment_example[order],
        segment_offset=segment_offset[order],
        segment_length=segment_length[order],
        row_offsets=np.concatenate(([0], np.cumsum(segments_in_row))),
        stats=stats,
    )
