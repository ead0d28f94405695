"""Files on the local disk or at any URL fsspec knows (``s3://``, ``gs://``, ``hf://``, ...).

Local paths use the standard library, with the checks a shared directory needs (no link
followed, no FIFO waited on); URLs go through ``schemas.storage``, the one remote layer both
sides share, with its retries and one-line errors.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from pipeline.errors import ConfigError
from schemas import io as schemas_io
from schemas import storage as remote
from schemas.io import UPLOAD_MARK, atomic_output, open_own, write_error


def local_path(path: str) -> str:
    """``schemas.storage.local_path``: the local path a ``file:`` URL names; ConfigError for one of another host or
    a relative path."""
    try:
        return remote.local_path(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None


is_url = remote.is_url
check_bucket = remote.check_bucket


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with the separator of base's filesystem."""
    if is_url(base):
        return remote.join(base, *parts)
    return os.path.join(base, *parts)


def basename(path: str) -> str:
    """The last component of ``path``."""
    return remote.basename(path) if is_url(path) else os.path.basename(path.rstrip(os.sep))


def exists(path: str) -> bool:
    """Whether a file or directory exists at ``path``."""
    return remote.exists(path) if is_url(path) else os.path.exists(path)


def is_dir(path: str) -> bool:
    """Whether ``path`` is a directory (for URLs: a prefix holding at least one file)."""
    if is_url(path):
        return bool(list_files(path))
    return os.path.isdir(path)


def open_read(path: str) -> IO[bytes]:
    """A seekable binary file object for reading ``path``; locally a regular file only, else an OSError naming it."""
    if is_url(path):
        return remote.open_read(path)
    return schemas_io.open_regular(path)  # a FIFO planted at the name is refused, not waited on for ever


def size(path: str) -> int:
    """The size of a file in bytes."""
    if is_url(path):
        return remote.size(path)
    return os.path.getsize(path)


def glob(pattern: str) -> list[str]:
    """Files matching a glob pattern, sorted."""
    return remote.glob(pattern)


def list_files(directory: str) -> list[str]:
    """The names (not paths) of the files directly inside ``directory``, sorted; [] if it does not exist."""
    if is_url(directory):
        return remote.list_files(directory)
    if not os.path.isdir(directory):
        return []
    return sorted(entry.name for entry in os.scandir(directory) if not entry.is_dir())


def list_subdirs(directory: str) -> list[str]:
    """The names of the directories directly inside a local ``directory``; [] for URLs or when missing."""
    if is_url(directory) or not os.path.isdir(directory):
        return []
    return sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())


def make_dirs(directory: str) -> None:
    """Create ``directory`` and its parents (no-op on object stores, which have no directories)."""
    if not is_url(directory):
        os.makedirs(directory, exist_ok=True)


def remove_empty_dir(directory: str) -> None:
    """Delete a local directory if it exists and is empty (object stores have no directories)."""
    if not is_url(directory) and os.path.isdir(directory) and not os.listdir(directory):
        os.rmdir(directory)


def remove(paths: list[str]) -> None:
    """Delete files; missing ones are ignored."""
    if not paths:
        return
    if is_url(paths[0]):
        remote.remove(paths)
        return
    for path in paths:
        Path(path).unlink(missing_ok=True)


def read_bytes(path: str) -> bytes:
    """The bytes of a file."""
    with open_read(path) as f:
        return f.read()


@contextlib.contextmanager
def output(dest: str) -> Iterator[Path]:
    """A local path to write ``dest``'s content to, published at ``dest`` atomically when the block ends.

    Locally ``schemas.io.atomic_output``; at a URL a local temporary file, then ``publish``.
    """
    if not is_url(dest):
        with atomic_output(dest) as tmp:
            yield tmp
        return
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir) / basename(dest)
        yield tmp
        publish(str(tmp), dest)


@contextlib.contextmanager
def output_first(dest: str) -> Iterator[Path]:
    """``output`` of a file that the first writer alone publishes: at a URL it is uploaded only where none is
    yet, in one conditional request, so of several runs finishing at once exactly one writes it and the others
    leave it as it is. Locally ``output`` (the build's lock keeps runs apart there)."""
    if not is_url(dest):
        with output(dest) as tmp:
            yield tmp
        return
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir) / basename(dest)
        yield tmp
        with contextlib.suppress(FileExistsError):  # another run's came first
            if not remote.exists(dest):  # for the stores that ignore the condition, the window is kept short
                remote.upload(str(tmp), dest, exclusive=True)


def write_scratch(path: str, write: Callable[[str], None]) -> None:
    """Write a scratch file (spilled tokens, a shard's plan) that one run alone reads: ``write(local_path)``
    writes the content. Locally in place, with no rename or fsync: a crash loses the run anyway.
    At a URL written locally, then uploaded. An OSError becomes a WriteError naming ``path``.

    Locally the file's directory is this user's alone (made with mode 0700; one of another user,
    or a link, is refused with LinkError), so nobody else can plant a link at the file's
    predictable name, and the file itself is made without following one."""
    if is_url(path):
        with output(path) as tmp:
            write(str(tmp))
        return
    try:
        _make_private_dir(os.path.dirname(path))
        os.close(open_own(path, os.O_WRONLY | os.O_CREAT))
        write(path)
    except OSError as err:
        raise write_error(path, err) from err


def _make_private_dir(directory: str) -> None:
    """Make ``directory`` (mode 0700), or check that the one there is a directory of this user's that no one else can write."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    schemas_io.check_own_dir(directory, private=True)


def make_own_dir(directory: str) -> None:
    """Make a local ``directory`` varpack writes and deletes files in (a build directory in a shared ``--out``), or check
    the one there: a real directory of this user's that no other user can write into, so that nobody else can plant a
    link in it or swap a file varpack made there for one; else LinkError naming it. At a URL, a StorageError naming
    the fix when its bucket is missing or refuses the credentials."""
    if is_url(directory):
        remote.check_writable(directory)
        return
    try:
        schemas_io.make_own_dir(directory)
    except OSError as err:
        raise write_error(directory, err) from err


def check_own_dir(directory: str, private: bool = False) -> None:
    """``schemas.io.check_own_dir`` of a local ``directory`` (a no-op at a URL), just before deleting in it."""
    if not is_url(directory):
        schemas_io.check_own_dir(directory, private)


def publish(local_path: str, dest: str) -> None:
    """Move a finished local file to the URL ``dest``: upload it under a temporary name, then rename it, so that
    ``dest`` never holds part of it where a store's upload is not whole or nothing."""
    staging = remote.join(remote.parent(dest), f".{remote.basename(dest)}{UPLOAD_MARK}")
    remote.upload(local_path, staging)
    remote.rename(staging, dest)
    os.unlink(local_path)
