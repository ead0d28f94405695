"""Open one shard file by memory map, verify it, and expose its columns without copying.

A shard is mapped through the descriptor it was checked on, and keeps it: ``Shard.unchanged()``
compares the file's identity on disk (device, inode, size, modification and change time) with
the one it had when it was opened, so a reader can ask before each read whether the file was
truncated or rewritten since (reading a truncated mapping kills the process with SIGBUS). A
shard reopened later is compared with the identity it had when it was verified: a file
replaced or rewritten since is hashed again, and refused unless it still matches the manifest.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from schemas import Manifest, ShardError, ShardInfo, list_parts, stream_sha256, validate_table
from schemas.arrow_file import arrow_source, map_file
from schemas.io import open_regular
from schemas.shard_identity import file_identity_problem, identity_problem
from schemas.verified import disk_identity

Identity = tuple[int, int, int, int, int]


def _column(table: pa.Table, name: str) -> pa.Array:
    """One column as a single array: the memory-mapped chunk itself when there is one chunk."""
    column = table.column(name)
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


@dataclass(frozen=True)
class Shard:
    """A memory-mapped shard: numpy views over the Arrow buffers of its columns.

    Row ``i``'s tokens are ``input_ids[token_offsets[i]:token_offsets[i + 1]]`` and its
    boundaries ``cu_seqlens[cu_offsets[i]:cu_offsets[i + 1]]``; slicing copies nothing.
    """

    path: str
    file: BinaryIO  # the open file mapped; its identity is compared before reads
    identity: Identity  # the file's identity on disk when it was checked (``schemas.verified.disk_identity``)
    table: pa.Table
    input_ids: np.ndarray  # int32 [tokens]
    loss_mask: np.ndarray  # uint8 [tokens]
    token_offsets: np.ndarray  # int32 [rows + 1]
    cu_seqlens: np.ndarray  # int32 [segments + rows]
    cu_offsets: np.ndarray  # int32 [rows + 1]
    max_seqlen: np.ndarray  # int32 [rows]
    example_ids: np.ndarray  # int64 [segments]
    example_offsets: np.ndarray  # int32 [segments]
    segment_offsets: np.ndarray  # int32 [rows + 1]
    roles: np.ndarray | None = None  # uint8 [segments], a preference build's (schemas.PREFERENCE_ROW_SCHEMA)

    def unchanged(self) -> bool:
        """Whether the mapped file is still as it was checked: not truncated, rewritten or touched since."""
        return disk_identity(os.fstat(self.file.fileno())) == self.identity

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1])

    def row(self, i: int) -> dict[str, np.ndarray | int]:
        """Row ``i`` as numpy views (``max_seqlen`` as an int)."""
        if not 0 <= i < self.num_rows:
            raise IndexError(f"{self.path}: row {i} out of range (0..{self.num_rows - 1})")
        t0, t1 = self.token_offsets[i], self.token_offsets[i + 1]
        c0, c1 = self.cu_offsets[i], self.cu_offsets[i + 1]
        s0, s1 = self.segment_offsets[i], self.segment_offsets[i + 1]
        return {
            "input_ids": self.input_ids[t0:t1],
            "loss_mask": self.loss_mask[t0:t1],
            "cu_seqlens": self.cu_seqlens[c0:c1],
            "max_seqlen": int(self.max_seqlen[i]),
            "example_ids": self.example_ids[s0:s1],
            "example_offsets": self.example_offsets[s0:s1],
        }


# How: pack checks every shard of a build it finds, and rebuilds one that fails.
REBUILD = " (run the pack command that made it again)"


def check_shard_file(path: Path, expected: ShardInfo | None, verify_checksum: bool) -> None:
    """Check that the shard file exists, has the size in ``expected``, and its sha256 when
    ``verify_checksum``; raise ShardError naming the file. Opens nothing but the file itself."""
    with _open_file(path) as file:
        _check_file(file, str(path), expected, verify_checksum)


def check_open_shard(file: BinaryIO, path: Path, expected: ShardInfo) -> None:
    """``check_shard_file`` (size and sha256) of the file open as ``file``, read through it, not reopened by name."""
    _check_file(file, str(path), expected, verify_checksum=True)


def _open_file(path: Path) -> BinaryIO:
    """The shard file at ``path``, open for reading; a FIFO there is refused, not waited on for ever."""
    try:
        return open_regular(path)
    except FileNotFoundError as err:
        raise ShardError(str(path), "shard file is missing; rebuild the shards or fix the path") from err
    except OSError as err:
        raise ShardError(str(path), f"cannot be read as a shard ({err.strerror}); rebuild the shards or fix the path") from err


def _check_file(file: BinaryIO, name: str, expected: ShardInfo | None, verify_checksum: bool, why: str = "") -> None:
    """``check_shard_file`` on an open file; ``why`` says why it is hashed, for the message."""
    if expected is None:
        return
    size = os.fstat(file.fileno()).st_size
    if size != expected.bytes:
        raise ShardError(
            name, f"is {size} bytes, the manifest says {expected.bytes}: truncated or replaced{why}; rebuild it{REBUILD}"
        )
    if verify_checksum:
        file.seek(0)
        if stream_sha256(file) != expected.sha256:
            raise ShardError(name, f"checksum mismatch{why}: the file is corrupt; rebuild it{REBUILD}")


def open_shard(
    path: str | os.PathLike[str],
    capacity: int,
    expected: ShardInfo | None = None,
    verify_checksum: bool = False,
    num_example_ids: int | None = None,
    schema_problem: Callable[[pa.Schema], str | None] | None = None,
    verified: Identity | None = None,
) -> Shard:
    """Memory-map a shard and check it: size and row count against ``expected``, the sha256
    when ``verify_checksum`` (which needs ``expected``), ``schema_problem`` of its schema before
    its rows, and every row invariant, example ids below the manifest's ``num_example_ids`` when
    given. A file whose identity on disk is no longer ``verified`` (the one it had when it was
    last checked) is hashed again. Raises ShardError naming the file."""
    if verify_checksum and expected is None:
        raise ValueError("verify_checksum needs the shard's manifest entry as expected")
    if verified is not None and expected is None:
        raise ValueError("verified needs the shard's manifest entry as expected, to check a changed file against")
    path = Path(path)
    name = str(path)
    file = _open_file(path)
    try:
        return _map_shard(file, name, capacity, expected, verify_checksum, num_example_ids, schema_problem, verified)
    except BaseException:
        file.close()
        raise


def _map_shard(
    file: BinaryIO,
    name: str,
    capacity: int,
    expected: ShardInfo | None,
    verify_checksum: bool,
    num_example_ids: int | None,
    schema_problem: Callable[[pa.Schema], str | None] | None,
    verified: Identity | None,
) -> Shard:
    """``open_shard`` on the open ``file``."""
    identity = disk_identity(os.fstat(file.fileno()))
    changed = verified is not None and identity != verified
    _check_file(file, name, expected, verify_checksum or changed, " (it was changed on disk since it was verified)" if changed else "")
    try:
        # Mapped through the descriptor just checked, so the map is of that file, whatever is renamed onto its path.
        reader = pa.ipc.open_file(map_file(file))
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ShardError(name, f"is not a readable Arrow IPC file ({err}); rebuild it") from err
    if disk_identity(os.fstat(file.fileno())) != identity:
        raise ShardError(name, f"was changed on disk while it was opened; rebuild it{REBUILD}, or stop what writes it")
    if schema_problem is not None:
        _raise_problem(name, schema_problem(reader.schema))
    try:
        table = reader.read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ShardError(name, f"is not a readable Arrow IPC file ({err}); rebuild it") from err
    if expected is not None and table.num_rows != expected.rows:
        raise ShardError(name, f"holds {table.num_rows} rows, the manifest says {expected.rows}")
    validate_table(table, capacity, name, num_example_ids)

    token_offsets, input_ids = list_parts(table.column("input_ids"))
    _, loss_mask = list_parts(table.column("loss_mask"))
    cu_offsets, cu_seqlens = list_parts(table.column("cu_seqlens"))
    segment_offsets, example_ids = list_parts(table.column("example_ids"))
    _, example_offsets = list_parts(table.column("example_offsets"))
    max_seqlen = _column(table, "max_seqlen").to_numpy(zero_copy_only=True)
    roles = list_parts(table.column("roles"))[1] if "roles" in table.schema.names else None
    shard = Shard(
        path=name,
        file=file,
        identity=identity,
        table=table,
        input_ids=input_ids,
        loss_mask=loss_mask,
        token_offsets=token_offsets,
        cu_seqlens=cu_seqlens,
        cu_offsets=cu_offsets,
        max_seqlen=max_seqlen,
        example_ids=example_ids,
        example_offsets=example_offsets,
        segment_offsets=segment_offsets,
        roles=roles,
    )
    weakref.finalize(shard, file.close)  # the map needs no descriptor; the check does, while the shard lives
    return shard


def _raise_problem(path: str | os.PathLike[str], problem: str | None) -> None:
    if problem is not None:
        raise ShardError(str(path), problem)


def open_build_shard(
    path: str | os.PathLike[str], manifest: Manifest, index: int, verified: Identity | None = None
) -> Shard:
    """``open_shard`` for shard ``index`` of ``manifest``'s list, its example ids bounded by the build's,
    checking first that the file names itself that shard of that build (``schemas/shard_identity.py``)."""
    return open_shard(path, manifest.capacity, expected=manifest.shards[index], num_example_ids=manifest.num_example_ids,
                      schema_problem=lambda schema: identity_problem(schema, manifest, index), verified=verified)


def check_build_shard(path: Path, manifest: Manifest, index: int, verify_checksum: bool) -> None:
    """``check_shard_file`` for shard ``index`` of ``manifest``'s list, and its identity, read from the
    file's footer alone."""
    check_shard_file(path, manifest.shards[index], verify_checksum)
    _raise_problem(path, file_identity_problem(arrow_source(str(path)), manifest, index))
