"""Number the examples of all batches in source order and split them into packing groups.

Tokenized batches arrive from the workers in any order, keyed by (read task, batch within
the task). Sorting the keys gives the source order, so an example's id is the number of its
source row in the dataset whatever the runner, and stays so when rows before it were left out
(``--on-bad-row skip``, ``--overflow truncate``): ids lie in ``[0, rows read)``, which the
manifest records as ``stats.num_example_ids``. Rows past ``--num-examples`` are left out here.

Packing is best-fit decreasing over all the lengths of a group, on one worker (about 100 bytes
per example while packing: 82 in ``pack`` itself over 1M or 3M FLAN lengths). A dataset of more
than EXAMPLES_PER_GROUP (N) examples is cut into K = ceil(rows / N) groups, packed independently
(in parallel on a cluster): group k holds the examples of source rows [k * N, (k + 1) * N), so
where a group ends depends on the data and N alone, never on ``--batch-size``, the read tasks or
the runner; a batch across a boundary gives its rows on either side to their groups. Each group
ends with its own partly filled rows, so grouping costs a little fill, about 0.6 extra rows per
group; ``scripts/bench_pack_groups.py`` measures it. On 5M FLAN-shaped lengths at L = 4096 (one
group: 99.9927% fill) groups of 1M examples lose 0.0008% of fill, of 100k 0.009%, of 10k 0.08%:
negligible at 50M per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipeline.config import EXAMPLES_PER_GROUP
from pipeline.errors import InputError, NothingKeptError
from schemas import RejectedRows

BatchKey = tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """For each batch, in source order: the number of its first source row and how many of its rows are kept."""

    keys: tuple[BatchKey, ...]
    first_rows: np.ndarray  # int64 [batches]
    kept_rows: np.ndarray  # int64 [batches]

    @property
    def num_example_ids(self) -> int:
        """The source rows kept: every example id is below it."""
        return int(self.kept_rows.sum())

    def index(self) -> dict[BatchKey, tuple[int, int]]:
        """``key -> (first row, rows kept)``."""
        return {key: (int(f), int(k)) for key, f, k in zip(self.keys, self.first_rows.tolist(), self.kept_rows.tolist())}


def make_layout(
    counts: Iterable[tuple[BatchKey, tuple[int, int]]],
    limit: int | None,
    rejected: RejectedRows = RejectedRows(),
    listed_in: str = "rejected.jsonl",
) -> Layout:
    """The layout of batches with ``counts`` (examples, source rows read) each, keeping the first ``limit`` rows.

    When the rows kept make no example, raises NothingKeptError naming the rows read and why they were left
    out (``rejected``, the bad rows, which ``listed_in`` lists), or InputError for a dataset of no rows.

    >>> layout = make_layout([((0, 1), (2, 3)), ((0, 0), (4, 4))], limit=6)
    >>> layout.first_rows.tolist(), layout.kept_rows.tolist(), layout.num_example_ids
    ([0, 4], [4, 2], 6)
    """
    ordered = sorted((tuple(key), (int(examples), int(rows))) for key, (examples, rows) in counts)
    keys = tuple(key for key, _ in ordered)
    examples = np.array([e for _, (e, _) in ordered], dtype=np.int64)
    rows = np.array([r for _, (_, r) in ordered], dtype=np.int64)
    first_rows = np.cumsum(rows) - rows
    kept = rows_kept(rows, limit)
    total = int(kept.sum())
    if total == 0:
        raise InputError("the dataset holds no examples")
    if not examples[kept > 0].any():
        raise NothingKeptError(nothing_kept(total, rejected, listed_in))
    return Layout(keys, first_rows, kept)


def rows_kept(rows: np.ndarray, limit: int | None) -> np.ndarray:
    """How many of each batch's ``rows`` read (batches in source order) are among the first ``limit`` rows.

    >>> rows_kept(np.array([4, 4, 4]), limit=6).tolist()
    [4, 2, 0]
    """
    return rows if limit is None else np.clip(limit - (np.cumsum(rows) - rows), 0, rows)


def group_parts(first_row: int, kept_rows: int, examples_per_group: int = EXAMPLES_PER_GROUP) -> list[tuple[int, int, int]]:
    """The packing groups a batch's kept rows fall in: ``(group, start, end)`` for each, its rows ``[start, end)``.

    Group k holds source rows [k * examples_per_group, (k + 1) * examples_per_group), wherever batches start:
    a batch of rows 60 to 159, 70 to a group, gives 10 rows to group 0, 70 to group 1 and 20 to group 2.

    >>> group_parts(first_row=60, kept_rows=100, examples_per_group=70)
    [(0, 0, 10), (1, 10, 80), (2, 80, 100)]
    >>> group_parts(first_row=60, kept_rows=0, examples_per_group=70)
    []
    """
    if kept_rows == 0:
        return []
    groups = np.arange(first_row // examples_per_group, (first_row + kept_rows - 1) // examples_per_group + 1)
    bounds = np.clip(np.append(groups, groups[-1] + 1) * examples_per_group - first_row, 0, kept_rows).tolist()
    return list(zip(groups.tolist(), bounds[:-1], bounds[1:]))


def nothing_kept(rows: int, rejected: RejectedRows, listed_in: str) -> str:
    """Why the ``rows`` rows read made no example: the bad rows among them by reason, and where they are listed.

    >>> nothing_kept(12, RejectedRows(12, {"prompt_not_a_prefix": 12}), "out/rejected.jsonl")
    'nothing to write: all 12 rows read are bad rows (prompt_not_a_prefix: 12), listed with their reasons in out/rejected.jsonl'
    """
    if not rejected.rows:
        return f"nothing to write: the {rows:,} rows read made no examples"
    reasons = ", ".join(f"{reason}: {count:,}" for reason, count in rejected.by_reason.items())
    every = "the 1 row read is a bad row" if rows == 1 else f"all {rows:,} rows read are bad rows"
    bad = every if rejected.rows == rows else f"{rejected.rows:,} of the {rows:,} rows read are bad rows"
    rest = "" if rejected.rows == rows else " and the others made no examples"
    return f"nothing to write: {bad} ({reasons}){rest}, listed with their reasons in {listed_in}"
