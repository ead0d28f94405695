"""Every file varpack writes goes through here: atomic writes, the manifest, the cache directory.

A file is written under a temporary name beside its target (``.NAME.tmp-PID-RANDOM``),
fsynced, renamed onto the target, and then the directory is fsynced, so after a crash or a
power cut a reader finds either the old file or the whole new one, and a manifest never names
a shard whose rename was not yet durable. Both sides import this module: the write side for
shards, rejected rows and the manifest, the read side for the manifest and its cache of remote
shards. It imports only the standard library (and, for a manifest at a URL, ``schemas.storage``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from schemas import storage
from schemas.errors import LinkError, ManifestError, WriteError
from schemas.manifest import MANIFEST_NAME, Manifest, validate_manifest

CACHE_ENV = "VARPACK_CACHE_DIR"
TEMPORARY_MARK = ".tmp-"
# At a URL a file is uploaded as ``.NAME.uploading``, then renamed.
UPLOAD_MARK = ".uploading"
_TEMPORARY_NAME = re.compile(rf"\.(.+?)(?:{re.escape(TEMPORARY_MARK)}[\w-]+|{re.escape(UPLOAD_MARK)})")


def cache_dir() -> Path:
    """``$VARPACK_CACHE_DIR``, else ``~/.cache/varpack``: converted tokenizers, copies of remote shards, verification records.

    When ``$VARPACK_CACHE_DIR`` is unset and ``~/.cache/varpack`` cannot be made or written (a
    read-only home directory), a directory of this user's under the system's temporary directory
    is used instead, with one line on stderr saying so.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    default = Path.home() / ".cache" / "varpack"
    try:
        default.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        problem = err.strerror or str(err)
    else:
        if os.access(default, os.W_OK):
            return default
        problem = "not writable"
    return _fallback_cache_dir(default, problem)


def _fallback_cache_dir(default: Path, problem: str) -> Path:
    """This user's own cache directory under the temporary directory, announced once per process."""
    fallback = Path(tempfile.gettempdir()) / f"varpack-cache-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        fallback.mkdir(mode=0o700)
    info = fallback.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        fallback = Path(tempfile.mkdtemp(prefix="varpack-cache-"))  # another user's, or not private: a fresh one
    if fallback not in _announced_fallbacks:
        _announced_fallbacks.add(fallback)
        print(f"varpack: note: cache directory {default} cannot be used ({problem}); caching in {fallback} instead "
              f"(set {CACHE_ENV} to keep a cache elsewhere)", file=sys.stderr)
    return fallback


_announced_fallbacks: set[Path] = set()


def temporary_name(path: str | os.PathLike[str]) -> Path:
    """A fresh temporary name beside ``path``, unique across processes and hosts."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temporary_target(name: str) -> str | None:
    """The name of the file a temporary file named ``name`` was to become, or None if ``name`` is no temporary.

    >>> temporary_target(temporary_name("shard-00001.arrow").name), temporary_target(".manifest.json.uploading")
    ('shard-00001.arrow', 'manifest.json')
    >>> temporary_target("shard-00001.arrow") is None
    True
    """
    match = _TEMPORARY_NAME.fullmatch(name)
    return match.group(1) if match else None


def open_own(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open`` for a file varpack keeps in a shared place (a lock, a record, a temporary file): a descriptor
    of the regular file at ``path`` itself, never of what a symbolic or hard link planted there points to.

    Raises LinkError naming ``path`` when it is a symbolic link, a hard link to another name or no
    regular file; an OSError (a missing file, a read-only directory) passes through.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise link_error(path, "a symbolic link") from err
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise link_error(path, "a hard link" if stat.S_ISREG(info.st_mode) else "not a regular file")
    return fd


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` of a regular file; anything else (a FIFO, whose open would wait for a writer for ever,
    a device, a directory) is refused with an OSError naming ``path`` and what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise OSError(errno.EINVAL, f"it is {what}, not a regular file", os.fspath(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def make_own_dir(directory: str | os.PathLike[str]) -> Path:
    """Make ``directory`` (and its parents) if missing, and ``check_own_dir`` it."""
    directory = Path(directory)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    check_own_dir(directory)
    return directory


def make_own_subdirs(root: Path, relative: str) -> Path:
    """The directory of the file ``relative`` inside ``root`` (a directory of this user's), each component made
    one at a time and ``check_own_dir``-ed before the next is made in it, so no link planted on the way is followed."""
    directory = root
    for part in Path(relative).parent.parts:
        directory = directory / part
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o755)
        check_own_dir(directory)
    return directory


def check_own_dir(directory: str | os.PathLike[str], private: bool = False) -> None:
    """Raise LinkError naming ``directory`` unless it is a real directory (no link) of this user's that no other
    user can write into (with ``private``: nor its group): only then can nobody else plant a link in it, or
    replace a file varpack made there, between varpack's check and its write."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise link_error(directory, "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory")
    if info.st_uid != os.getuid() or info.st_mode & (0o022 if private else 0o002):
        whose = "another user's" if info.st_uid != os.getuid() else "one others can write into"
        raise LinkError(
            f"{directory}: is not a directory of this user's alone ({whose}), so files varpack writes there could be "
            "replaced by links; varpack writes only into its own: remove it (or choose another directory), then run again"
        )


def link_error(path: str | os.PathLike[str], what: str) -> LinkError:
    """The error that refuses ``path``, ``what`` varpack did not make, in one line naming it."""
    return LinkError(
        f"{path}: is {what}, which varpack did not make; it writes through no link it did not make (one planted "
        "there could make it overwrite another file): remove it, then run again"
    )


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(path: str | os.PathLike[str], err: OSError) -> WriteError:
    """The error that reports ``err`` (a full disk, a read-only or missing directory, a link, a link loop or a dangling
    link on the way, a file where a directory should be) met while writing ``path``."""
    links = [p for p in (Path(path), *Path(path).parents) if p.is_symlink()]
    loop = next((link for link in links if _is_link_loop(link)), None)
    if loop is not None and err.errno in (errno.ELOOP, errno.ENOENT, errno.EEXIST):
        return WriteError(f"{path}: could not be written: {loop} is a symbolic link loop; remove it or point "
                          "it at a directory, then run again")
    if err.errno == errno.ELOOP:
        return link_error(links[0] if links else Path(path), "a symbolic link")
    dangling = next((link for link in links if not link.exists()), None)
    if dangling is not None and err.errno in (errno.ENOENT, errno.EEXIST):
        # The end of its chain of links, each relative target read from its link's directory.
        target = os.path.realpath(dangling)
        return WriteError(f"{path}: could not be written: {dangling} is a dangling symbolic link, leading to {target}, "
                          f"which does not exist; make {target} or point the link elsewhere, then run again")
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        file = next((p for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            what = f"a symbolic link to the file {os.path.realpath(file)}" if file.is_symlink() else "a file"
            return WriteError(f"{path}: could not be written: {file} is {what}, not a directory; write elsewhere, "
                              "or move it away, then run again")
    directory = Path(path).parent
    if err.errno == errno.ENOENT and not directory.exists():
        return WriteError(f"{path}: could not be written: the directory {directory} does not exist; make it or write "
                          "elsewhere, then run again")
    return WriteError(
        f"{path}: could not be written ({err.strerror or err}); free some space or fix the directory's permissions, "
        "then run again"
    )


def _is_link_loop(link: Path) -> bool:
    """Whether following ``link`` never ends: a chain of links that leads back into itself."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # Python 3.11 reports a loop so; later versions raise OSError (ELOOP)
        return True
    except OSError as resolving:
        return resolving.errno == errno.ELOOP
    return False


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], directory: bool = False) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to; made durable and renamed onto ``path`` when the block ends.

    The temporary file is made before the block, empty and new (or, with ``directory``, an empty
    new directory), so no link planted at its name is followed. It is removed if the block
    raises; then ``path`` is untouched. An OSError (a full disk, a read-only directory) becomes a
    WriteError naming ``path``.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     with atomic_output(Path(directory) / "a.txt") as tmp:
    ...         _ = tmp.write_text("whole or nothing")
    ...     print((Path(directory) / "a.txt").read_text(), sorted(p.name for p in Path(directory).iterdir()))
    whole or nothing ['a.txt']
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        if directory:
            tmp.mkdir()
        else:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
    except OSError as err:
        raise write_error(path, err) from err
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as err:
        raise write_error(path, err) from err
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """``atomic_output`` through the file itself: the block writes (and may read back) the temporary file open
    on the descriptor that made it new, so nothing swapped in at its name meanwhile is written through."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        raise write_error(path, err) from err
    try:
        with os.fdopen(fd, "w+b") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
            if os.lstat(tmp).st_ino != os.fstat(file.fileno()).st_ino:
                raise link_error(tmp, "no longer the temporary file varpack made (it was replaced)")
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as err:
        raise write_error(path, err) from err
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically and durably."""
    with atomic_file(path) as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_manifest(
    manifest: Manifest,
    directory: str | os.PathLike[str],
    output: Callable[[str], contextlib.AbstractContextManager[Path]] | None = None,
) -> str:
    """Validate the manifest and write it into ``directory`` atomically; its presence marks a complete build.

    ``output`` gives a local path whose content becomes the file (default: ``atomic_output``);
    the write side passes its own, which also writes at a URL.
    Returns the manifest's path.
    """
    directory = os.fspath(directory)
    path = storage.join(directory, MANIFEST_NAME) if storage.is_url(directory) else os.path.join(directory, MANIFEST_NAME)
    validate_manifest(manifest.to_dict(), path)
    if output is None:
        atomic_write(path, manifest.to_json())
        return path
    with output(path) as tmp:
        tmp.write_text(manifest.to_json(), encoding="utf-8")
    return path


# The largest manifest read: real ones are kilobytes to a few megabytes.
MANIFEST_MAX_BYTES = 64 << 20


def _read_local_or_remote(path: str) -> bytes:
    """The manifest's bytes, at most MANIFEST_MAX_BYTES + 1 of them (one more tells a manifest too large)."""
    if storage.is_url(path):
        return storage.read_bytes(path, limit=MANIFEST_MAX_BYTES + 1)
    with open_regular(path) as file:
        return file.read(MANIFEST_MAX_BYTES + 1)


def read_manifest(path: str | os.PathLike[str], read: Callable[[str], bytes] | None = None) -> Manifest:
    """Load and validate a manifest: a file, a shard directory holding one, or a URL.

    ``read`` returns a file's bytes (default: the local disk, or ``schemas.storage`` for a URL).
    """
    try:
        path = storage.local_path(os.fspath(path))
    except ValueError as err:
        raise ManifestError(str(err)) from None
    if not storage.is_url(path) and os.path.isdir(path):
        path = os.path.join(path, MANIFEST_NAME)
    try:
        data = (read or _read_local_or_remote)(path)
        if len(data) > MANIFEST_MAX_BYTES:
            raise ManifestError(
                f"{path}: the manifest is over {MANIFEST_MAX_BYTES >> 20} MiB, larger than any build writes; "
                "it is not a manifest of this tool, rebuild the shards"
            )
        text = data.decode("utf-8")
    except FileNotFoundError as err:
        raise ManifestError(f"{path}: no manifest; the build is missing or was interrupted, run the pipeline again") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: the manifest could not be read ({err}); rebuild the shards") from err
    return Manifest.from_json(text, path)
