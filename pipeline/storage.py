"""Files on the local disk or on any filesystem Apache Beam supports (``gs://``, ``s3://``, ...).

Local paths use the standard library; URLs go through Beam's ``FileSystems``, imported only
when a URL is met, so checking a local build for reuse never loads Beam. Hub files
(``hf://``), which Beam cannot read, are read through fsspec (``huggingface_hub.HfFileSystem``).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from pipeline.errors import ConfigError
from schemas import io as schemas_io
from schemas.io import UPLOAD_MARK, atomic_output, open_own, write_error

HUB_SCHEME = "hf://"



def local_path(path: str) -> str:
    """The local path a ``file:`` URL names (RFC 8089: no host or ``localhost``, an absolute path); any other path as it is.

    >>> [local_path(url) for url in ("file:///data/x", "file://localhost/data/x", "file:/data/a%20b", "data/x")]
    ['/data/x', '/data/x', '/data/a b', 'data/x']

    Raises ConfigError for a file URL that names another host or a relative path (``file://data/x``).
    """
    if path[:5].lower() != "file:":
        return path
    url = urllib.parse.urlsplit(path)
    if url.netloc not in ("", "localhost") or not url.path.startswith("/") or url.query or url.fragment:
        raise ConfigError(
            f"{path}: not a local file URL; write file:///ABS/PATH (or file://localhost/ABS/PATH), or the path itself"
        )
    return urllib.parse.unquote(url.path)


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote file (``scheme://...``) rather than a local one."""
    return "://" in path


def _filesystems():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with the separator of base's filesystem."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def basename(path: str) -> str:
    """The last component of ``path``."""
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path.rstrip(os.sep))


def exists(path: str) -> bool:
    """Whether a file or directory exists at ``path``."""
    return _filesystems().exists(path) if is_url(path) else os.path.exists(path)


def is_dir(path: str) -> bool:
    """Whether ``path`` is a directory (for URLs: a prefix holding at least one file)."""
    if is_url(path):
        return bool(list_files(path))
    return os.path.isdir(path)


def open_read(path: str) -> IO[bytes]:
    """A binary file object for reading ``path`` (seekable for local files and Beam's URLs); locally a regular file
    only, else an OSError naming it."""
    if path.startswith(HUB_SCHEME):
        import fsspec

        return fsspec.open(path, "rb").open()
    if is_url(path):
        from apache_beam.io.filesystem import CompressionTypes

        return _filesystems().open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    return schemas_io.open_regular(path)  # a FIFO planted at the name is refused, not waited on for ever


def size(path: str) -> int:
    """The size of a file in bytes."""
    if is_url(path):
        return _filesystems().match([path])[0].metadata_list[0].size_in_bytes
    return os.path.getsize(path)


def glob(pattern: str) -> list[str]:
    """Files matching a glob pattern, sorted."""
    if is_url(pattern):
        return sorted(m.path for m in _filesystems().match([pattern])[0].metadata_list)
    return sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))


def list_files(directory: str) -> list[str]:
    """The names (not paths) of the files directly inside ``directory``, sorted; [] if it does not exist."""
    if is_url(directory):
        prefix = directory.rstrip("/") + "/"
        matched = _filesystems().match([prefix + "*"])[0].metadata_list
        return sorted(m.path[len(prefix) :] for m in matched if "/" not in m.path[len(prefix) :])
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
        present = [p for p in paths if _filesystems().exists(p)]
        if present:
            _filesystems().delete(present)
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
    link in it or swap a file varpack made there for one; else LinkError naming it. A no-op at a URL."""
    if is_url(directory):
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
    """Move a finished local file to the URL ``dest``: upload it under a temporary name, then rename it."""
    from apache_beam.io.filesystem import CompressionTypes

    parent, name = dest.rsplit("/", 1)
    staging = f"{parent}/.{name}{UPLOAD_MARK}"
    with open(local_path, "rb") as src, _filesystems().create(staging, compression_type=CompressionTypes.UNCOMPRESSED) as dst:
        shutil.copyfileobj(src, dst, 8 << 20)
    _filesystems().rename([staging], [dest])
    os.unlink(local_path)
