"""Tokenized batches wait in spill files while the dataset is packed; only their counts travel.

A worker writes each tokenized batch's ``tokens`` and ``loss_mask`` to one uncompressed Arrow
IPC file under the build's spill directory, its examples' lengths and source rows to a small
file beside it (``SpilledExamples``) and its rows left out as their lines of ``rejected.jsonl``
(``SpilledRejects``), and passes on a ``SpilledBatch``: the file's path and the batch's counts, a
few hundred bytes whatever its size. The packer reads the lengths of its
group's batches; the shard writers gather each segment's tokens from the spill files through a
memory map. So what the runner holds and moves through its shuffles grows with the number of
batches, not of examples or tokens.

The spill directory is ``OUT/DATASET-FINGERPRINT/.spill-RUN/`` for a local build, or
``TEMP_LOCATION/varpack-spill-RUN/`` (``--temp_location``) on a cluster, where every worker
can read what the others wrote. It is removed when the build succeeds or fails, and a later
build of the same directory removes what a killed run left.
"""

from __future__ import annotations

import dataclasses

import ctypes
import ctypes.util
import shutil
from pathlib import Path
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.encode.bad_rows import DROPPED_WHOLE, BadRow
from pipeline.encode.examples import EncodedBatch
from pipeline.encode.token_check import CheckCounts
from pipeline.packing.pairs import segments_per_pair
from schemas.arrow_file import open_arrow_file

SPILL_PREFIX = ".spill-"
CLUSTER_SPILL_PREFIX = "varpack-spill-"


@dataclass(frozen=True)
class SpilledRejects:
    """A batch's rows left out: how many for each reason, how many of them are bad rows (``--max-bad-rows``) and the
    first of those (named in errors); their lines of ``rejected.jsonl`` are in the file at ``path`` (None: none)."""

    by_reason: Counter[str]
    bad: int = 0
    first_bad: BadRow | None = None
    path: str | None = None

    def within(self, kept_rows: int) -> SpilledRejects:
        """Those of the batch's first ``kept_rows`` rows, the rows of the build (rows past ``--num-examples`` are not),
        their lines in a file of their own."""
        if self.path is None:
            return self
        where = open_arrow_file(_rejected_rows_path(self.path)).read_all()
        rows = where.column("row").to_numpy()
        listed = int(np.searchsorted(rows, kept_rows))
        if listed == rows.size:
            return self
        if listed == 0:
            return SpilledRejects(Counter())
        by_reason = Counter(where.column("reason").slice(0, listed).to_pylist())
        bad = sum(n for reason, n in by_reason.items() if reason not in DROPPED_WHOLE)
        lines = storage.read_bytes(self.path).split(b"\n")[:listed]
        path = self.path.removesuffix(".jsonl") + f".first-{kept_rows}.jsonl"
        storage.write_scratch(path, lambda local: Path(local).write_bytes(b"".join(line + b"\n" for line in lines)))
        return SpilledRejects(by_reason, bad, self.first_bad if bad else None, path)


@dataclass(frozen=True)
class SpilledBatch:
    """A tokenized batch of ``examples`` examples from ``rows_read`` source rows, whose tokens are in the spill
    file at ``path`` and whose lengths and rows are in the file beside it (``read_examples``).

    ``rejected`` counts the batch's rows left out, ``untrained``, ``turns`` and ``prompt_cut`` its other counts (see
    EncodedBatch); ``token_check`` what checking its tokens against the reference found. Nothing here grows with
    the batch's examples or rows: the runner holds one of these per batch.
    """

    path: str
    examples: int
    rows_read: int
    rejected: SpilledRejects = field(default_factory=lambda: SpilledRejects(Counter()))
    untrained: tuple[int, int] = (0, 0)
    turns: Counter[str] = field(default_factory=Counter)
    prompt_cut: tuple[int, int] = (0, 0)
    token_check: CheckCounts = CheckCounts()
    special_text: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class SpilledExamples:
    """The examples of a spilled batch: example ``i`` has ``lengths[i]`` tokens, comes from row ``rows[i]`` of the
    batch and, for preference pairs, becomes ``segments[i]`` segments in a row (None for other examples). Their
    tokens follow each other in the spill file from token ``token_start``."""

    lengths: np.ndarray  # int32 [examples]
    rows: np.ndarray  # int32 [examples], ascending
    segments: np.ndarray | None = None  # int8 [examples]
    token_start: int = 0

    def between(self, start: int, end: int) -> SpilledExamples:
        """The examples from rows ``[start, end)`` of the batch.

        >>> examples = SpilledExamples(np.array([3, 5, 2], dtype=np.int32), np.array([0, 2, 3], dtype=np.int32))
        >>> part = examples.between(1, 4)
        >>> part.lengths.tolist(), part.rows.tolist(), part.token_start
        ([5, 2], [2, 3], 3)
        """
        first, stop = np.searchsorted(self.rows, [start, end]).tolist()
        segments = None if self.segments is None else self.segments[first:stop]
        skipped = int(self.lengths[:first].sum(dtype=np.int64))
        return SpilledExamples(self.lengths[first:stop], self.rows[first:stop], segments, self.token_start + skipped)


def new_spill_dir(out_dir: str, temp_location: str | None) -> str:
    """A fresh spill directory for one run: inside the build directory, or under ``temp_location``."""
    run = uuid.uuid4().hex[:12]
    if temp_location:
        return storage.join(temp_location, f"{CLUSTER_SPILL_PREFIX}{run}")
    return storage.join(out_dir, f"{SPILL_PREFIX}{run}")


def spill(
    batch: EncodedBatch, spill_dir: str, name: str, rows_read: int, token_check: CheckCounts = CheckCounts()
) -> SpilledBatch:
    """Write ``batch``'s tokens and loss mask to ``spill_dir/name.arrow`` and its examples' lengths and rows beside
    them; ``batch`` came from ``rows_read`` source rows."""
    columns = {"tokens": batch.tokens, "loss_mask": batch.loss_mask}
    if batch.roles is not None:
        columns["roles"] = batch.roles
    path = storage.join(spill_dir, f"{name}.arrow")
    _write_table(pa.table(columns), path)
    examples = {"lengths": batch.lengths.astype(np.int32), "rows": batch.example_rows.astype(np.int32)}
    if batch.roles is not None:
        examples["segments"] = segments_per_pair(batch.lengths, batch.roles)
    _write_table(pa.table(examples), examples_path(path))
    release_freed_memory()
    return SpilledBatch(
        path, int(batch.lengths.size), rows_read, spill_rejected(batch.rejected, path), batch.untrained, batch.turns,
        batch.prompt_cut, token_check, batch.special_text,
    )


def spill_rejected(rejected: list[BadRow], path: str) -> SpilledRejects:
    """Write the lines of ``rejected.jsonl`` for a batch's rows left out beside its spill file ``path``, in row order,
    and their rows and reasons beside them (``SpilledRejects.within``); their counts."""
    rejected = sorted(rejected, key=lambda row: row.batch_row)
    bad = [row for row in rejected if row.is_bad]
    rejected_path = None
    if rejected:
        rejected_path = path.removesuffix(".arrow") + ".rejected.jsonl"
        lines = "".join(row.to_json() + "\n" for row in rejected).encode("utf-8")
        storage.write_scratch(rejected_path, lambda local: Path(local).write_bytes(lines))
        rows = pa.table({"row": pa.array([row.batch_row for row in rejected], pa.int32()),
                         "reason": pa.array([str(row.reason) for row in rejected], pa.string())})
        _write_table(rows, _rejected_rows_path(rejected_path))
    # The first bad row travels for the --max-bad-rows error, which names where it is and why: not its values.
    first = dataclasses.replace(bad[0], row={}) if bad else None
    return SpilledRejects(Counter(str(row.reason) for row in rejected), len(bad), first, rejected_path)


def _rejected_rows_path(rejected_path: str) -> str:
    """Where the rows and reasons of the lines in ``rejected_path`` are."""
    return rejected_path.removesuffix(".jsonl") + ".rows.arrow"


def examples_path(path: str) -> str:
    """Where the lengths and rows of the examples whose tokens are in spill file ``path`` are."""
    return path.removesuffix(".arrow") + ".examples.arrow"


def read_examples(path: str) -> SpilledExamples:
    """The lengths and rows (and for pairs the segments) of the examples whose tokens are in spill file ``path``."""
    table = open_arrow_file(examples_path(path)).read_all()
    segments = table.column("segments").to_numpy() if "segments" in table.column_names else None
    return SpilledExamples(table.column("lengths").to_numpy(), table.column("rows").to_numpy(), segments)


def _libc_malloc_trim():
    """glibc's ``malloc_trim``, or None on other C libraries."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Hand the heap pages that freed objects left empty back to the operating system.

    Tokenizing a batch allocates about 100 bytes per token on the tokenizer's threads and frees
    them; glibc keeps those pages in its per-thread arenas, so without this the resident size
    creeps up batch after batch, with the length of the run rather than with any setting.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _write_table(table: pa.Table, path: str) -> None:
    """Write ``table`` to ``path`` (a local path or a URL) as one uncompressed Arrow IPC file."""

    def write(local: str) -> None:
        with pa.OSFile(local, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    storage.write_scratch(path, write)


def read_spilled(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(tokens, loss_mask, roles)`` of a spill file (roles: None but for preference pairs): memory-mapped, zero
    copy, when it is local."""
    table = open_arrow_file(path).read_all()
    roles = table.column("roles").chunk(0).to_numpy() if "roles" in table.column_names else None
    return table.column("tokens").chunk(0).to_numpy(), table.column("loss_mask").chunk(0).to_numpy(), roles


def remove_spill(spill_dir: str) -> None:
    """Delete a spill directory and everything in it; a missing one is fine."""
    if storage.is_url(spill_dir):
        storage.remove([storage.join(spill_dir, name) for name in storage.list_files(spill_dir)])
    else:
        shutil.rmtree(spill_dir, ignore_errors=True)

