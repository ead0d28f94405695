"""What a dataset in the training process and the DataLoader workers reading it tell each other.

Workers read copies of the dataset, so the training process's own position does not move while
they read. What the copies need to know of each other lives in a ``WorkerLedger``: a few integers
in shared memory, made with the dataset and handed on to the workers it starts (forked, or pickled
while spawning them). Any other copy (``copy.deepcopy``, a pickle round trip) is a dataset of its
own: it gets a ledger of its own that starts from the same values.

The invariant: an epoch counts as read by workers only once every worker of one pass has read its
share of it through. Each worker marks its share (epoch, first row, number of workers) started and
then finished, in a slot of its own; a worker never starts a share that an earlier pass started and
left unfinished, since the batches that pass's loop took (a ``break``, workers prefetching beyond
it) are known to no one. It refuses instead, until the training process names an epoch with
``set_epoch`` or loads a state, which starts the ledger afresh: a new generation, in which the marks
of workers still running from before (a refused pass's) no longer count.

Each generation also holds where the training process's dataset was set to read from (a pass it reads
itself starts a generation and moves that place along as it reads). A persistent worker, kept from pass
to pass, whose copy is of an earlier generation takes that place at the start of its next pass, as a
worker started then would, instead of going on from its own. A worker's first pass reads from its copy,
in the copy's generation: it may be a pass that was refused or dropped (its workers still starting when
``set_epoch`` ran), whose marks must not count.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from multiprocessing.context import get_spawning_popen
from typing import Any

READ_BY_WORKERS, EPOCH_NAMED, GENERATION, EPOCH_READ, READING_STATE = 0, 1, 2, 3, 4  # where each lies in the array
READING_STATE_FIELDS = 9  # the training process's position (7 integers), whether it was loaded, its pass had ended
SHARES = READING_STATE + READING_STATE_FIELDS
SHARE_FIELDS = 4  # epoch, start_row, num_workers, and NOT_STARTED, STARTED or FINISHED
NOT_STARTED, STARTED, FINISHED = 0, 1, 2
MAX_WORKERS = 256  # DataLoader workers of one dataset with a slot in the ledger


class WorkerLedger:
    """Shared between a dataset and its DataLoader workers: whether workers read it, the epoch the latest
    ``set_epoch`` named, the latest epoch a pass of them read through (-1: none since the training process's
    position was set), where the training process's dataset was set to read from, and each worker's share.

    >>> ledger = WorkerLedger()
    >>> ledger.join()  # in each worker process; here one process plays both workers
    >>> ledger.start_share(0, (0, 0, 2)), ledger.start_share(1, (0, 0, 2))  # epoch 0 from row 0, 2 workers
    (True, True)
    >>> ledger.finish_share(1, (0, 0, 2))  # worker 1 read its share through, worker 0 did not
    >>> ledger.epoch_read, ledger.start_share(0, (0, 0, 2))  # a new pass: worker 0's share was broken off
    (-1, False)
    >>> ledger.forget_passes(range(READING_STATE_FIELDS))  # set_epoch in the training process: where it reads from
    >>> ledger.join()  # a persistent worker's copy, of the earlier generation, would get that back
    >>> for worker in (0, 1):
    ...     ledger.start_share(worker, (0, 0, 2)) and ledger.finish_share(worker, (0, 0, 2))
    >>> ledger.epoch_read
    0
    """

    def __init__(self) -> None:
        self._values: Any = multiprocessing.RawArray("q", SHARES + SHARE_FIELDS * MAX_WORKERS)
        self._values[EPOCH_NAMED] = self._values[EPOCH_READ] = -1
        self._generation = 0  # of the training process's position this copy reads from
        self._worker_pid: int | None = None  # the worker process that joined with this copy

    @property
    def read_by_workers(self) -> bool:
        """DataLoader workers read the dataset: its position in the training process is not the loader's."""
        return bool(self._values[READ_BY_WORKERS])

    @read_by_workers.setter
    def read_by_workers(self, value: bool) -> None:
        self._values[READ_BY_WORKERS] = int(value)

    @property
    def epoch_named(self) -> int | None:
        """The latest ``set_epoch``'s argument in the training process, or None."""
        epoch = int(self._values[EPOCH_NAMED])
        return None if epoch < 0 else epoch

    @epoch_named.setter
    def epoch_named(self, epoch: int) -> None:
        self._values[EPOCH_NAMED] = epoch

    @property
    def epoch_read(self) -> int:
        """The latest epoch whose pass DataLoader workers read through, or -1."""
        return int(self._values[EPOCH_READ])

    @epoch_read.setter
    def epoch_read(self, epoch: int) -> None:
        self._values[EPOCH_READ] = epoch

    def join(self) -> tuple[int, ...] | None:
        """A worker's pass begins (its ``iter()``). A worker's first pass reads from the position its copy was made
        with, of that generation; a persistent worker's later passes from the training process's latest: its reading
        state is returned when it was set since the worker's previous pass, else None."""
        later_pass, self._worker_pid = self._worker_pid == os.getpid(), os.getpid()
        generation = int(self._values[GENERATION])
        if not later_pass or generation == self._generation:
            return None
        self._generation = generation
        return tuple(self._values[READING_STATE:SHARES])

    def start_share(self, worker_id: int, share: tuple[int, int, int]) -> bool:
        """Mark worker ``worker_id``'s ``share`` (epoch, start_row, num_workers) started; False, marking nothing, when
        an earlier pass started that share and did not finish it. A worker of an earlier generation marks nothing."""
        slot = self._slot(worker_id, share[2])
        if self._values[GENERATION] != self._generation:
            return True
        if tuple(self._values[slot : slot + SHARE_FIELDS]) == (*share, STARTED) or self.broken_off(share[:2], share[2]):
            return False
        self._values[slot : slot + SHARE_FIELDS] = [*share, STARTED]
        return True

    def broken_off(self, epoch_and_row: tuple[int, int], num_workers: int | None) -> bool:
        """Whether a pass of another number of workers than ``num_workers`` (of any, for None: the training process
        about to read the dataset itself) started a share of this epoch, from this start row, and did not finish it.
        The slots of a pass of this many workers are its own: a worker of it may have marked its share already."""
        for slot in range(SHARES, len(self._values), SHARE_FIELDS):
            epoch, start_row, workers, state = self._values[slot : slot + SHARE_FIELDS]
            if state == STARTED and (epoch, start_row) == epoch_and_row and workers != num_workers:
                return True
        return False

    def read_past(self, epoch: int) -> bool:
        """Whether a worker of this generation started a share of an epoch after ``epoch``."""
        return any(self._values[slot + SHARE_FIELDS - 1] != NOT_STARTED and self._values[slot] > epoch
                   for slot in range(SHARES, len(self._values), SHARE_FIELDS))

    def finish_share(self, worker_id: int, share: tuple[int, int, int]) -> None:
        """Mark the share finished; once every worker's share of the pass is, its epoch is read through."""
        if self._values[GENERATION] != self._generation:
            return
        self._values[self._slot(worker_id, share[2]) + SHARE_FIELDS - 1] = FINISHED
        slots = range(SHARES, SHARES + SHARE_FIELDS * share[2], SHARE_FIELDS)
        if all(tuple(self._values[slot : slot + SHARE_FIELDS]) == (*share, FINISHED) for slot in slots):
            self.epoch_read = share[0]

    def forget_share(self, worker_id: int) -> None:
        """Worker ``worker_id`` stands where the loader's loop stood (torchdata gave it its own state back)."""
        self._values[self._slot(worker_id, worker_id + 1) + SHARE_FIELDS - 1] = NOT_STARTED

    def forget_passes(self, reading_state: Iterable[int]) -> None:
        """The training process's dataset was set to read from ``reading_state`` (``READING_STATE_FIELDS`` integers
        of its choice): a new generation, from which no pass of workers has read yet."""
        self._generation = int(self._values[GENERATION]) + 1
        self._values[GENERATION:] = [self._generation, -1, *reading_state,
                                     *[NOT_STARTED] * (len(self._values) - SHARES)]

    def read_on(self, reading_state: Iterable[int]) -> None:
        """The training process's dataset, reading itself, moved on to ``reading_state`` within its generation: a
        persistent worker joining it takes that place."""
        self._values[READING_STATE:SHARES] = list(reading_state)

    def _slot(self, worker_id: int, num_workers: int) -> int:
        if num_workers > MAX_WORKERS:
            raise ValueError(f"num_workers={num_workers}: a dataset is read by at most {MAX_WORKERS} DataLoader "
                             "workers; use fewer")
        return SHARES + SHARE_FIELDS * worker_id

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory goes only to a process being started; any other copy takes the values.
        values = self._values if get_spawning_popen() is not None else list(self._values)
        return {"values": values, "generation": self._generation, "worker_pid": self._worker_pid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        values = state["values"]
        self._values, self._generation, self._worker_pid = values, state["generation"], state["worker_pid"]
        if isinstance(values, list):
            self._values = multiprocessing.RawArray("q", len(values))
            self._values[:] = values
