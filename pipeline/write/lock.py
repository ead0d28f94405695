"""One owner per build directory: the lock that keeps concurrent ``pack`` runs of one build apart.

The lock is the file ``OUT/.NAME.lock`` beside the build directory ``OUT/NAME``, held with
``flock``: taking it is atomic, and the kernel (or the NFS lock manager) releases it when its
owner exits in any way, ``kill -9`` included, so a lock left by a dead run is stale by
construction and the next run takes it over. The file holds its owner (host, pid, process start
time), for the messages of the runs that wait:

    {"host": "node-3", "pid": 4121, "started_at": "2026-12-01T19:47:06+00:00"}

A run that finds the lock held waits for it (saying who holds it), then looks at the build
again: usually it is finished, and reused. Runs that only check a finished build for reuse
share the lock, so the nodes of a job verify it side by side. Everything that deletes files
of a build happens while holding its lock exclusively, so no run removes another live run's
files. Object stores have no such
lock; see ``build.py`` for what happens there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

from pipeline.errors import OutputDirError
from schemas.io import link_error, open_own, write_error

POLL_S = 0.2


def _physical(build_dir: str) -> str:
    """``build_dir`` as the filesystem finds it: a '..' in its parent is resolved from where the links before it point
    (``LINK/..`` goes up from the link's target, not back to where the link lies), so that every spelling of one
    directory names the same path. Without a '..', the path as written names the same place."""
    parent, name = os.path.split(build_dir.rstrip(os.sep) or build_dir)
    if os.pardir in parent.split(os.sep):
        parent = os.path.realpath(parent)
    elif parent:
        parent = os.path.normpath(parent)
    return os.path.join(parent, name)


def lock_path(build_dir: str) -> str:
    """The lock file of ``build_dir``: ``.NAME.lock`` beside it."""
    parent, name = os.path.split(_physical(build_dir))
    return os.path.join(parent, f".{name}.lock")


def _process_started_at() -> str:
    """When this process started (from /proc where there is one, else now), as ISO 8601 UTC."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        started = time.time()
    return datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")


def describe_owner(text: str) -> str:
    """The owner recorded in a lock file, in words."""
    try:
        owner = json.loads(text)
        return f"pid {owner['pid']} on {owner['host']} (started {owner['started_at']})"
    except (ValueError, KeyError, TypeError):
        return "another run (one checking it for reuse, or one just starting)"


def _read(path: str) -> str:
    try:
        fd = open_own(path, os.O_RDONLY)
    except OSError:
        return ""
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read(4096)


# What _try_lock returns for a shared lock on a file that does not exist: no run holds or held it.
_NO_LOCK_FILE = -1


def _try_lock(path: str, shared: bool) -> int | None:
    """An open descriptor holding the lock on the file at ``path``, or None when another process holds it.

    A link planted at ``path`` (its name is predictable) is refused, not followed: LinkError.
    """
    try:
        fd = open_own(path, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return _NO_LOCK_FILE
    except OSError as err:  # a read-only or unwritable --out
        raise write_error(path, err) from err
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as err:
        os.close(fd)
        raise OutputDirError(
            f"{path}: cannot be locked ({err}); --out must be on a filesystem with file locks (a local disk, NFS "
            "with locking), or an object store URL"
        ) from err
    try:
        same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same_file = False
    if not same_file:  # its owner removed it as we opened it: lock the new file instead
        os.close(fd)
        return _try_lock(path, shared)
    return fd


def _refuse_link(build_dir: str) -> None:
    """Raise LinkError when the build directory is a symbolic link: its name is predictable too, and what
    pack writes or deletes there would land where the link points."""
    if os.path.islink(_physical(build_dir)):
        raise link_error(build_dir, "a symbolic link")


@contextlib.contextmanager
def build_lock(
    build_dir: str, timeout_s: float | None, log: Callable[[str], None], shared: bool = False
) -> Iterator[None]:
    """Hold the lock of ``build_dir`` for the block, waiting up to ``timeout_s`` (None: without end) for it.

    The lock is exclusive (to build or clear the directory), or ``shared`` with other runs that
    only read the build (to check it for reuse) while no run holds it exclusively. Raises
    OutputDirError naming the owner when the wait times out.
    """
    path = lock_path(build_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as err:  # named as the user spelled it: the link, not where it leads
        raise write_error(os.path.dirname(build_dir.rstrip(os.sep)) or os.curdir, err) from err
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waiting = False
    while (fd := _try_lock(path, shared)) is None:
        owner = describe_owner(_read(path))
        if deadline is not None and time.monotonic() >= deadline:
            raise OutputDirError(
                f"{build_dir} is being built by {owner}; wait for it to finish (raise --lock-timeout), or stop "
                f"that run, then run again"
            )
        if not waiting:
            log(f"waiting for {build_dir}: {owner} is building it")
            waiting = True
        time.sleep(POLL_S)
    if fd == _NO_LOCK_FILE:
        _refuse_link(build_dir)
        yield
        return
    try:
        _refuse_link(build_dir)
        if not shared:
            previous = os.read(fd, 4096).decode("utf-8", "replace")
            if previous:
                log(f"taking over {build_dir} from {describe_owner(previous)}, which is no longer running")
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": _process_started_at()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
            os.fsync(fd)
        yield
    finally:
        if not shared:
            # Unlink while still holding the lock: a waiter that opened this file sees it was removed and retries.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.close(fd)
