"""``python -m pipeline.beam_worker``: a worker process of pack's multi-process local runner.

Beam would start ``python -m apache_beam.runners.worker.sdk_worker_main``, which spends seconds
importing Beam before any varpack code runs, and when the command is killed meanwhile, waits
about two minutes for its runner. Here, importing ``pipeline`` first starts the watch on the
command (``parent_watch.py``); a worker whose command is already gone ends at once, and only
then is Beam's worker imported and run.
"""

from __future__ import annotations

import os
import shlex
import sys

from pipeline.parent_watch import PACK_PID_ENV, command_gone, watch_from_environment

WORKER_COMMAND = f"{shlex.quote(sys.executable)} -m pipeline.beam_worker"


def main() -> None:
    command = os.environ.get(PACK_PID_ENV, "")
    if command.isdigit() and not watch_from_environment() and command_gone(int(command)):
        sys.exit(f"varpack: the pack command {command} is gone; its worker ends with it")
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv)


if __name__ == "__main__":
    main()
