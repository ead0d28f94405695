"""Tokenized batches wait in spill files while the dataset is packed; only their lengths travel.

A worker writes each tokenized batch's ``tokens`` and ``loss_mask`` to one uncompressed Arrow
IPC file under the build's spill directory and passes on a ``SpilledBatch``: the file's path
and the examples' lengths. The packer needs only the lengths; the shard writers gather each
segment's tokens from the spill files through a memory map. So a build's memory grows with
its number of examples (their lengths and places), not with its tokens.

The spill directory is ``OUT/DATASET-FINGERPRINT/.spill-RUN/`` for a local build, or
``TEMP_LOCATION/varpack-spill-RUN/`` (``--temp_location``) on a cluster, where every worker
can read what the others wrote. It is removed when the build succeeds or fails, and a later
build of the same directory removes what a killed run left.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.encode.examples import EncodedBatch
from pipeline.encode.token_check import CheckCounts
from pipeline.packing.pairs import segments_per_pair
from schemas.arrow_file import open_arrow_file

SPILL_PREFIX = ".spill-"
CLUSTER_SPILL_PREFIX = "varpack-spill-"


@dataclass(frozen=True)
class SpilledBatch:
    """A tokenized batch whose tokens are in the spill file at ``path``; example ``i`` has ``lengths[i]``
    tokens and comes from row ``rows[i]`` of the ``rows_read`` rows of the batch.

    ``rejected``, ``untrained``, ``turns`` and ``prompt_cut`` are the batch's bad rows and counts (see EncodedBatch);
    ``token_check`` what checking its tokens against the reference found; ``segments``, for preference pairs, the
    segments each pair becomes in a row (None for other examples).
    """

    path: str
    lengths: np.ndarray  # int32 [examples]: the runner holds these for every example, so 4 bytes each
    rows: np.ndarray  # int32 [examples], ascending
    rows_read: int
    rejected: list = field(default_factory=list)
    untrained: tuple[int, int] = (0, 0)
    turns: Counter[str] = field(default_factory=Counter)
    prompt_cut: tuple[int, int] = (0, 0)
    token_check: CheckCounts = CheckCounts()
    special_text: dict[str, tuple[int, str]] = field(default_factory=dict)
    segments: np.ndarray | None = None  # int8 [examples]


def new_spill_dir(out_dir: str, temp_location: str | None) -> str:
    """A fresh spill directory for one run: inside the build directory, or under ``temp_location``."""
    run = uuid.uuid4().hex[:12]
    if temp_location:
        return storage.join(temp_location, f"{CLUSTER_SPILL_PREFIX}{run}")
    return storage.join(out_dir, f"{SPILL_PREFIX}{run}")


def spill(
    batch: EncodedBatch, spill_dir: str, name: str, rows_read: int, token_check: CheckCounts = CheckCounts()
) -> SpilledBatch:
    """Write ``batch``'s tokens and loss mask to ``spill_dir/name.arrow``; ``batch`` came from ``rows_read`` source rows."""
    columns = {"tokens": batch.tokens, "loss_mask": batch.loss_mask}
    if batch.roles is not None:
        columns["roles"] = batch.roles
    table = pa.table(columns)
    path = storage.join(spill_dir, f"{name}.arrow")
    storage.write_scratch(path, lambda local: _write(table, local))
    release_freed_memory()
    rows = batch.example_rows.astype(np.int32)
    return SpilledBatch(
        path, batch.lengths.astype(np.int32), rows, rows_read, batch.rejected, batch.untrained, batch.turns,
        batch.prompt_cut, token_check, batch.special_text,
        None if batch.roles is None else segments_per_pair(batch.lengths, batch.roles),
    )


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


def _write(table: pa.Table, path: str) -> None:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


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

