"""Checkpoint files the training loops write and read back, none of them unpickled.

A checkpoint directory ``OUT/checkpoint-STEP`` holds the model (safetensors), each rank's loader
position as JSON (``loader_state.json``, ``loader_state-rankN.json``: ints, strings, floats and
dicts), and the plain loop's ``training_state.pt`` (optimizer, scheduler, step and RNG states:
tensors and plain values, read with ``torch.load(weights_only=True)``). A checkpoint downloaded
from elsewhere can therefore hold data but never code.

The plain loop writes a checkpoint under a temporary name (``OUT/.checkpoint-STEP.partial``) and
renames it when every rank has written its part, so a run killed mid-save leaves the previous
checkpoints as they were. transformers' ``Trainer`` writes its directory in place; its loader
states are written last, so a checkpoint is complete once every rank's loader state is there.
``latest_checkpoint`` takes the newest complete one.

The plain loop's side, shared by ``scripts/train.py`` and whatever loop saves the same way::

    refuse_earlier_run(out, resume)                    # a new run never mixes with an earlier one's checkpoints
    checkpoint = checkpoint_to_resume(out, rank, print) if resume else None
    step = resume_plain_run(checkpoint, optimizer, scheduler, dataset) if checkpoint else 0
    ...
    with writing_checkpoint(out, step, dataset) as partial:   # published once every rank has written its part
        if dataset.rank == 0:
            model.save_pretrained(partial)
            save_training_state(partial, training_state(optimizer, scheduler, step))

``PackedTrainer`` restores its loader position with the same ``restore_loader_state``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loaders.train.distributed import world_size

if TYPE_CHECKING:
    from loaders.dataset import PackedIterableDataset

CHECKPOINT_PREFIX = "checkpoint-"
LOADER_STATE = "loader_state.json"
TRAINING_STATE = "training_state.pt"
PARTIAL_SUFFIX = ".partial"
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back: corrupt, incomplete, of an older format, or unsafe."""


def loader_state_name(rank: int) -> str:
    """Each rank saves its own loader position; rank 0's (the only one of a single process) keeps the plain name."""
    return LOADER_STATE if rank == 0 else LOADER_STATE.replace(".json", f"-rank{rank}.json")


def save_loader_state(directory: str | os.PathLike[str], rank: int, state: dict[str, Any]) -> None:
    """Write ``rank``'s loader state (a dataset's ``state_dict()``) into ``directory`` as JSON."""
    path = Path(directory) / loader_state_name(rank)
    # A new file of a random name (O_EXCL), renamed over the state: never a link followed, never half a state.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as partial:
        partial.write(json.dumps(state, sort_keys=True))
    os.replace(partial.name, path)


def load_loader_state(directory: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """``rank``'s loader state from a checkpoint directory; CheckpointError names the file and what to do.

    A checkpoint saved by fewer processes holds no state for ``rank``: it gets rank ``rank % saved``'s, since
    every rank stood at the same step and any rank's state resumes any rank (an elastic resume). Every saved
    rank's state is read and compared, so that states of different steps (a mixed-up checkpoint), which would
    read rows twice, are refused naming two ranks that disagree."""
    directory = Path(directory)
    states = [_read_loader_state(directory, saved) for saved in range(saved_world_size(directory, rank + 1))]
    first = _step(states[0])
    for saved, state in enumerate(states[1:], start=1):
        if (step := _step(state)) != first:
            differ = [key for key in first if step[key] != first[key]]
            ours, theirs = (", ".join(f"{key} {where[key]!r}" for key in differ) for where in (first, step))
            raise CheckpointError(f"{directory}: the loader states of rank 0 ({ours}) and rank {saved} ({theirs}) "
                                  "stand at different steps, so resuming would read rows twice; the checkpoint mixes "
                                  "files of different saves: resume from another checkpoint")
    return states[rank % len(states)]


def _step(state: dict[str, Any]) -> dict[str, Any]:
    """Where a loader state stands in the run: its epoch, the rank's batches and the rows all ranks had read."""
    return {key: state.get(key) for key in ("epoch", "start_row", "next_batch", "rows_read")}


def _read_loader_state(directory: Path, rank: int) -> dict[str, Any]:
    """The JSON loader state rank ``rank`` saved in ``directory``."""
    path = directory / loader_state_name(rank)
    if not path.is_file():
        legacy = path.with_suffix(".pt")
        if legacy.is_file():
            raise CheckpointError(
                f"{legacy}: a loader state in the old pickle format, which is not read because unpickling can run "
                f"code; resume from a checkpoint written by this version, or, if you trust the file, convert it: "
                f"python -c \"import json, torch; json.dump(torch.load('{legacy}', weights_only=False), "
                f"open('{path}', 'w'))\""
            )
        raise CheckpointError(f"{path}: missing; the checkpoint holds no loader position for rank {rank}, so the data "
                              "position cannot be restored (was it written by varpack's trainers?)")
    try:
        state = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: not a loader state ({err}); the file is truncated or corrupt: resume from an "
                              "earlier checkpoint, or delete this one") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(state).__name__}, not a loader state; the file is corrupt")
    if state.get("rank", rank) != rank:
        raise CheckpointError(f"{path}: holds rank {state['rank']!r}'s loader position, not rank {rank}'s; the file "
                              "was moved or edited")
    return state


def save_training_state(directory: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """The plain loop's optimizer, scheduler, step and RNG states: tensors and plain values only."""
    torch.save(state, Path(directory) / TRAINING_STATE)


def load_training_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``training_state.pt`` with ``weights_only=True``: a file that needs more than tensors is refused."""
    path = Path(directory) / TRAINING_STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain values, and loading it "
                              f"would run their code ({str(err).splitlines()[0]})") from None
    except (RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path}: cannot be read ({str(err).splitlines()[0]}); the file is truncated or "
                              "corrupt: resume from an earlier checkpoint, or delete this one") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a training state; the file is corrupt")
    return state


def saved_world_size(checkpoint: Path, default: int) -> int:
    """The number of processes that saved ``checkpoint``, as rank 0's loader state records it (``default`` when that
    state is missing or unreadable: resuming from it then fails with a line that names it)."""
    try:
        state = json.loads((checkpoint / LOADER_STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return default
    size = state.get("world_size") if isinstance(state, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else default


def is_complete(checkpoint: Path, world_size: int) -> bool:
    """Whether every rank's loader state (written last) is in ``checkpoint``, for the number of processes that saved
    it (``world_size`` when rank 0's does not say); an older version's pickled one counts, so that resuming from it
    is refused with a line that says what to do, not passed over."""
    ranks = saved_world_size(checkpoint, world_size)
    return all((checkpoint / name).is_file() or (checkpoint / name).with_suffix(".pt").is_file()
               for name in map(loader_state_name, range(ranks)))


def checkpoints(out: str | os.PathLike[str]) -> list[Path]:
    """The ``checkpoint-STEP`` directories of ``out``, by step."""
    found = [(int(match[1]), path) for path in Path(out).iterdir()
             if (match := _CHECKPOINT_NAME.match(path.name)) and path.is_dir() and not path.is_symlink()]
    return [path for _, path in sorted(found)]


def latest_checkpoint(out: str | os.PathLike[str], world_size: int = 1) -> Path | None:
    """The newest complete checkpoint in ``out`` (see the module docstring), or None. It may have been saved by
    another number of processes than ``world_size``: the loader resumes on any (``load_loader_state``)."""
    complete = _complete_checkpoints(out, world_size)
    return complete[-1] if complete else None


def _complete_checkpoints(out: str | os.PathLike[str], world_size: int) -> list[Path]:
    return [path for path in checkpoints(out) if is_complete(path, world_size)] if Path(out).is_dir() else []


def incomplete_checkpoints(out: str | os.PathLike[str], world_size: int = 1) -> list[Path]:
    """Checkpoints newer than the latest complete one that lack a rank's loader state: left by a killed save."""
    if not Path(out).is_dir():
        return []
    complete = _complete_checkpoints(out, world_size)
    latest = complete[-1] if complete else None
    return [path for path in checkpoints(out) if not is_complete(path, world_size)
            and (latest is None or int(path.name.removeprefix(CHECKPOINT_PREFIX)) > int(latest.name.removeprefix(CHECKPOINT_PREFIX)))]


def partial_checkpoint(out: Path, step: int) -> Path:
    """The temporary directory the checkpoint of ``step`` is written into before it is published."""
    return out / f".{CHECKPOINT_PREFIX}{step}{PARTIAL_SUFFIX}"


def start_checkpoint(out: Path, step: int) -> Path:
    """A fresh, empty temporary directory for the checkpoint of ``step`` (a leftover one is removed first)."""
    partial = partial_checkpoint(out, step)
    if partial.is_symlink():
        partial.unlink()
    elif partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    return partial


def publish_checkpoint(out: Path, step: int) -> Path:
    """Rename the complete temporary directory of ``step`` to ``checkpoint-STEP``, replacing an older one."""
    final = out / f"{CHECKPOINT_PREFIX}{step}"
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        shutil.rmtree(final)
    os.replace(partial_checkpoint(out, step), final)
    return final


def remove_partial_checkpoints(out: Path) -> list[Path]:
    """Remove the temporary directories that saves killed before they were published left in ``out``."""
    found = sorted(out.glob(f".{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}"))
    for path in found:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)
    return found


# ---- the plain loop's checkpoints: a run's output directory, saving, resuming --------------------


# safetensors' dtype names of the weights a checkpoint may hold.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def refuse_other_weights_dtype(checkpoint: Path, dtype: torch.dtype, setting: str) -> None:
    """Refuse to resume ``checkpoint`` when most of its weights (by elements, over every safetensors file) are not
    ``dtype``, the dtype the run trains in (``setting``, the option that chose it): a resume would silently round
    fp32 weights and optimizer state to bf16, or go on in fp32 from a bf16 run."""
    from safetensors import SafetensorError, safe_open

    # The dtype of most of the weights: a model may keep a few small tensors in fp32 (a MoE router's bias) either way.
    elements: dict[str, int] = {}
    paths = sorted(checkpoint.glob("*.safetensors"))
    try:
        for path in paths:
            with safe_open(str(path), "pt") as weights:
                for name in weights.keys():
                    tensor = weights.get_slice(name)
                    elements[tensor.get_dtype()] = elements.get(tensor.get_dtype(), 0) + math.prod(tensor.get_shape())
    except (SafetensorError, OSError):
        return  # unreadable: loading the weights names the file
    stored = _SAFETENSORS_DTYPES.get(max(elements, key=elements.__getitem__)) if elements else None
    if stored is not None and stored != dtype:
        raise CheckpointError(f"--resume: {checkpoint} holds {str(stored).removeprefix('torch.')} weights, but {setting} "
                              f"trains {str(dtype).removeprefix('torch.')} ones; resume with the precision the run began "
                              "with, or give another --out")


def refuse_earlier_run(out: Path, resume: bool) -> None:
    """Refuse a new run (``resume`` False) into an ``out`` that holds another run's checkpoints: a later resume would
    continue from whichever is newest, of either run."""
    found = checkpoints(out) if out.is_dir() else []
    if found and not resume:
        names = found[0].name if len(found) == 1 else f"{found[0].name} ... {found[-1].name}"
        raise CheckpointError(f"--out {out} holds the checkpoints of an earlier run ({names}); pass --resume to "
                              "continue it, give another --out, or remove them")


def resumable_checkpoint(out: Path, ranks: int) -> Path | None:
    """The newest complete checkpoint in ``out``, or None when it holds none at all; a CheckpointError when it holds
    checkpoints but none complete, so that a resume never trains from step 0 over them."""
    latest = latest_checkpoint(out, ranks)
    found = checkpoints(out) if out.is_dir() else []
    if latest is None and found:
        raise CheckpointError(f"--out {out}: --resume found no complete checkpoint among {len(found)} "
                              f"({', '.join(path.name for path in found)}): each lacks a rank's loader state; remove "
                              "them to start again, or give another --out")
    return latest


def checkpoint_to_resume(out: Path, rank: int, report: Callable[[dict[str, str]], None]) -> Path | None:
    """The newest complete checkpoint in ``out`` (``resumable_checkpoint``); rank 0 first removes the temporary
    directories of saves that were killed and ``report``s each, and each incomplete checkpoint it passes over."""
    ranks = world_size()
    if rank == 0:
        for path in remove_partial_checkpoints(out):
            report({"removed_unfinished_checkpoint": str(path)})
        for path in incomplete_checkpoints(out, ranks):
            report({"skipped_incomplete_checkpoint": str(path)})
    if ranks > 1:
        torch.distributed.barrier()  # nothing is removed while another rank looks
    return resumable_checkpoint(out, ranks)


@contextlib.contextmanager
def writing_checkpoint(out: Path, step: int, dataset: PackedIterableDataset) -> Iterator[Path]:
    """The temporary directory of ``step``'s checkpoint, for rank 0 to write the weights and training state into;
    then every rank's loader position is added and, once all have written, it is published as ``checkpoint-STEP``.

    A write that fails (a full disk) removes the temporary directory and raises an OSError of one line.
    """
    from safetensors import SafetensorError  # comes with transformers, which writes the weights

    distributed = world_size() > 1
    if dataset.rank == 0:
        start_checkpoint(out, step)
    if distributed:
        torch.distributed.barrier()  # the temporary directory exists
    partial = partial_checkpoint(out, step)
    try:
        yield partial
        save_loader_state(partial, dataset.rank, dataset.state_dict())
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk: safetensors and torch.save raise their own
        if dataset.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise OSError(f"{out / f'{CHECKPOINT_PREFIX}{step}'}: cannot be written ({str(err).splitlines()[0]}); nothing "
                      "of it is kept: free space (or fix --out) and --resume from the previous checkpoint") from None
    if distributed:
        torch.distributed.barrier()  # every rank has written its part
    if dataset.rank == 0:
        publish_checkpoint(out, step)
    if distributed:
        torch.distributed.barrier()  # published before any rank goes on


def training_state(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                   step: int) -> dict[str, Any]:
    """What ``training_state.pt`` holds: the optimizer, scheduler, step and RNG states (tensors and plain values)."""
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step, "rng": rng_state()}


def resume_plain_run(checkpoint: Path, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, dataset: PackedIterableDataset) -> int:
    """Restore the optimizer, scheduler, RNG and this rank's loader position from ``checkpoint``; its step.

    The model's weights are the checkpoint's already (loaded from it). A CheckpointError names the file at fault.
    """
    loader_state = load_loader_state(checkpoint, dataset.rank)  # a missing or corrupt one is named first
    state = load_training_state(checkpoint)
    try:
        step = _restore_training_state(checkpoint, state, optimizer, scheduler)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{checkpoint / TRAINING_STATE}: not a training state of this model and optimizer "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); resume from "
                              "another checkpoint, or start a new --out") from None
    restore_loader_state(dataset, checkpoint, loader_state)
    return step


def _restore_training_state(checkpoint: Path, state: dict[str, Any], optimizer: torch.optim.Optimizer,
                            scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    optimizer.load_state_dict(state["optimizer"])
    check_optimizer_shapes(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    step = state["step"]
    saved_step = int(checkpoint.name.removeprefix(CHECKPOINT_PREFIX))
    if type(step) is not int or step != saved_step:
        raise ValueError(f"its step {step!r} is not the checkpoint's, {saved_step}")
    set_rng_state(state["rng"])
    return step


def restore_loader_state(dataset: PackedIterableDataset, checkpoint: str | os.PathLike[str],
                         state: dict[str, Any] | None = None) -> None:
    """Put ``dataset`` at the position its rank saved in ``checkpoint`` (``state``: that position, read already);
    a CheckpointError naming the file when the dataset refuses it."""
    rank = dataset.rank
    try:
        dataset.load_state_dict(load_loader_state(checkpoint, rank) if state is None else state)
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(f"{Path(checkpoint) / loader_state_name(rank)}: {err}") from None


def check_optimizer_shapes(optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless each parameter's optimizer state tensors (AdamW's moments) have the parameter's shape."""
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"the optimizer's {key} of parameter {index} has shape {tuple(value.shape)}, the "
                                 f"parameter {tuple(param.shape)}")


def rng_state() -> dict[str, Any]:
    """torch's, numpy's and Python's RNG states as tensors and plain values (what ``weights_only`` loads)."""
    numpy_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {**numpy_state, "state": {"key": numpy_state["state"]["key"].tolist(),
                                               "pos": numpy_state["state"]["pos"]}}}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states ``rng_state`` gave."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {"key": np.array(numpy_state["state"]["key"], dtype=np.uint32),
                                                  "pos": numpy_state["state"]["pos"]}})
