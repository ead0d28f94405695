"""Worker processes that a ``pack`` command starts end as soon as the command is gone.

A killed run must leave no worker writing shards behind it, nor one waiting for a runner that is
gone. Beam's multi-process direct runner starts its workers through a shell and gives them the
command's environment, so the command names itself in ``$VARPACK_PACK_PID`` while its pipeline
runs. Its workers start as ``python -m pipeline.beam_worker``, so each one watches that process
from its first instant, before Beam is imported, and ends at once if the command is already
gone. Any other process that imports ``pipeline`` under that variable watches it too, and the
steps that write files call ``exit_with_parent`` themselves. A worker wakes the moment the
command exits (a pidfd, Linux 5.3+; elsewhere it looks every 50 ms) and ends at once.
"""

from __future__ import annotations

import os
import select
import threading
import time

PACK_PID_ENV = "VARPACK_PACK_PID"

_parent_watch = threading.Lock()
_watched: int | None = None  # the command this process watches


def _ancestors() -> list[int]:
    """The pids of this process's parent, its parent's parent, ..., as far as /proc tells (the parent alone without it)."""
    chain, pid = [], os.getppid()
    while pid > 1 and len(chain) < 8:
        chain.append(pid)
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


def exit_with_parent(main_pid: int) -> bool:
    """In a worker process that the pack command started, exit as soon as the command's process is gone.

    So a killed run leaves no worker writing shards behind it. Beam starts local workers
    through a shell, so the command is the worker's parent or grandparent. Starts one watch per
    process, and returns whether this process watches ``main_pid``: False in the command's own
    process, in workers it did not start (a cluster's), and once the command is gone.
    """
    global _watched
    with _parent_watch:
        if _watched is not None:
            return _watched == main_pid
        if main_pid not in _ancestors():
            return False
        try:
            command = os.pidfd_open(main_pid)  # readable the moment the command exits (Linux 5.3+)
        except (AttributeError, OSError):
            command = None

        def watch() -> None:
            if command is not None:
                select.select([command], [], [])
            else:
                while main_pid in _ancestors():
                    time.sleep(0.05)
            os._exit(1)

        threading.Thread(target=watch, name="varpack-parent-watch", daemon=True).start()
        _watched = main_pid
        return True


def command_gone(main_pid: int) -> bool:
    """Whether the command ``main_pid`` is gone: no longer this process's ancestor (where /proc tells), or no process at all."""
    if os.path.exists("/proc/self/stat"):
        return main_pid not in _ancestors()
    try:
        os.kill(main_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def watch_from_environment() -> bool:
    """``exit_with_parent`` for the command that ``$VARPACK_PACK_PID`` names; False when it names none."""
    pid = os.environ.get(PACK_PID_ENV, "")
    return pid.isdigit() and exit_with_parent(int(pid))
