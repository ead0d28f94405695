"""What a dataset in the training process and the DataLoader workers reading it tell each other.

Workers read copies of the dataset, so the training process's own position does not move while
they read. What the copies need to know of each other lives in a ``WorkerLedger``: a few integers
in shared memory, made with the dataset and handed on to the workers it starts (forked, or pickled
while spawning them). Any other copy (``copy.deepcopy``, a pickle round trip) is a dataset of its
own: it gets a ledger of its own that starts from the same values.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import get_spawning_popen
from typing import Any

READ_BY_WORKERS, EPOCH_READ = 0, 1  # the slots of the shared array


class WorkerLedger:
    """Shared between a dataset and its DataLoader workers: whether workers read it, and the latest epoch their
    passes read through (-1: none since the training process's position was set).

    >>> ledger = WorkerLedger()
    >>> ledger.epoch_read
    -1
    """

    def __init__(self, values: list[int] | None = None) -> None:
        self._values: Any = multiprocessing.RawArray("q", values or [0, -1])

    @property
    def read_by_workers(self) -> bool:
        """DataLoader workers read the dataset: its position in the training process is not the loader's."""
        return bool(self._values[READ_BY_WORKERS])

    @read_by_workers.setter
    def read_by_workers(self, value: bool) -> None:
        self._values[READ_BY_WORKERS] = int(value)

    @property
    def epoch_read(self) -> int:
        """The latest epoch whose pass DataLoader workers read through, or -1."""
        return int(self._values[EPOCH_READ])

    @epoch_read.setter
    def epoch_read(self, epoch: int) -> None:
        self._values[EPOCH_READ] = epoch

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory goes only to a process being started; any other copy takes the values.
        return {"values": self._values if get_spawning_popen() is not None else list(self._values)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        values = state["values"]
        self._values = multiprocessing.RawArray("q", values) if isinstance(values, list) else values
