"""Worker processes that a ``pack`` command starts end as soon as the command is gone.

A killed run must leave no worker writing shards behind it. Beam's multi-process direct runner
starts its workers through a shell and gives them the command's environment, so the command
names itself in ``$VARPACK_PACK_PID`` while its pipeline runs, and every worker starts watching
that process when it first imports ``pipeline`` (whatever step it is given first); the steps
that write files also call ``exit_with_parent`` themselves. A worker wakes the moment the
command exits (a pidfd, Linux 5.3+; elsewhere it looks every 50 ms) and ends at once.
"""

from __future__ import annotations

import os
import select
import threading
import time

PACK_PID_ENV = "VARPACK_PACK_PID"

_parent_watch = threading.Lock()


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


def exit_with_parent(main_pid: int) -> None:
    """In a worker process that the pack command started, exit as soon as the command's process is gone.

    So a killed run leaves no worker writing shards behind it. Beam starts local workers
    through a shell, so the command is the worker's parent or grandparent. Runs once per
    process; does nothing in the command's own process or in workers it did not start (a
    cluster's).
    """
    if main_pid not in _ancestors() or not _parent_watch.acquire(blocking=False):
        return
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


def watch_from_environment() -> None:
    """``exit_with_parent`` for the command that ``$VARPACK_PACK_PID`` names, if any."""
    pid = os.environ.get(PACK_PID_ENV, "")
    if pid.isdigit():
        exit_with_parent(int(pid))
