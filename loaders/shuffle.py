"""The order in which an epoch reads rows: shards shuffled, then rows within a bounded window.

Pure functions of (seed, epoch) over integer arrays, so every rank and every DataLoader worker
computes the same order without talking to each other.
"""

from __future__ import annotations

import numpy as np


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator every shuffle of ``epoch`` draws from (PCG64; the same on every platform)."""
    return np.random.default_rng([seed, epoch])


def epoch_row_order(shard_rows: np.ndarray, *, seed: int, epoch: int, shuffle: bool, buffer_rows: int) -> np.ndarray:
    """Global row ids (shard 0's rows first, then shard 1's, ...) in the order epoch ``epoch`` reads them.

    Without ``shuffle``: every row in storage order. With it: the shards in a random order, their
    rows concatenated, then the rows permuted within consecutive windows of ``buffer_rows`` rows
    of that stream. The windows start at a random phase each epoch, so their boundaries move.
    A row therefore moves at most ``buffer_rows`` places from its shard's position, and any
    stretch of the epoch reads from a bounded number of shards, as a streaming shuffle buffer
    of that size would, but the whole order is known up front, which makes resume a seek.
    """
    shard_rows = np.asarray(shard_rows, dtype=np.int64)
    total = int(shard_rows.sum())
    if not shuffle:
        return np.arange(total, dtype=np.int64)
    if buffer_rows < 1:
        raise ValueError(f"shuffle_buffer_rows must be at least 1, got {buffer_rows}")
    rng = epoch_rng(seed, epoch)
    first_row = np.concatenate(([0], np.cumsum(shard_rows)[:-1]))
    shard_order = rng.permutation(shard_rows.size)
    lengths = shard_rows[shard_order]
    ends = np.cumsum(lengths)
    stream = np.arange(total, dtype=np.int64) + np.repeat(first_row[shard_order] - (ends - lengths), lengths)
    if buffer_rows == 1 or total == 0:
        return stream
    phase = int(rng.integers(buffer_rows))
    bounds = np.unique(np.concatenate(([0], np.arange(buffer_rows - phase, total, buffer_rows), [total])))
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        stream[start:stop] = stream[start:stop][rng.permutation(stop - start)]
    return stream
