"""The loader's position in an epoch, as the state dict a checkpoint stores and a resume seeks to.

A position is (epoch, first row, batch): the epoch's rows in their seeded order, of which all
ranks together had read ``start_row`` when the current list of batches was cut from the rest
(``partition.py``; 0 unless the run was resumed with another layout), and the rank's next batch
in that list. A reader that is one of ``num_workers`` DataLoader workers records its own next
batch; one that reads in the training process (``num_workers == 1``) records the rank's. A worker
of one records the same fields as the rank: given back to that worker by torchdata, which goes on
counting the pass's batches from its start, the position is read as the worker's own.
Because the list of batches does not depend on the number of workers, a rank-level position
resumes under any number of workers: worker ``w`` starts at ``batch + w``.

Elastic resume: the state also records the layout it was saved under (world size and batch
budget; a mixture's weights). Every rank stops at the same step, so any rank's position says how
many of the epoch's rows all ranks had read: the rows of the first ``next_batch * world_size``
batches of the list. A reader of another layout cuts its own list from the rows after those.
The state records that count (``rows_read``), so that the states of a run's ranks can be
checked against each other before a resume: states of different steps would read rows twice.

torchdata's ``StatefulDataLoader`` keeps one state per worker; ``from_loader_state`` turns its
whole state dict back into the rank's position (the batch the epoch started at, plus the
batches the loader yielded), which is how a run resumes with a different ``num_workers``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from typing import Any

from .partition import MAX_PROCESSES

STATE_FORMAT = "varpack.loader_state"
STATE_VERSION = 3  # 3: rows_read; 2: start_row (a version 1 state starts at row 0)
MAX_COUNT = 1 << 53  # epochs, rows or batches: more than any run reads
MAX_BATCH_TOKENS = (1 << 31) - 1  # a batch's cu_seq_lens are int32, as FlashAttention takes them


class StaleStateError(RuntimeError):
    """The training process's copy of a dataset that DataLoader workers read: its position is not the loader's."""


@dataclass(frozen=True)
class Position:
    """Where a reader stands: it yields the rank's batches ``next_batch``, ``next_batch + num_workers``, ..."""

    epoch: int
    start_row: int = 0  # rows of the epoch's order all ranks had read before this list of batches
    pass_start: int = 0  # the rank's batch this pass over the epoch began at
    next_batch: int = 0
    worker_id: int = 0
    num_workers: int = 1
    finished: bool = False  # this reader has yielded its last batch of the epoch

    def batches_read(self, num_batches: int) -> int:
        """How many batches of the list every rank had read here (a rank-level position, or a finished one)."""
        if self.finished and self.next_batch < num_batches:
            return self.pass_start  # a pass that named an epoch finished before it
        return min(self.next_batch, num_batches)

    def first_batch(self, worker_id: int, num_workers: int, restored: bool = False) -> tuple[int, int]:
        """(pass_start, first batch) for worker ``worker_id`` of ``num_workers`` resuming here.

        ``restored``: this is the worker's own position, given back to it by torchdata, which goes on
        counting the batches from the pass's start; a worker of one records the same fields as a rank.
        """
        if self.num_workers == 1 and not restored:
            return self.next_batch, self.next_batch + worker_id
        if (self.worker_id, self.num_workers) == (worker_id, num_workers):
            return self.pass_start, self.next_batch
        raise ValueError(
            f"this state was saved by DataLoader worker {self.worker_id} of {self.num_workers} and cannot place "
            f"worker {worker_id} of {num_workers}; load the StatefulDataLoader's whole state_dict into the "
            "dataset (dataset.load_state_dict(loader.state_dict())) to resume with another number of workers"
        )


@dataclass(frozen=True)
class SavedState:
    """A loader state read back: the position, and the layout (world size, rank, batch budget; a mixture's weights)
    it was saved under."""

    position: Position
    layout: dict[str, Any]
    rows_read: int | None = None  # of the epoch's rows, by all ranks (a rank-level state of version 3)
    # A StatefulDataLoader state whose pass had run out: torchdata restores it through one iterator more than the loop's.
    loader_pass_ended: bool = False


def to_state_dict(position: Position, identity: dict[str, Any], layout: dict[str, Any],
                  rows_read: int | None) -> dict[str, Any]:
    """The state dict of ``position``: plain ints, strings and bools, safe for torch.save and JSON."""
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity, **layout, **dataclasses.asdict(position),
            "rows_read": rows_read}


def from_state_dict(state: dict[str, Any], identity: dict[str, Any], layout_keys: tuple[str, ...]) -> SavedState:
    """The position in a dataset state dict, or in a whole StatefulDataLoader state dict, and its layout.

    Raises ValueError when the state is of another kind, or was saved with settings that make
    another order of the epoch's rows: any key of ``identity`` (the reader's build, seed and
    shuffle; a mixture's builds, unit and caps) whose value differs. The values of
    ``layout_keys`` are returned as saved, for the reader to check.
    """
    if not isinstance(state, dict):
        raise ValueError(f"expected a state dict, got {type(state).__name__}")
    if "_snapshot" in state:
        return _from_multiprocess_loader_state(state, identity, layout_keys)
    if "_num_yielded" in state and "dataset_state" in state:
        return from_state_dict(_dataset_state(state["dataset_state"]), identity, layout_keys)
    if state.get("format") != STATE_FORMAT:
        raise ValueError("not a PackedIterableDataset or StatefulDataLoader state dict (no 'format' key)")
    version = state.get("version", 0)
    _refuse_unless(type(version) is int, "version", version, "an integer")
    _refuse_unless(version >= 0, "version", version, "a non-negative integer")
    if version > STATE_VERSION:
        raise ValueError(f"loader state version {state['version']} is newer than this varpack reads ({STATE_VERSION})")
    changed = [
        f"{key} {state.get(key)!r} -> {identity[key]!r}" for key in identity if state.get(key) != identity[key]
    ]
    if changed:
        raise ValueError(
            "the state was saved with settings that give another order of the epoch's rows, so it cannot be resumed: "
            + "; ".join(changed)
        )
    saved = {**({"start_row": 0} if version < 2 else {}), **state}
    position = Position(**{field.name: _position_field(saved, field.name) for field in dataclasses.fields(Position)})
    for name in ("epoch", "start_row", "pass_start", "next_batch"):
        _refuse_unless(0 <= getattr(position, name) < MAX_COUNT, name, getattr(position, name), _count(MAX_COUNT))
    _refuse_unless(1 <= position.num_workers <= MAX_PROCESSES, "num_workers", position.num_workers,
                   f"in [1, {MAX_PROCESSES}]")
    _refuse_unless(0 <= position.worker_id < position.num_workers, "worker_id", position.worker_id,
                   f"in [0, {position.num_workers - 1}] (num_workers {position.num_workers})")
    rows_read = saved.get("rows_read")
    _refuse_unless(rows_read is None or (_is_int(rows_read) and 0 <= rows_read < MAX_COUNT), "rows_read", rows_read,
                   f"null or {_count(MAX_COUNT)}")
    return SavedState(position, {key: state.get(key) for key in layout_keys}, rows_read)


def check_layout(layout: dict[str, Any], capacity: int) -> None:
    """ValueError naming the field of a saved layout (world size, rank, batch budget) no reader could have had.

    torch counts ranks in a C int, and a batch's tokens must fit the int32 ``cu_seq_lens``.
    """
    world_size: Any = layout.get("world_size")
    rank: Any = layout.get("rank")
    batch_rows: Any = layout.get("batch_rows")
    tokens_per_batch: Any = layout.get("tokens_per_batch")
    _refuse_unless(_is_int(world_size) and 1 <= world_size <= MAX_PROCESSES, "world_size", world_size,
                   f"a positive integer of at most {MAX_PROCESSES}")
    _refuse_unless(_is_int(rank) and 0 <= rank < world_size, "rank", rank, f"in [0, {world_size - 1}] (world_size "
                   f"{world_size})")
    _refuse_unless((batch_rows is None) != (tokens_per_batch is None), "batch_rows", batch_rows,
                   "a positive integer when tokens_per_batch is null, else null")
    _refuse_unless(batch_rows is None or (_is_int(batch_rows) and 1 <= batch_rows <= MAX_BATCH_TOKENS // capacity),
                   "batch_rows", batch_rows, f"null or in [1, {MAX_BATCH_TOKENS // capacity}] (rows of {capacity} tokens "
                   f"that fit a batch of {MAX_BATCH_TOKENS})")
    _refuse_unless(tokens_per_batch is None or (_is_int(tokens_per_batch)
                                                and capacity <= tokens_per_batch <= MAX_BATCH_TOKENS),
                   "tokens_per_batch", tokens_per_batch, f"null or in [{capacity}, {MAX_BATCH_TOKENS}] (at least one "
                   "row)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(bound: int) -> str:
    return f"a non-negative integer below {bound}"


def check_position(position: Position, num_batches: int) -> None:
    """Raise ValueError naming the field of ``position`` that lies outside an epoch of ``num_batches`` batches.

    A worker's next batch is ``pass_start + worker_id + k * num_workers``; past its last batch it
    stands less than ``num_workers`` batches beyond the end.
    """
    _refuse_unless(0 <= position.pass_start <= num_batches, "pass_start", position.pass_start,
                   f"in [0, {num_batches}] (epoch {position.epoch} has {num_batches} batches on this rank)")
    first = position.pass_start + position.worker_id
    last = num_batches + position.num_workers - 1
    steps = f", {first} plus a multiple of num_workers {position.num_workers}," if position.num_workers > 1 else ""
    _refuse_unless(
        first <= position.next_batch <= last and (position.next_batch - first) % position.num_workers == 0,
        "next_batch", position.next_batch,
        f"in [{first}, {last}]{steps} (epoch {position.epoch} has {num_batches} batches on this rank)",
    )
    # A reader is finished once it has yielded its last batch, so its next one lies past the end; or it named
    # an epoch that was finished where its pass began (a resume under another layout), and read nothing.
    _refuse_unless(not position.finished or position.next_batch >= num_batches
                   or position.next_batch == position.pass_start + position.worker_id, "finished", position.finished,
                   f"false at next_batch {position.next_batch} (epoch {position.epoch} has {num_batches} batches on "
                   "this rank)")


def _position_field(state: dict[str, Any], name: str) -> Any:
    """Field ``name`` of a state dict: an integer, or a bool for ``finished``; else ValueError naming it."""
    if name not in state:
        raise ValueError(f"loader state: {name} is missing; the state is incomplete, save it again")
    value = state[name]
    if name == "finished":
        _refuse_unless(isinstance(value, bool), name, value, "true or false")
    else:
        _refuse_unless(isinstance(value, int) and not isinstance(value, bool), name, value, "an integer")
    return value


def _refuse_unless(holds: bool, name: str, value: Any, must_be: str) -> None:
    if not holds:
        raise ValueError(f"loader state: {name} {reprlib.repr(value)} must be {must_be}; the state is corrupt or "
                         "was edited")


def _dataset_state(state: Any) -> dict[str, Any]:
    if state is None:
        raise ValueError("the StatefulDataLoader state holds no dataset state; was it saved from a PackedIterableDataset?")
    return state


def _from_multiprocess_loader_state(state: dict[str, Any], identity: dict[str, Any],
                                    layout_keys: tuple[str, ...]) -> SavedState:
    """The rank's position from a multi-worker StatefulDataLoader state: the pass's start plus the batches yielded."""
    snapshot = state["_snapshot"]
    _refuse_unless(isinstance(snapshot, dict), "_snapshot", snapshot, "an object (a StatefulDataLoader's snapshot)")
    snapshots = snapshot.get("_worker_snapshots")
    _refuse_unless(isinstance(snapshots, dict) and bool(snapshots), "_snapshot._worker_snapshots", snapshots,
                   "a non-empty object of {worker: state}")
    for worker, saved in snapshots.items():
        _refuse_unless(isinstance(saved, dict) and "dataset_state" in saved, f"_snapshot._worker_snapshots[{worker!r}]",
                       saved, "an object with a dataset_state")
    saved = [from_state_dict(_dataset_state(w["dataset_state"]), identity, layout_keys) for w in snapshots.values()]
    first = saved[0].position
    if any((s.position.epoch, s.position.start_row, s.position.pass_start, s.layout)
           != (first.epoch, first.start_row, first.pass_start, saved[0].layout) for s in saved):
        raise ValueError("the StatefulDataLoader's workers disagree on the epoch; the state is inconsistent")
    yielded = _loader_count(snapshot, "_snapshot_step") + _loader_count(state, "_steps_since_snapshot")
    pass_ended: Any = state.get("_iterator_finished")
    _refuse_unless(isinstance(pass_ended, bool), "_iterator_finished", pass_ended, "true or false")
    position = Position(
        epoch=first.epoch,
        start_row=first.start_row,
        pass_start=first.pass_start,
        next_batch=first.pass_start + yielded,
        # Every worker finished: their pass named an epoch that had finished, before the loader yielded anything.
        finished=pass_ended or all(s.position.finished for s in saved),
    )
    return SavedState(position, saved[0].layout, loader_pass_ended=pass_ended)


def _loader_count(state: dict[str, Any], name: str) -> int:
    """Field ``name`` of a StatefulDataLoader state, a count of batches it yielded; else ValueError naming it."""
    count = _position_field(state, name)
    _refuse_unless(0 <= count < MAX_COUNT, name, count, _count(MAX_COUNT))
    return int(count)
