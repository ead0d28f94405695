"""The one opener of Arrow IPC files (shards, spill files, ``datasets`` caches), for both sides.

A local file is opened as a regular file (a FIFO or a device planted at its name is refused, not
waited on) and memory-mapped through that descriptor, so the map is of the file checked, whatever
is renamed onto its path later; reading its columns copies nothing. A file at a URL is read whole
through ``schemas.storage``, with its retries.

>>> import tempfile, pyarrow as pa
>>> with tempfile.TemporaryDirectory() as directory:
...     path = f"{directory}/numbers.arrow"
...     with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, pa.schema([("n", pa.int32())])) as writer:
...         writer.write_table(pa.table({"n": pa.array([1, 2, 3], pa.int32())}))
...     open_arrow_file(path).read_all().column("n").to_pylist()
[1, 2, 3]
"""

from __future__ import annotations

import mmap
import os
from typing import BinaryIO

import pyarrow as pa

from schemas import storage
from schemas.io import open_regular


def map_file(file: BinaryIO) -> pa.BufferReader:
    """The open local ``file``'s bytes, memory-mapped (ValueError for an empty file)."""
    return pa.BufferReader(pa.py_buffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)))


def arrow_source(path: str) -> pa.BufferReader:
    """The bytes of the Arrow file at ``path``: mapped when local, read whole at a URL.

    Raises OSError (a missing file, one that is no regular file, a store that failed) or StorageError
    (``schemas.storage``); the caller names what the file was. An empty file gives no bytes (which
    pyarrow then refuses as no Arrow file).
    """
    if storage.is_url(path):
        return pa.BufferReader(storage.read_bytes(path))
    with open_regular(path) as file:
        return map_file(file) if os.fstat(file.fileno()).st_size else pa.BufferReader(b"")


def open_arrow_file(path: str) -> pa.ipc.RecordBatchFileReader:
    """A reader of the Arrow IPC file at ``path`` (``arrow_source``); pyarrow's ArrowInvalid for one of another format."""
    return pa.ipc.open_file(arrow_source(path))
