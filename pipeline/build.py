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
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import storage
from pipeline.build_plan import BuildPlan
from pipeline.config import PackConfig
from pipeline.encode.chat_templates import resolve_chat_template
from pipeline.encode.examples import Encoder
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.encode.bad_rows import DROPPED_WHOLE, REJECTED_NAME, bound_exceeded
from pipeline.errors import ConfigError, InputError, NothingKeptError
from pipeline.packing import spill
from pipeline.read.formats import resolve_format
from pipeline.read.inputs import InputsRead
from pipeline.read.sources import resolve_source
from pipeline.report.summary import reuse_token_check_error, unused_input_warnings
from pipeline.write.build_dir import (
    ATTEMPT_PREFIX,
    check_output,
    discard,
    has_figure,
    needs_lock_alone,
    read_build_manifest,
    remove_leftovers,
    reusable,
)
from pipeline.write.lock import build_lock
from schemas import Manifest, VarpackError, compute_fingerprint


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


def package_version() -> str:
    try:
        return importlib.metadata.version("varpack")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def plan_build(config: PackConfig) -> BuildPlan:
    """Resolve the dataset and tokenizer and compute the fingerprint; reads the data's bytes once to hash them."""
    config.validate()
    storage.check_bucket(config.out, "--out")
    source = resolve_source(config)
    if source.known_examples == 0:
        raise InputError(f"{config.dataset}: holds no examples")
    tokenizer = load_tokenizer(config.tokenizer, config.bos_token, config.eos_token, config.special_tokens)
    example_format = resolve_format(
        config, source.columns, config.dataset, source.default_format,
        resolve_chat_template(config.chat_template, tokenizer.chat_template),
    )
    config = dataclasses.replace(config, overflow=config.resolved_overflow(example_format.is_chat))
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
        source.inputs, tokenizer_inputs, example_format.template, example_format.loss_masking, package_version(),
        known_rows=source.known_examples,
    )
    fingerprint = compute_fingerprint(inputs)
    out_dir = storage.join(config.out, f"{source.name}-{fingerprint}")
    read = InputsRead.of(source, example_format)
    return BuildPlan(config, source, tokenizer, example_format, inputs, fingerprint, out_dir, read)


def _log_to_stderr(message: str) -> None:
    print(f"varpack: {message}", file=sys.stderr)


def build(
    config: PackConfig, log: Callable[[str], None] = _log_to_stderr, write_figure: FigureWriter | None = None
) -> BuildResult:
    """Make (or reuse) the shards ``config`` describes and return the manifest.

    A local build runs holding the build directory's lock (``pipeline/write/lock.py``): a second run
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
    plan.inputs_read.check(config.strict)
    for line in plan.inputs_read.warnings():
        log(f"warning: {line}")
    local = not storage.is_url(plan.out_dir)
    if local and not config.force:
        # First only read, sharing the lock with other runs that read: the nodes of a job check a build side by side.
        with build_lock(plan.out_dir, config.lock_timeout, log, shared=True):
            existing = reusable(plan)
            if existing is not None and not needs_lock_alone(plan, write_figure is not None):
                _check_reused(existing, plan.out_dir, config, log)
                elapsed_s = time.perf_counter() - started
                figure = _missing_figure(plan, existing, write_figure)  # in a read-only place: says it cannot
                return BuildResult(existing, plan.out_dir, True, elapsed_s, _layout(plan), figure)
        # A build to make, or one to reuse that needs tidying: the lock alone, then check again.
    with build_lock(plan.out_dir, config.lock_timeout, log) if local else contextlib.nullcontext():
        existing = check_output(plan, log)
        if existing is not None:
            _check_reused(existing, plan.out_dir, config, log)
            elapsed_s = time.perf_counter() - started
            figure = _missing_figure(plan, existing, write_figure)
            return BuildResult(existing, plan.out_dir, True, elapsed_s, _layout(plan), figure)
        shard_dir = plan.out_dir if local else storage.join(plan.out_dir, ATTEMPT_PREFIX + uuid.uuid4().hex[:12])
        _run(plan, shard_dir, log)
        manifest = read_build_manifest(plan.out_dir)
        if local:
            remove_leftovers(plan.out_dir)  # of workers of a killed run that were still writing when it ended
        elapsed_s = time.perf_counter() - started
        figure = write_figure(plan.out_dir, manifest) if write_figure is not None else None
        for warning in unused_input_warnings(manifest.stats):
            log(warning)
    lost = not any(storage.join(plan.out_dir, shard.path).startswith(shard_dir) for shard in manifest.shards)
    if lost:
        log(f"another run published {plan.out_dir} first; using its build")
        discard(plan.out_dir, shard_dir)
    return BuildResult(manifest, plan.out_dir, lost, elapsed_s, _layout(plan), figure)


def _check_reused(manifest: Manifest, out_dir: str, config: PackConfig, log: Callable[[str], None]) -> None:
    """The warnings of a reused build, from the figures its manifest records; under ``--strict`` the first
    is an error, as it is in a fresh run (``--strict`` does not change the build, so it is not fingerprinted).
    A build whose check of its tokens falls short of this run's ``--verify-tokens`` or ``--on-token-mismatch``
    is refused, not reused as if checked."""
    refusal = reuse_token_check_error(manifest.stats, config.verify_tokens, config.on_token_mismatch)
    if refusal is not None:
        raise InputError(f"{out_dir}: {refusal}")
    # --max-bad-rows is this run's bound, not the build's (not fingerprinted): the build's bad rows are held to it as a
    # fresh run's would be. num_example_ids counts the source rows read (format 5 on).
    rejected = manifest.rejected
    bad = 0 if rejected is None else sum(n for reason, n in rejected.by_reason.items() if reason not in DROPPED_WHOLE)
    rows = manifest.stats.num_example_ids
    if bad and (rows or isinstance(config.max_bad_rows, int)) and bound_exceeded(bad, rows, config.max_bad_rows):
        raise InputError(f"{out_dir}: the build to reuse left out {bad:,} bad rows of {rows:,} read, more than "
                         f"--max-bad-rows {config.max_bad_rows} (listed in {storage.join(out_dir, REJECTED_NAME)}); "
                         "fix the dataset, or raise --max-bad-rows")
    lines = unused_input_warnings(manifest.stats)
    if config.strict and lines:
        raise InputError(f"{lines[0].removeprefix('warning: ')} (--strict; the build was reused)")
    for line in lines:
        log(line)


def _missing_figure(plan: BuildPlan, manifest: Manifest, write_figure: FigureWriter | None) -> str | None:
    """Write the report figure of a reused build that lacks it; its path, or None."""
    if write_figure is None or has_figure(plan.out_dir):
        return None
    return write_figure(plan.out_dir, manifest)


def _run(plan: BuildPlan, shard_dir: str, log: Callable[[str], None]) -> None:
    """Run the Beam pipeline of ``plan``, writing shards into ``shard_dir``; on failure remove what it wrote."""
    from pipeline import beam_pipeline
    from pipeline.report import progress

    config = plan.config
    # At a URL, inside the run's attempt directory: all a killed run leaves there is under one prefix.
    spill_dir = spill.new_spill_dir(shard_dir, _temp_location(config.beam_args))
    storage.make_dirs(plan.out_dir)
    log(f"packing {config.dataset} into {plan.out_dir}")
    # An earlier run's list of rejected rows, kept by check_output: a failure of this run leaves it, or its own.
    listed = storage.exists(storage.join(plan.out_dir, REJECTED_NAME))
    if config.progress:
        progress.enable()
    try:
        beam_pipeline.run(plan, shard_dir, spill_dir)
    except BaseException as err:
        spill.remove_spill(spill_dir)
        # A build of bad rows only keeps the list of them, which its error points to.
        nothing_kept = isinstance(VarpackError.behind(err), NothingKeptError)
        discard(plan.out_dir, shard_dir, (REJECTED_NAME,) if nothing_kept or listed else ())
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
