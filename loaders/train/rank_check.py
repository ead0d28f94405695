"""Does data-parallel training on packed batches compute one process's gradients? A check on one step.

    varpack check --model NAME_OR_DIR --shards DIR --ranks K --grad-accum G

K processes (gloo on CPU, NCCL with one GPU each) load the model and take one optimizer step's
gradients as ``scripts/train.py`` computes them: G packed micro-batches each from the build,
DDP with gradient synchronisation on the last micro-batch, every micro-batch's summed loss
divided by ``step_normalizer`` (the step's global loss tokens, or loss weight, over the world
size). Meanwhile this process takes the same examples unpacked, one at a time, read straight
from the build's shard rows, not from the loader's batches: the step's rows are the build's
first ``ranks * grad_accum * batch_rows`` in storage order. Each example is a batch of its own
tokens with positions 0..n-1; its labels are -100 where the loss mask is 0 and on its first
token; each target weighs 1 (``token``), or 1 / the example's targets over the whole build
(``sequence``). The summed losses are divided by the sum of those weights. The two must agree:
the largest relative gradient error over the parameters (``|g - g_ref| / |g_ref|`` per tensor,
NaN or infinite anywhere is a failure) and the loss difference (relative to the loss) must both
be within ``tolerance`` (default ``DEFAULT_TOLERANCE``), in float32.

The whole check has ``timeout`` seconds (``DEFAULT_TIMEOUT``): a rank still running then is
killed with the others, and the check fails in one line, as it does at once when a rank fails: one ended by SIGINT
says so (``end_on_sigint``). SIGTERM or SIGINT to the check ends its ranks too, and each rank ends the moment
the check's process is gone, however it ended (``end_with_check``).
The ranks hand their gradients back in a scratch directory named after the check's process; one that a killed
check left (a model's gradients, maybe GiBs) is removed by the next check (``remove_abandoned_scratch``).

It catches each data-parallel bug of this kind seen in other trainers (``FAULTS`` injects each,
to test the check itself): a loss averaged per rank (transformers #34191, TRL #3538) or per
micro-batch (axolotl #3196), DDP's averaging not undone, packed examples attending to each
other, position ids restarting at the wrong token (Megatron-LM #5243), and a label across an
example boundary (NeMo #14437).

``check_ranks(...)`` is the same check from Python; ``loaders.check`` is its command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from loaders.collate import IGNORE_INDEX, NUM_LOSS_TOKENS, NUM_REAL_TOKENS
from loaders.loss_weights import LOSS_WEIGHT_SUM, LOSS_WEIGHTS, LossReduction, batch_normalizer
from loaders.train.attention import attn_implementation_for
from loaders.train.distributed import finish_distributed_run, step_normalizer, world_size
from loaders.train.models import check_token_ids, load_causal_lm, model_inputs

# Largest relative gradient error and loss difference accepted, in float32: packed and one-at-a-time runs round
# differently (about 1e-6 here), while each fault moves the gradients by a share of the batches' imbalance (>1e-2).
DEFAULT_TOLERANCE = 1e-3
# Seconds the whole check may take before its ranks are killed: a tiny model takes under a minute on CPU.
DEFAULT_TIMEOUT = 600.0
# The longest --timeout taken (about 11.6 days): the process group's timeout must fit a timedelta and gloo's milliseconds.
MAX_TIMEOUT = 1e6
# Bytes the scratch directory keeps free beyond the gradients (torch.save's archive, the ranks' error lines).
SCRATCH_MARGIN = 1 << 16
# Where the ranks run: one GPU each (NCCL), the CPU (gloo), or auto: cuda when there is a GPU for every rank.
DEVICES = ("auto", "cpu", "cuda")
# Bugs the check exists to catch, injected on purpose (``fault=``) to show that it does.
FAULTS = {
    "per_rank": "each rank divides by its own loss tokens, so DDP averages per-rank means (transformers #34191)",
    "per_micro_batch": "each micro-batch divides by its own loss tokens, averaged over the window (axolotl #3196)",
    "ddp_average": "the global count, without undoing DDP's average over the ranks (gradients K times too small)",
    "cross_attention": "the row runs as one sequence, so packed examples attend to each other",
    "late_position_restart": "position ids restart one token after each example's first (Megatron-LM #5243)",
    "boundary_label": "each example's first token is a label of the last token before it (NeMo #14437)",
    "late_boundary": "every example boundary inside a row one token late, as from an off-by-one in the collator",
    "token_weights": "under --loss-reduction sequence, every target weighs 1: the per-example weights lost",
    "nan_gradient": "one parameter's gradient NaN (not the first parameter's)",
    "hung_rank": "the last rank stops before its first collective, as one stuck reading the build would",
}
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends (linux/prctl.h)
# A check's scratch directory in the temporary directory: varpack-check-<pid>-<start time>-<host>-<random>, the process
# that made it by its id and start time (a reused id has another), on the host and pid namespace <host> names.
SCRATCH_NAME = re.compile(r"^varpack-check-(\d+)-(\d+)-([0-9a-f]{8})-")


class RankCheckError(ValueError):
    """The check could not run (bad input, or a rank that failed or timed out): one line naming what to change."""


class RankCheckInterrupted(RankCheckError):
    """SIGTERM or SIGINT reached the check: its ranks were killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; its ranks were stopped")
        self.signum = signum


@dataclass(frozen=True)
class Example:
    """One example (or a chunk of a split one) as the reference trains it: tokens, targets and their weights."""

    input_ids: torch.Tensor  # int64 [n]
    targets: torch.Tensor  # int64 [n - 1]: the label of each next token, -100 where untrained
    weights: torch.Tensor  # float64 [n - 1]: 0 where targets are -100


@dataclass(frozen=True)
class RankCheck:
    """What to check: the model and build, the ranks, micro-batches and reduction, and an injected fault (tests)."""

    model: str
    shards: str
    ranks: int = 2
    grad_accum: int = 2
    batch_rows: int = 2
    attn: str = "auto"  # the attention backend trained with (loaders.train.attention.attn_implementation_for)
    loss_reduction: str = "token"
    full_logits: bool = False  # the model's own loss over every token, not the loss-position head
    device: str = "auto"  # one of DEVICES
    tolerance: float = DEFAULT_TOLERANCE
    fault: str | None = None  # a key of FAULTS
    timeout: float = DEFAULT_TIMEOUT  # seconds for the whole check

    def __post_init__(self) -> None:
        for name in ("ranks", "grad_accum", "batch_rows"):
            if getattr(self, name) < 1:
                raise RankCheckError(f"--{name.replace('_', '-')} is {getattr(self, name)}; give a positive integer")
        if not self.tolerance > 0:
            raise RankCheckError(f"--tolerance is {self.tolerance}; give a positive number")
        if not 0 < self.timeout <= MAX_TIMEOUT:
            raise RankCheckError(f"--timeout is {self.timeout:g}; give a positive number of seconds, at most "
                                 f"{MAX_TIMEOUT:g}")
        if self.device not in DEVICES:
            raise RankCheckError(f"--device is {self.device!r}; with --ranks give one of {', '.join(DEVICES)} (each "
                                 "rank takes a GPU of its own)")
        if self.loss_reduction not in tuple(LossReduction):
            raise RankCheckError(f"--loss-reduction is {self.loss_reduction!r}; give one of "
                                 f"{', '.join(r.value for r in LossReduction)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise RankCheckError(f"fault {self.fault!r} is not one of {', '.join(FAULTS)}")


@dataclass(frozen=True)
class RankReport:
    """The outcome: the step's loss both ways, the largest relative gradient error and where."""

    ok: bool
    ranks: int
    grad_accum: int
    examples: int  # examples (or pieces of split ones) in the step
    normalizer: float  # the step's global loss tokens (or loss weight)
    reduction: str  # token or sequence: what the normaliser counts
    loss: float  # the packed ranks' step loss
    reference_loss: float  # one process, one example at a time
    gradient_error: float
    parameter: str  # the parameter with the largest relative gradient error
    tolerance: float
    backend: str  # gloo or nccl

    @property
    def loss_difference(self) -> float:
        return abs(self.loss - self.reference_loss)

    @property
    def verdict(self) -> str:
        """One line: what was compared and the two figures."""
        counted = "loss tokens" if self.reduction == "token" else "examples' loss weight"
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        micro_batches = f"{self.grad_accum} micro-batch{'es' if self.grad_accum > 1 else ''}"
        measured = (f"{ranks} ({self.backend}) x {micro_batches} vs one process on the same "
                    f"{self.examples} examples one at a time ({self.normalizer:g} {counted}): largest relative gradient "
                    f"error {self.gradient_error:.3g} ({self.parameter}), loss {self.loss:.6g} vs {self.reference_loss:.6g} "
                    f"(difference {self.loss_difference:.3g}); tolerance {self.tolerance:g}")
        if self.ok:
            return f"ok: data-parallel gradients equal one process's ({measured})"
        return (f"FAILED: data-parallel gradients differ from one process's: check the loss normalisation across ranks "
                f"and micro-batches, position ids and attention over packed examples ({measured})")


def check_ranks(check: RankCheck) -> RankReport:
    """Run the check: K spawned ranks compute the step's packed gradients, this process the reference meanwhile."""
    deadline = time.monotonic() + check.timeout
    with _interruptible():
        # auto: NCCL when every rank can have a GPU of its own, else gloo on CPU.
        cuda = check.device == "cuda" or (check.device == "auto" and torch.cuda.device_count() >= check.ranks)
        if cuda and torch.cuda.device_count() < check.ranks:
            raise RankCheckError(f"--ranks {check.ranks} needs a GPU each, and {torch.cuda.device_count()} are "
                                 "visible; use fewer ranks or --device cpu")
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        # The reference model and the examples first: a bad --model, --attn or build is refused before any rank starts.
        attn_implementation_for(check.attn)
        model = load_causal_lm(check.model, "sdpa", torch.float32)  # eval mode, as the ranks': no dropout
        cast(Any, model.config).use_cache = False  # a transformers PretrainedConfig
        rank_batches(check, 0)  # every rank gets as many batches as rank 0
        examples = step_examples(check)
        check_token_ids(model, max(int(example.input_ids.max()) for example in examples), check.shards)
        with scratch_directory() as scratch:
            check_scratch_space(scratch, model)
            with running_ranks(check, "nccl" if cuda else "gloo", scratch) as wait:
                reference_loss, reference, normalizer = reference_gradients(model.to(device), examples, check.shards)
                wait(deadline)
            packed = torch.load(scratch / "gradients.pt", weights_only=True)
    errors = {name: float((packed["gradients"][name] - grad).norm() / grad.norm().clamp_min(1e-30))
              for name, grad in reference.items()}
    # NaN first: max() alone never picks a NaN error, as NaN compares False.
    parameter = max(errors, key=lambda name: (math.isnan(errors[name]), errors[name]))
    loss, error = float(packed["loss"]), errors[parameter]
    ok = (error <= check.tolerance and math.isfinite(loss) and math.isfinite(reference_loss)
          and abs(loss - reference_loss) <= check.tolerance * max(1.0, abs(reference_loss)))
    return RankReport(ok, check.ranks, check.grad_accum, len(examples), normalizer, check.loss_reduction,
                      loss, reference_loss, error, parameter, check.tolerance, "nccl" if cuda else "gloo")


def rank_batches(check: RankCheck, rank: int) -> list[dict]:
    """The first ``grad_accum`` batches of ``rank`` of ``ranks``, in the build's order (no shuffle)."""
    from loaders.dataset import PackedIterableDataset

    dataset = PackedIterableDataset(check.shards, batch_rows=check.batch_rows, shuffle=False, rank=rank,
                                    world_size=check.ranks, loss_reduction=check.loss_reduction)
    batches = [batch for _, batch in zip(range(check.grad_accum), dataset)]
    if len(batches) < check.grad_accum:
        raise RankCheckError(f"{check.shards}: rank {rank} of {check.ranks} gets {len(batches)} batches of "
                             f"{check.batch_rows} rows, fewer than --grad-accum {check.grad_accum}; use fewer ranks, "
                             "micro-batches or --batch-rows")
    return batches


def step_examples(check: RankCheck) -> list[Example]:
    """The step's examples read straight from the build's shard rows (not through the loader's batches).

    Without shuffling, global batch ``b`` is the build's rows ``b * batch_rows ...`` and rank ``r``
    takes batches ``r, r + ranks, ...``, so the step's ``ranks * grad_accum`` batches are the build's
    first ``ranks * grad_accum * batch_rows`` rows. A row with two examples of 3 and 2 tokens,
    loss mask ``[0, 1, 1, 1, 1]``, gives ``Example([a, b, c], targets=[b, c])`` and
    ``Example([d, e], targets=[e])`` (the first token of each is no target: nothing before it in the
    example predicts it); under ``sequence`` their targets weigh 1/2 and 1 when neither is split.
    """
    from loaders.dataset import BuildReader, LoaderOptions

    reader = BuildReader(check.shards, LoaderOptions(shuffle=False))
    rows = np.arange(check.ranks * check.grad_accum * check.batch_rows)
    per_example = build_example_targets(reader) if check.loss_reduction == LossReduction.SEQUENCE else None
    examples = []
    for shard, index in reader.shard_rows(rows):
        row = shard.row(index)
        cu = cast(np.ndarray, row["cu_seqlens"]).tolist()
        for (a, b), example_id in zip(zip(cu[:-1], cu[1:]), cast(np.ndarray, row["example_ids"]).tolist()):
            input_ids = torch.from_numpy(cast(np.ndarray, row["input_ids"])[a:b].astype(np.int64))
            trained = torch.from_numpy(cast(np.ndarray, row["loss_mask"])[a + 1 : b].astype(bool))
            targets = torch.where(trained, input_ids[1:], IGNORE_INDEX)
            weight = 1.0 if per_example is None else 1.0 / max(per_example[example_id], 1)
            examples.append(Example(input_ids, targets, trained.to(torch.float64) * weight))
    return examples


def build_example_targets(reader: Any) -> dict[int, int]:
    """{example id: its targets over the whole build}, the ``sequence`` reduction's count: the loss-mask tokens of
    each of its chunks, each chunk's first token left out."""
    ids, counts = [], []
    for index in range(len(reader.manifest.shards)):
        shard = reader.shard(index)
        # Each segment's start and end in the shard's tokens: a row's boundaries, shifted by where the row starts.
        row_of_bound = np.repeat(np.arange(shard.num_rows), np.diff(shard.cu_offsets))
        bounds = shard.cu_seqlens.astype(np.int64) + shard.token_offsets[row_of_bound]
        last_of_row = np.zeros(bounds.size, dtype=bool)
        last_of_row[shard.cu_offsets[1:] - 1] = True
        first_of_row = np.zeros(bounds.size, dtype=bool)
        first_of_row[shard.cu_offsets[:-1]] = True
        starts, ends = bounds[~last_of_row], bounds[~first_of_row]
        labelled = shard.loss_mask.astype(np.int64)
        labelled[starts[starts < ends]] = 0
        cumulative = np.concatenate(([0], np.cumsum(labelled)))
        ids.append(shard.example_ids.astype(np.int64))
        counts.append(cumulative[ends] - cumulative[starts])
    unique, inverse = np.unique(np.concatenate(ids), return_inverse=True)
    totals = np.bincount(inverse, weights=np.concatenate(counts)).astype(np.int64)
    return dict(zip(unique.tolist(), totals.tolist()))


@contextlib.contextmanager
def scratch_directory() -> Iterator[Path]:
    """A new directory in the temporary directory for the ranks' gradients and errors, removed when the block ends,
    named after this process (``SCRATCH_NAME``); those that killed checks left are removed first."""
    root = Path(tempfile.gettempdir())
    remove_abandoned_scratch(root)
    pid, scope = os.getpid(), host_scope()
    started = process_start(pid)
    prefix = "varpack-check-" if started is None or scope is None else f"varpack-check-{pid}-{started}-{scope}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=root) as scratch:
        yield Path(scratch)


def remove_abandoned_scratch(root: Path) -> None:
    """Remove the scratch directories in ``root`` whose check is gone (a SIGKILL runs no clean-up): only this user's
    real directories (a link is neither followed nor removed), made on this host and pid namespace by a process that
    is no longer running, or whose id another process has since taken (its start time differs)."""
    scope = host_scope()
    if scope is None or not shutil.rmtree.avoids_symlink_attacks:  # without descriptors, a swapped-in link is followed
        return
    try:
        entries = list(os.scandir(root))
    except OSError as err:  # a temporary directory that may be written but not listed
        logging.getLogger(__name__).warning("could not look for scratch directories killed checks left in %s: %s", root, err)
        return
    for entry in entries:
        match = SCRATCH_NAME.match(entry.name)
        if match is None or match[3] != scope:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # another check removed it meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if process_start(int(match[1])) == int(match[2]):
            continue
        try:
            with contextlib.suppress(FileNotFoundError):  # another check removing it at the same time
                shutil.rmtree(entry.path)
        except (OSError, RecursionError) as err:  # RecursionError: a tree deeper than rmtree's recursion
            logging.getLogger(__name__).warning("could not remove %s, left by a check that was killed: %s",
                                                entry.path, err)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat``), or None when it is not running
    (gone, or a zombie) or there is no ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def host_scope() -> str | None:
    """8 hex digits naming this boot of this host and this process's pid and time namespaces: process ids and start
    times mean nothing beyond them (a temporary directory shared by containers or over NFS; a start time read in
    another time namespace is shifted); None without a ``/proc`` of this process's own pid namespace (one that shows
    the host's processes would give another process's start time for this pid)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        scope = Path("/proc/sys/kernel/random/boot_id").read_text().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    with contextlib.suppress(FileNotFoundError):  # a kernel without time namespaces has one clock for all
        scope += os.readlink("/proc/self/ns/time")
    return hashlib.sha256(scope.encode()).hexdigest()[:8]


def check_scratch_space(scratch: Path, model: torch.nn.Module) -> None:
    """Refuse a scratch directory without room for ``model``'s gradients in float32, which rank 0 writes there."""
    needed = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 + SCRATCH_MARGIN
    free = shutil.disk_usage(scratch).free
    if free < needed:
        raise RankCheckError(f"no space in the scratch directory {scratch} for the ranks' gradients ({needed:,} bytes, "
                             f"{free:,} free); set TMPDIR to a directory with room")


def free_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise RankCheckInterrupted within (from the main thread), so the ranks are stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise RankCheckInterrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def running_ranks(check: RankCheck, backend: str, scratch: Path) -> Iterator[Any]:
    """Start the ranks; yields ``wait(deadline)``, which waits for them until ``deadline`` (``time.monotonic()``).

    A rank's failure is a RankCheckError of its one line, and so is a rank still running at the
    deadline. However the block ends, no rank outlives it: those still running are killed."""
    port = free_port()
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # the ranks left waiting on a failed one are ended with a warning line each
    # The ranks start with SIGINT blocked (they inherit this thread's signal mask): one sent while a rank still imports
    # waits for end_on_sigint instead of printing a KeyboardInterrupt traceback. The spawn start method's resource
    # tracker is started first: starting it unblocks SIGINT in the thread that starts it.
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        context = mp.start_processes(_rank, args=(check, backend, port, str(scratch), os.getpid()), nprocs=check.ranks,
                                     join=False, start_method="spawn")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert context is not None  # join=False returns the processes' context

    def wait(deadline: float) -> None:
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    hung = [str(rank) for rank, process in enumerate(context.processes) if process.is_alive()]
                    raise RankCheckError(
                        f"rank{'s' if len(hung) > 1 else ''} {', '.join(hung)} of {check.ranks} still running at "
                        f"--timeout {check.timeout:g} s (one stuck, say reading the build, and the others waiting "
                        "for it in a collective); every rank was killed")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            # The rank that failed first says why; the others' lines (a peer gone) follow from it.
            paths = [scratch / f"error-rank{err.error_index}.txt"] + sorted(scratch.glob("error-rank*.txt"))
            said = [line for path in paths if path.exists() and (line := path.read_text().strip())]
            if said:
                raise RankCheckError(said[0]) from None
            if shutil.disk_usage(scratch).free < SCRATCH_MARGIN:  # filled meanwhile: the rank could not say why
                raise RankCheckError(f"rank {err.error_index} failed: no space left in the scratch directory {scratch}; "
                                     "set TMPDIR to a directory with room") from None
            raise RankCheckError((str(err).strip().splitlines() or [type(err).__name__])[-1]) from None

    try:
        yield wait
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join()
        spawn_log.setLevel(level)


def end_with_check(check_pid: int) -> None:
    """End this rank the moment the check's process ``check_pid`` is gone, however it ended: a SIGKILL (the OOM
    killer, ``kill -9``, a scheduler's hard stop) runs no handler of the check, and a rank left behind would keep
    its memory and wait in a collective until the process group's timeout, or forever.

    On Linux the kernel sends the rank SIGKILL when the check ends (``PR_SET_PDEATHSIG``; torch's spawn asks for
    SIGINT, which a rank blocked in a collective never acts on). Elsewhere a thread waits on the pipe from the
    check and ends the rank when it closes, which a rank holding the GIL in a native call delays. A check already
    gone before either is in place ends the rank here.
    """
    if not _killed_with_parent():
        parent = multiprocessing.parent_process()
        if parent is not None:
            sentinel = parent.sentinel

            def watch() -> None:
                multiprocessing.connection.wait([sentinel])
                os._exit(1)

            threading.Thread(target=watch, name="varpack-check-watch", daemon=True).start()
    if os.getppid() != check_pid:
        os._exit(1)


def end_on_sigint(rank: int, scratch: str) -> None:
    """End this rank on SIGINT with status 130, writing "rank N ended by SIGINT" for the check, whatever the rank is
    doing: torch's spawn wrapper would take a KeyboardInterrupt for its parent's stop and exit 0, which the check
    would count as a rank done, and a Python handler runs only when the main thread returns to the interpreter,
    never while it waits in a collective. So every thread blocks SIGINT (the rank started so, and its threads inherit
    the mask), and one thread waits for it: one sent while the rank was starting up was kept pending until now."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def wait() -> None:
        signum = signal.sigwait({signal.SIGINT})
        say_why(rank, scratch, f"rank {rank} ended by {signal.Signals(signum).name}")
        os._exit(128 + signum)

    threading.Thread(target=wait, name="varpack-check-sigint", daemon=True).start()


def _killed_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent ends; False where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _rank(rank: int, check: RankCheck, backend: str, port: int, scratch: str, check_pid: int) -> None:
    """One rank: its step's packed gradients; rank 0 saves them with the step's loss. A failure is written as one line.
    It ends when the check's process ``check_pid`` does, and on SIGINT with status 130, saying so."""
    end_with_check(check_pid)
    end_on_sigint(rank, scratch)
    try:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # the parent prints one line; and tqdm's lock would outlive os._exit as a leaked semaphore
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // check.ranks))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=check.ranks,
                                timeout=timedelta(seconds=check.timeout))
        loss, gradients = packed_gradients(check, rank, device)
        if rank == 0:
            torch.save({"loss": loss, "gradients": gradients}, Path(scratch) / "gradients.pt")
    except (ValueError, RuntimeError, OSError) as err:
        say_why(rank, scratch, f"rank {rank}: {str(err).strip().splitlines()[0]}")
        sys.stderr.flush()
        os._exit(1)
    finish_distributed_run()


def say_why(rank: int, scratch: str, line: str) -> None:
    """Leave ``line``, why this rank ends, for the check; in a full scratch directory the check finds that itself."""
    with contextlib.suppress(OSError):
        Path(scratch, f"error-rank{rank}.txt").write_text(line + "\n")


def packed_gradients(check: RankCheck, rank: int, device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    """This rank's share of the step, trained as ``scripts/train.py`` does: (the step's loss over all ranks, gradients)."""
    from loaders.train.loss_head import use_loss_position_head

    model = load_causal_lm(check.model, attn_implementation_for(check.attn), torch.float32).to(device)
    cast(Any, model.config).use_cache = False  # a transformers PretrainedConfig
    if not check.full_logits:
        use_loss_position_head(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if check.fault == "hung_rank" and rank == check.ranks - 1:
        time.sleep(10 * check.timeout)
    source = late_boundary_batches if check.fault == "late_boundary" else rank_batches
    batches = [inject(check.fault, batch) for batch in source(check, rank)]
    normalizers = micro_batch_normalizers(check.fault, [batch_normalizer(b) for b in batches], device)
    step_loss = torch.zeros((), device=device)
    for i, (batch, normalizer) in enumerate(zip(batches, normalizers)):
        sync = ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
        with sync:
            inputs = model_inputs(batch, device, check.full_logits)
            if check.full_logits and LOSS_WEIGHTS in inputs:
                from loaders.train.loss import weighted_causal_lm_loss

                logits = ddp(**{k: v for k, v in inputs.items() if k not in ("labels", LOSS_WEIGHTS, LOSS_WEIGHT_SUM)}).logits
                loss = weighted_causal_lm_loss(logits, inputs["labels"], inputs[LOSS_WEIGHTS], normalizer)
            else:
                loss = ddp(**inputs, num_items_in_batch=normalizer).loss
            loss.backward()
        step_loss += loss.detach()
    dist.all_reduce(step_loss)  # as train.py logs it: each rank's share summed, over the ranks
    gradients = {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}
    if check.fault == "nan_gradient":
        name = list(gradients)[len(gradients) // 2]
        gradients[name] = torch.full_like(gradients[name], math.nan)
    return float(step_loss / world_size()), gradients


def late_boundary_batches(check: RankCheck, rank: int) -> list[dict]:
    """``rank_batches`` collated from rows whose interior example boundaries are each one token late (a fault)."""
    from loaders.collate import collate_rows
    from loaders.dataset import BuildReader, LoaderOptions

    def late(shard: Any) -> Any:
        interior = np.ones(shard.cu_seqlens.size, dtype=np.int32)
        interior[shard.cu_offsets[:-1]] = interior[shard.cu_offsets[1:] - 1] = 0
        return dataclasses.replace(shard, cu_seqlens=shard.cu_seqlens + interior)

    reader = BuildReader(check.shards, LoaderOptions(shuffle=False))
    batches = []
    for j in range(check.grad_accum):
        first = (rank + j * check.ranks) * check.batch_rows
        rows = reader.shard_rows(np.arange(first, first + check.batch_rows))
        batches.append(collate_rows([(late(shard), row) for shard, row in rows]))
    return batches


def micro_batch_normalizers(fault: str | None, counts: list[float], device: torch.device) -> list[torch.Tensor]:
    """What each micro-batch divides its summed loss by: ``step_normalizer``, or an injected fault's."""
    if fault == "per_rank":
        return [torch.tensor(sum(counts), device=device)] * len(counts)
    if fault == "per_micro_batch":
        return [torch.tensor(count * len(counts), device=device) for count in counts]
    if fault == "ddp_average":
        return [step_normalizer(sum(counts), device) * world_size()] * len(counts)
    return [step_normalizer(sum(counts), device)] * len(counts)


def inject(fault: str | None, batch: dict) -> dict:
    """``batch`` with an injected fault of its inputs (``cross_attention``, ``late_position_restart``,
    ``boundary_label``, ``token_weights``); as it is otherwise."""
    if fault == "cross_attention":
        tokens = batch["input_ids"].shape[1]
        return {**{k: v for k, v in batch.items() if k not in BOUNDARY_KEYS},
                "position_ids": torch.arange(tokens).unsqueeze(0)}
    if fault == "late_position_restart":
        return {**batch, "position_ids": torch.cat([batch["position_ids"][:, :1], batch["position_ids"][:, :-1]], 1)}
    if fault == "token_weights" and LOSS_WEIGHTS in batch:
        weights = (batch["labels"] != IGNORE_INDEX).to(torch.float32)
        return {**batch, LOSS_WEIGHTS: weights, LOSS_WEIGHT_SUM: float(batch[NUM_LOSS_TOKENS])}
    if fault == "boundary_label":
        starts = torch.tensor(_sequences(batch))[1:, 0]
        labels, unlabelled = batch["labels"].clone(), batch["labels"][0, starts] == IGNORE_INDEX
        starts = starts[unlabelled]
        labels[0, starts] = batch["input_ids"][0, starts]
        changed = {"labels": labels, NUM_LOSS_TOKENS: batch[NUM_LOSS_TOKENS] + int(starts.numel())}
        if LOSS_WEIGHTS in batch:
            weights = batch[LOSS_WEIGHTS].clone()
            weights[0, starts] = weights[0, starts - 1]
            changed.update({LOSS_WEIGHTS: weights, LOSS_WEIGHT_SUM: float(weights.double().sum())})
        return {**batch, **changed}
    return batch


def _sequences(batch: dict) -> list[tuple[int, int]]:
    """The (start, end) of each data sequence of ``batch`` (pad sequences and empty entries left out)."""
    cu = batch["cu_seq_lens_q"].tolist()
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if a < b <= batch[NUM_REAL_TOKENS]]


def reference_gradients(model: torch.nn.Module, examples: list[Example], source: str
                        ) -> tuple[float, dict[str, torch.Tensor], float]:
    """``model`` over the step's examples in one process, one at a time, unpadded, positions 0..n-1: (the step's
    loss, gradients, the step's global loss tokens or weight: the sum of the examples' weights)."""
    device = next(model.parameters()).device
    normalizer = float(sum(example.weights.sum() for example in examples))
    if normalizer == 0:
        raise RankCheckError(f"{source}: the step's batches hold no trained token; use more --batch-rows")
    step_loss = 0.0
    for example in examples:
        if not example.weights.any():
            continue
        positions = torch.arange(example.input_ids.numel(), device=device).unsqueeze(0)
        logits = model(input_ids=example.input_ids.unsqueeze(0).to(device), position_ids=positions).logits[0, :-1]
        terms = F.cross_entropy(logits.float(), example.targets.to(device), ignore_index=IGNORE_INDEX, reduction="none")
        loss = (terms * example.weights.to(device, torch.float32)).sum() / normalizer
        loss.backward()
        step_loss += loss.item()
    gradients = {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return step_loss, gradients, normalizer
