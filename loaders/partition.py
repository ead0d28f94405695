"""Which rows form each batch of an epoch, and which rank and DataLoader worker reads it.

The epoch is first cut into one global list of batches, independent of the number of ranks
and workers. Global batch ``i`` goes to rank ``i % world_size``; a rank's ``j``-th batch goes
to worker ``j % num_workers``. A DataLoader takes one batch from each worker in turn, so the
batches reach the training loop in the rank's order whatever the number of workers, and the
count of batches consumed is all a resume needs. Every rank at the same step has read the first
``batches * world_size`` batches (``EpochPlan.rows_read``): a resume on another number of ranks,
or with another batch size, cuts its list from the rows after them.

Every rank gets the same number of batches: the last ``num_batches % world_size`` global
batches of an epoch are dropped (fewer than one batch per rank), and in row mode so are the
``num_rows % batch_rows`` rows that do not fill a batch. Nothing is ever repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from schemas import positive_int

MAX_PROCESSES = (1 << 31) - 1  # ranks, or DataLoader workers: torch counts both in a C int


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the arguments when given, else torch.distributed's when initialised, else (0, 1).

    Explicit arguments win so that a job with tensor or pipeline parallelism can pass its
    data-parallel rank and size, which differ from the global ones.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither (to take them from torch.distributed)")
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    world_size = positive_int("world_size", world_size)
    if world_size > MAX_PROCESSES:
        raise ValueError(f"world_size must be at most {MAX_PROCESSES} (torch.distributed counts ranks in a C int), "
                         f"got {world_size}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size


def batch_bounds_by_rows(num_rows: int, batch_rows: int) -> np.ndarray:
    """Offsets of batches of exactly ``batch_rows`` consecutive rows; the rows left over are dropped."""
    full = num_rows // batch_rows
    return np.arange(0, full * batch_rows + 1, batch_rows, dtype=np.int64)


def batch_bounds_by_tokens(row_tokens: np.ndarray, tokens_per_batch: int) -> np.ndarray:
    """Offsets of batches of consecutive rows, each as many rows as fit in ``tokens_per_batch``.

    Greedy in order: a batch closes when the next row would overflow the budget. Every row
    must fit alone (the caller checks the budget against the capacity), so no row is dropped.
    """
    ends = np.cumsum(np.asarray(row_tokens, dtype=np.int64))
    if ends.size and np.max(row_tokens) > tokens_per_batch:
        raise ValueError(f"a row of {int(np.max(row_tokens))} tokens does not fit tokens_per_batch={tokens_per_batch}")
    bounds = [0]
    filled = 0
    while bounds[-1] < ends.size:
        stop = int(np.searchsorted(ends, filled + tokens_per_batch, side="right"))
        bounds.append(stop)
        filled = int(ends[stop - 1])
    return np.asarray(bounds, dtype=np.int64)


def rank_batch_ids(num_batches: int, rank: int, world_size: int) -> np.ndarray:
    """Global batch ids of ``rank``, in order: rank, rank + world_size, ...; the same count on every rank."""
    return rank + world_size * np.arange(num_batches // world_size, dtype=np.int64)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's batches of one epoch: batch ``j`` holds ``rows[bounds[b]:bounds[b + 1]]``, ``b = batch_ids[j]``."""

    rows: np.ndarray  # int64 global row ids in epoch order
    bounds: np.ndarray  # int64 [num_global_batches + 1]
    batch_ids: np.ndarray  # int64 global batch ids of this rank, in order
    world_size: int

    def __len__(self) -> int:
        return int(self.batch_ids.size)

    def batch_rows(self, position: int) -> np.ndarray:
        """Global row ids of the rank's batch at ``position``."""
        b = int(self.batch_ids[position])
        return self.rows[self.bounds[b] : self.bounds[b + 1]]

    def rows_read(self, batches: int) -> int:
        """Rows of ``rows`` that all ranks have read once each has read its first ``batches`` batches."""
        return int(self.bounds[min(batches, len(self)) * self.world_size])

    @property
    def dropped_rows(self) -> np.ndarray:
        """Rows of the epoch that no rank reads (see the module docstring)."""
        num_batches = self.bounds.size - 1
        return self.rows[self.bounds[num_batches - num_batches % self.world_size] :]


def plan_epoch(
    rows: np.ndarray,
    row_tokens: np.ndarray,
    *,
    rank: int,
    world_size: int,
    batch_rows: int,
    tokens_per_batch: int | None,
) -> EpochPlan:
    """Cut the epoch's row order into global batches (by rows, or by token budget when given) and keep ``rank``'s."""
    if tokens_per_batch is None:
        bounds = batch_bounds_by_rows(rows.size, batch_rows)
    else:
        bounds = batch_bounds_by_tokens(row_tokens[rows], tokens_per_batch)
    batch_ids = rank_batch_ids(bounds.size - 1, rank, world_size)
    return EpochPlan(rows=rows, bounds=bounds, batch_ids=batch_ids, world_size=world_size)


def max_rows_per_batch(row_tokens: np.ndarray, tokens_per_batch: int) -> int:
    """The most rows any batch under this token budget can hold: as many of the shortest rows as fit."""
    ends = np.cumsum(np.sort(np.asarray(row_tokens, dtype=np.int64)))
    return int(np.searchsorted(ends, tokens_per_batch, side="right"))


def max_segments_per_batch(segments_per_row: dict[str, int], rows: int) -> int:
    """An upper bound on the segments in a batch of ``rows`` rows: the sum over the ``rows`` fullest rows.

    ``segments_per_row`` is the manifest's histogram {"segments in a row": "number of rows"}.
    """
    total, left = 0, rows
    for segments, count in sorted(((int(k), v) for k, v in segments_per_row.items()), reverse=True):
        take = min(left, count)
        total += segments * take
        left -= take
        if not left:
            break
    return total
