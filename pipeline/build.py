"""One build from start to end: resolve inputs, fingerprint them, reuse a finished build or run Beam.

The output goes to ``OUT/<dataset>-<fingerprint>/``. A directory with a manifest of that
fingerprint and all its shards, each matching its size and checksum, is reused without
reading or tokenizing anything; one that fails the check is rebuilt. One without a manifest
holds the leftovers of an interrupted run: they are removed and the build runs again. A
reused build is left as clean as a fresh one: temporary files and spill directories of runs
killed after its manifest appeared are removed too. A failed run removes what it wrote, but
never a finished build (one with a manifest).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline import storage
from pipeline.build_plan import BuildPlan
from pipeline.config import PackConfig
from pipeline.encode.bad_rows import REJECTED_NAME
from pipeline.encode.chat_templates import resolve_chat_template
from pipeline.encode.examples import Encoder
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.errors import ConfigError, InputError, OutputDirError
from pipeline.packing import spill
from pipeline.read.formats import resolve_format
from pipeline.read.sources import resolve_source
from pipeline.write.lock import build_lock
from schemas import MANIFEST_NAME, Manifest, ManifestError, compute_fingerprint, read_manifest, stream_sha256
from schemas.io import temporary_target
from schemas.shard_identity import file_identity_problem
from schemas.verified import VerifiedShards

# The files a build writes: shards, the rejected rows, the manifest and the report figure.
_BUILD_FILE = re.compile(r"^(shard-\d+\.arrow|manifest\.json|rejected\.jsonl|report\.png)$")
# At a URL each run writes its shards into its own attempt directory inside the build's.
ATTEMPT_PREFIX = "attempt-"


@dataclass(frozen=True)
class BuildResult:
    """A finished build: its manifest, its directory, whether it was reused, and the command's wall time."""

    manifest: Manifest
    out_dir: str
    reused: bool
    elapsed_s: float
    layout: str = ""  # how each example is laid out, for the report
    figure: str | None = None  # the report figure this run wrote


# Writes the report figure of a build beside its manifest (pack's report.png): its path, or None when
# it was not written (the writer says why).
FigureWriter = Callable[[str, Manifest], "str | None"]


def _is_build_file(name: str) -> bool:
    """Whether a build writes a file of this name, or its temporary while writing it."""
    return _BUILD_FILE.match(temporary_target(name) or name) is not None


def package_version() -> str:
    try:
        return importlib.metadata.version("varpack")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def plan_build(config: PackConfig) -> BuildPlan:
    """Resolve the dataset and tokenizer and compute the fingerprint; reads the data's bytes once to hash them."""
    config.validate()
    source = resolve_source(config)
    if source.known_examples == 0:
        raise InputError(f"{config.dataset}: holds no examples")
    tokenizer = load_tokenizer(config.tokenizer, config.bos_token, config.eos_token, config.special_tokens)
    example_format = resolve_format(
        config, source.columns, config.dataset, source.default_format,
        resolve_chat_template(config.chat_template, tokenizer.chat_template),
    )
    if not example_format.is_chat and not tokenizer.suffix_ids:
        raise ConfigError(
            f"tokenizer {tokenizer.name} has no known EOS token, so examples would not end with one and the model "
            "would not learn to stop; pass --eos-token TOKEN (e.g. --eos-token '</s>' or '<|endoftext|>'), or add one "
            "with --special-tokens '<|endoftext|>'"
        )
    tokenizer_inputs = tokenizer.inputs()
    if example_format.is_chat:
        # What the data ends turns with, which may not be the tokenizer's EOS (Llama 3: <|eot_id|>).
        end = Encoder(tokenizer, example_format, config.max_len, config.overflow).chat_end_token()
        tokenizer_inputs = dataclasses.replace(tokenizer_inputs, eos_token_id=end)
    inputs = config.build_inputs(
        source.inputs, tokenizer_inputs, example_format.template, example_format.loss_masking, package_version()
    )
    fingerprint = compute_fingerprint(inputs)
    out_dir = storage.join(config.out, f"{source.name}-{fingerprint}")
    return BuildPlan(config, source, tokenizer, example_format, inputs, fingerprint, out_dir)


def read_build_manifest(out_dir: str) -> Manifest:
    """The validated manifest of the build in ``out_dir``, local or at a URL."""
    return read_manifest(storage.join(out_dir, MANIFEST_NAME), storage.read_bytes)


def reuse_problem(manifest: Manifest, out_dir: str) -> str | None:
    """Why a finished build cannot be reused (a file missing, truncated, failing its checksum, or not
    the shard of this build its place in the manifest says: ``schemas/shard_identity.py``), or None.

    A local build's shards are hashed once per host (``schemas/verified.py``): a shard this host
    hashed whole before, and that is still the same file, is not hashed again.
    """
    if manifest.rejected is not None and manifest.rejected.rows and not storage.exists(storage.join(out_dir, REJECTED_NAME)):
        return f"{REJECTED_NAME} is missing"
    record = None if storage.is_url(out_dir) else VerifiedShards(manifest)
    with record or contextlib.nullcontext():
        for index, shard in enumerate(manifest.shards):
            path = storage.join(out_dir, shard.path)
            if not storage.exists(path):
                return f"{shard.path} is missing"
            if (size := storage.size(path)) != shard.bytes:
                return f"{shard.path} is {size} bytes, the manifest says {shard.bytes}"
            if record is None or not record.unchanged(Path(path)):
                with storage.open_read(path) as f:
                    if stream_sha256(f) != shard.sha256:
                        return f"{shard.path} fails its checksum (the file is corrupt)"
                if record is not None:
                    record.add(Path(path))
            with storage.open_read(path) as f:
                if (problem := file_identity_problem(f, manifest, index)) is not None:
                    return f"{shard.path} {problem}"
    return None


def _build_files(plan: BuildPlan) -> list[str]:
    """The names of the files in the build directory.

    Raises OutputDirError when ``--out`` is itself a build directory, or when the build
    directory holds files varpack did not write.
    """
    out, out_dir = plan.config.out, plan.out_dir
    if storage.exists(storage.join(out, MANIFEST_NAME)):
        raise OutputDirError(f"--out {out} is itself a shard directory (it holds {MANIFEST_NAME}); pass its parent directory")
    names = storage.list_files(out_dir)
    subdirs = [d for d in storage.list_subdirs(out_dir) if not d.startswith(spill.SPILL_PREFIX)]
    foreign = [n for n in names if not _is_build_file(n)] + [f"{d}/" for d in subdirs]
    if foreign:
        raise OutputDirError(
            f"{out_dir} holds files varpack did not write ({', '.join(foreign[:3])}); move them away and run again"
        )
    return names


def reusable(plan: BuildPlan) -> Manifest | None:
    """The manifest of a finished build of ``plan`` whose every file checks out, or None; only reads."""
    if MANIFEST_NAME not in _build_files(plan):
        return None
    try:
        manifest = read_build_manifest(plan.out_dir)
    except ManifestError:
        return None
    if manifest.fingerprint != plan.fingerprint or reuse_problem(manifest, plan.out_dir) is not None:
        return None
    return manifest


def check_output(plan: BuildPlan, log: Callable[[str], None]) -> Manifest | None:
    """The manifest of a finished build to reuse, or None after clearing the way for a new build.

    A local build directory is only ever checked, and cleared, by the run holding its lock.
    Reuse verifies every shard's size and checksum, and removes what killed runs left beside
    the build; a build that fails is rebuilt. Raises
    OutputDirError when ``--out`` is itself a build directory, when the build directory holds
    another fingerprint's build (without ``--force``) or files varpack did not write.
    """
    out_dir, force = plan.out_dir, plan.config.force
    local = not storage.is_url(out_dir)
    names = _build_files(plan)
    problem = None
    if MANIFEST_NAME in names:
        try:
            manifest = read_build_manifest(out_dir)
        except ManifestError as err:
            problem = f"its manifest is unreadable ({err})"
        else:
            if manifest.fingerprint != plan.fingerprint and not force:
                raise OutputDirError(
                    f"{out_dir} holds the shards of another build (fingerprint {manifest.fingerprint}, expected "
                    f"{plan.fingerprint}); move it away, or pass --force to replace it"
                )
            if force and manifest.fingerprint == plan.fingerprint and local:
                # Same inputs, same bytes: each shard is replaced by a rename, so a loader reading it meanwhile goes on.
                log(f"--force: rebuilding {out_dir} in place")
                _remove_leftovers(out_dir)
                return None
            problem = "--force" if force else reuse_problem(manifest, out_dir)
            if problem is None:
                if local:
                    _remove_leftovers(out_dir, log)
                return manifest
        if not local and not force:
            raise OutputDirError(f"{out_dir} cannot be reused: {problem}; pass --force to build it again")
        log(f"rebuilding {out_dir}: {problem}")
    elif names and local:
        log(f"removing {len(names)} leftover files of an interrupted run from {out_dir}")
    if local:
        _remove_leftovers(out_dir)
        clear_build(out_dir)
    elif problem is not None:
        # No lock at a URL: only the manifest goes, so the next manifest published wins; attempts stay.
        storage.remove([storage.join(out_dir, MANIFEST_NAME)])
    return None


def clear_build(out_dir: str) -> None:
    """Remove the files of a build (the manifest first, so no manifest ever points at missing shards)."""
    names = [n for n in storage.list_files(out_dir) if _is_build_file(n)]
    names.sort(key=lambda n: n != MANIFEST_NAME)
    storage.remove([storage.join(out_dir, n) for n in names])


def _leftovers(out_dir: str) -> list[str]:
    """The names of the temporary files and spill directories that runs killed in the middle left in a local build directory."""
    spills = [d for d in storage.list_subdirs(out_dir) if d.startswith(spill.SPILL_PREFIX)]
    return [n for n in storage.list_files(out_dir) if temporary_target(n) is not None] + spills


def _remove_leftovers(out_dir: str, log: Callable[[str], None] | None = None) -> None:
    """Remove ``_leftovers(out_dir)``; only while holding the build's lock alone, so no live run's files go."""
    found = _leftovers(out_dir)
    if found and log is not None:
        log(f"removing {len(found)} leftover files of interrupted runs from {out_dir}")
    for name in found:
        path = storage.join(out_dir, name)
        if name.startswith(spill.SPILL_PREFIX):
            spill.remove_spill(path)
        else:
            storage.remove([path])


def _discard(out_dir: str, shard_dir: str) -> None:
    """Remove what a failed run wrote, never a finished build: with a manifest present, only temporaries."""
    if shard_dir != out_dir:
        storage.remove([storage.join(shard_dir, n) for n in storage.list_files(shard_dir)])
    elif storage.exists(storage.join(out_dir, MANIFEST_NAME)):
        _remove_leftovers(out_dir)
    else:
        clear_build(out_dir)
        storage.remove_empty_dir(out_dir)


def _log_to_stderr(message: str) -> None:
    print(f"varpack: {message}", file=sys.stderr)


def build(
    config: PackConfig, log: Callable[[str], None] = _log_to_stderr, write_figure: FigureWriter | None = None
) -> BuildResult:
    """Make (or reuse) the shards ``config`` describes and return the manifest.

    A local build runs holding the build directory's lock (``build_lock.py``): a second run
    of the same build waits, then reuses what the first made. Checking a finished build for
    reuse shares the lock with other runs doing the same. At a URL every run writes into
    its own attempt directory and the first manifest published wins. ``write_figure`` writes
    the report figure of a new build, or of a reused one that lacks it, holding the lock alone
    (so that no run removing leftovers meanwhile takes its temporary file).
    """
    started = time.perf_counter()
    plan = plan_build(config)
    for note in plan.source.notes + plan.tokenizer.notes:
        log(note)
    local = not storage.is_url(plan.out_dir)
    if local and not config.force:
        # First only read, sharing the lock with other runs that read: the nodes of a job check a build side by side.
        with build_lock(plan.out_dir, config.lock_timeout, log, shared=True):
            existing = reusable(plan)
            if existing is not None and not _needs_lock_alone(plan, write_figure):
                elapsed_s = time.perf_counter() - started
                figure = _missing_figure(plan, existing, write_figure)  # in a read-only place: says it cannot
                return BuildResult(existing, plan.out_dir, True, elapsed_s, _layout(plan), figure)
        # A build to make, or one to reuse that needs tidying: the lock alone, then check again.
    with build_lock(plan.out_dir, config.lock_timeout, log) if local else contextlib.nullcontext():
        existing = check_output(plan, log)
        if existing is not None:
            elapsed_s = time.perf_counter() - started
            figure = _missing_figure(plan, existing, write_figure)
            return BuildResult(existing, plan.out_dir, True, elapsed_s, _layout(plan), figure)
        shard_dir = plan.out_dir if local else storage.join(plan.out_dir, ATTEMPT_PREFIX + uuid.uuid4().hex[:12])
        _run(plan, shard_dir, log)
        manifest = read_build_manifest(plan.out_dir)
        if local:
            _remove_leftovers(plan.out_dir)  # of workers of a killed run that were still writing when it ended
        elapsed_s = time.perf_counter() - started
        figure = write_figure(plan.out_dir, manifest) if write_figure is not None else None
    if not any(storage.join(plan.out_dir, shard.path).startswith(shard_dir) for shard in manifest.shards):
        log(f"another run published {plan.out_dir} first; using its build")
        _discard(plan.out_dir, shard_dir)
    return BuildResult(manifest, plan.out_dir, False, elapsed_s, _layout(plan), figure)


def _has_figure(out_dir: str) -> bool:
    """Whether the build holds its report figure (one made with --no-report, or without matplotlib, does not)."""
    from pipeline.report.figures import REPORT_NAME

    return storage.exists(storage.join(out_dir, REPORT_NAME))


def _missing_figure(plan: BuildPlan, manifest: Manifest, write_figure: FigureWriter | None) -> str | None:
    """Write the report figure of a reused build that lacks it; its path, or None."""
    if write_figure is None or _has_figure(plan.out_dir):
        return None
    return write_figure(plan.out_dir, manifest)


def _needs_lock_alone(plan: BuildPlan, write_figure: FigureWriter | None) -> bool:
    """Whether reusing the build means writing in its directory: removing what killed runs left, or writing
    its missing figure. Not in a place this run cannot write to, where neither can happen."""
    if not os.access(plan.config.out, os.W_OK) or not os.access(plan.out_dir, os.W_OK):
        return False
    return bool(_leftovers(plan.out_dir)) or (write_figure is not None and not _has_figure(plan.out_dir))


def _run(plan: BuildPlan, shard_dir: str, log: Callable[[str], None]) -> None:
    """Run the Beam pipeline of ``plan``, writing shards into ``shard_dir``; on failure remove what it wrote."""
    from pipeline import beam_pipeline
    from pipeline.report import progress

    config = plan.config
    spill_dir = spill.new_spill_dir(plan.out_dir, _temp_location(config.beam_args))
    storage.make_dirs(plan.out_dir)
    log(f"packing {config.dataset} into {plan.out_dir}")
    if config.progress:
        progress.enable()
    try:
        beam_pipeline.run(plan, shard_dir, spill_dir)
    except BaseException:
        spill.remove_spill(spill_dir)
        _discard(plan.out_dir, shard_dir)
        raise
    finally:
        spill.remove_spill(spill_dir)
        progress.close()


def _temp_location(beam_args: tuple[str, ...]) -> str | None:
    """Beam's ``--temp_location``, where a cluster's workers spill, or None to spill inside the build directory."""
    if not any(arg.startswith("--temp_location") for arg in beam_args):
        return None
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    return PipelineOptions(list(beam_args)).view_as(GoogleCloudOptions).temp_location


def _layout(plan: BuildPlan) -> str:
    """How each example is laid out and which special tokens go around it."""
    if plan.example_format.is_chat:
        end = plan.inputs.tokenizer.eos_token_id
        return f"{plan.example_format.describe()} (turns end with {plan.tokenizer.backend().id_to_token(end)} ({end}))"
    return f"{plan.example_format.describe()} ({plan.tokenizer.describe_affixes()})"
