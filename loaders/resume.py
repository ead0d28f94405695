"""The loader's position in an epoch, as the state dict a checkpoint stores and a resume seeks to.

A position is (epoch, batch): the rank's next batch in the epoch's fixed list of batches
(``partition.py``). A reader that is one of ``num_workers`` DataLoader workers records its own
next batch; one that reads in the training process (``num_workers == 1``) records the rank's.
Because the list of batches does not depend on the number of workers, a rank-level position
resumes under any number of workers: worker ``w`` starts at ``batch + w``.

torchdata's ``StatefulDataLoader`` keeps one state per worker; ``from_loader_state`` turns its
whole state dict back into the rank's position (the batch the epoch started at, plus the
batches the loader yielded), which is how a run resumes with a different ``num_workers``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from typing import Any

STATE_FORMAT = "varpack.loader_state"
STATE_VERSION = 1


class StaleStateError(RuntimeError):
    """The training process's copy of a dataset that DataLoader workers read: its position is not the loader's."""


@dataclass(frozen=True)
class Position:
    """Where a reader stands: it yields the rank's batches ``next_batch``, ``next_batch + num_workers``, ..."""

    epoch: int
    pass_start: int = 0  # the rank's batch this pass over the epoch began at
    next_batch: int = 0
    worker_id: int = 0
    num_workers: int = 1
    finished: bool = False  # this reader has yielded its last batch of the epoch

    def first_batch(self, worker_id: int, num_workers: int) -> tuple[int, int]:
        """(pass_start, first batch) for worker ``worker_id`` of ``num_workers`` resuming here."""
        if self.num_workers == 1:
            return self.next_batch, self.next_batch + worker_id
        if (self.worker_id, self.num_workers) == (worker_id, num_workers):
            return self.pass_start, self.next_batch
        raise ValueError(
            f"this state was saved by DataLoader worker {self.worker_id} of {self.num_workers} and cannot place "
            f"worker {worker_id} of {num_workers}; load the StatefulDataLoader's whole state_dict into the "
            "dataset (dataset.load_state_dict(loader.state_dict())) to resume with another number of workers"
        )


def to_state_dict(position: Position, identity: dict[str, Any], rank: int) -> dict[str, Any]:
    """The state dict of ``position``: plain ints, strings and bools, safe for torch.save and JSON."""
    return {"format": STATE_FORMAT, "version": STATE_VERSION, **identity, "rank": rank, **dataclasses.asdict(position)}


def from_state_dict(state: dict[str, Any], identity: dict[str, Any]) -> Position:
    """The position in a dataset state dict, or in a whole StatefulDataLoader state dict.

    Raises ValueError when the state is of another kind, or was saved with settings that
    make a different list of batches: any key of ``identity`` (the reader's build, seed, batch
    size, world size; a mixture's builds, weights and unit) whose value differs.
    """
    if not isinstance(state, dict):
        raise ValueError(f"expected a state dict, got {type(state).__name__}")
    if "_snapshot" in state:
        return _from_multiprocess_loader_state(state, identity)
    if "_num_yielded" in state and "dataset_state" in state:
        return from_state_dict(_dataset_state(state["dataset_state"]), identity)
    if state.get("format") != STATE_FORMAT:
        raise ValueError("not a PackedIterableDataset or StatefulDataLoader state dict (no 'format' key)")
    version = state.get("version", 0)
    _refuse_unless(type(version) is int, "version", version, "an integer")
    if version > STATE_VERSION:
        raise ValueError(f"loader state version {state['version']} is newer than this varpack reads ({STATE_VERSION})")
    changed = [
        f"{key} {state.get(key)!r} -> {identity[key]!r}" for key in identity if state.get(key) != identity[key]
    ]
    if changed:
        raise ValueError(
            "the state was saved with settings that give a different list of batches, so it cannot be resumed: "
            + "; ".join(changed)
        )
    position = Position(**{field.name: _position_field(state, field.name) for field in dataclasses.fields(Position)})
    _refuse_unless(position.epoch >= 0, "epoch", position.epoch, "a non-negative integer")
    _refuse_unless(position.num_workers >= 1, "num_workers", position.num_workers, "at least 1")
    _refuse_unless(0 <= position.worker_id < position.num_workers, "worker_id", position.worker_id,
                   f"in [0, {position.num_workers - 1}] (num_workers {position.num_workers})")
    return position


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
    # A reader is finished once it has yielded its last batch, so its next one lies past the end.
    _refuse_unless(not position.finished or position.next_batch >= num_batches, "finished", position.finished,
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


def _from_multiprocess_loader_state(state: dict[str, Any], identity: dict[str, Any]) -> Position:
    """The rank's position from a multi-worker StatefulDataLoader state: the pass's start plus the batches yielded."""
    snapshot = state["_snapshot"]
    _refuse_unless(isinstance(snapshot, dict), "_snapshot", snapshot, "an object (a StatefulDataLoader's snapshot)")
    snapshots = snapshot.get("_worker_snapshots")
    _refuse_unless(isinstance(snapshots, dict) and bool(snapshots), "_snapshot._worker_snapshots", snapshots,
                   "a non-empty object of {worker: state}")
    for worker, saved in snapshots.items():
        _refuse_unless(isinstance(saved, dict) and "dataset_state" in saved, f"_snapshot._worker_snapshots[{worker!r}]",
                       saved, "an object with a dataset_state")
    workers = [from_state_dict(_dataset_state(w["dataset_state"]), identity) for w in snapshots.values()]
    first = workers[0]
    if any((w.epoch, w.pass_start) != (first.epoch, first.pass_start) for w in workers):
        raise ValueError("the StatefulDataLoader's workers disagree on the epoch; the state is inconsistent")
    yielded = _position_field(snapshot, "_snapshot_step") + _position_field(state, "_steps_since_snapshot")
    return Position(
        epoch=first.epoch,
        pass_start=first.pass_start,
        next_batch=first.pass_start + yielded,
        finished=bool(state.get("_iterator_finished", False)),
    )
