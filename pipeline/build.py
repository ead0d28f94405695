"""One build from start to end: resolve inputs, fingerprint them, reuse a finished build or run Beam.

The output goes to ``OUT/<dataset>-<fingerprint>/``. A directory with a manifest of that
fingerprint and all its shards is reused without reading or tokenizing anything. One without
a manifest holds the leftovers of an interrupted run: they are removed and the build runs
again. A failed run removes what it wrote, so no manifest (and no partial shard) is left.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline import spill, storage
from pipeline.bad_rows import REJECTED_NAME
from pipeline.config import PackConfig
from pipeline.errors import ConfigError, InputError, OutputDirError
from pipeline.formats import ExampleFormat, resolve_format
from pipeline.shard_writer import default_rows_per_shard
from pipeline.sources import Source, resolve_source
from pipeline.tokenizer import LoadedTokenizer, load_tokenizer
from schemas import MANIFEST_NAME, BuildInputs, Manifest, ManifestError, compute_fingerprint

# The files a build writes: shards, the rejected rows, the manifest, the report figure, and their temporary names.
_BUILD_FILE = re.compile(
    r"^(shard-\d+\.arrow|manifest\.json|rejected\.jsonl|report\.png"
    r"|\.(shard-\d+\.arrow|manifest\.json|rejected\.jsonl|report\.png)\.(tmp-\w+|uploading))$"
)


@dataclass(frozen=True)
class BuildPlan:
    """The resolved inputs of a build and where it goes."""

    config: PackConfig
    source: Source
    tokenizer: LoadedTokenizer
    example_format: ExampleFormat
    inputs: BuildInputs
    fingerprint: str
    out_dir: str


@dataclass(frozen=True)
class BuildResult:
    """A finished build: its manifest, its directory, whether it was reused, and the command's wall time."""

    manifest: Manifest
    out_dir: str
    reused: bool
    elapsed_s: float
    layout: str = ""  # how each example is laid out, for the report


def package_version() -> str:
    try:
        return importlib.metadata.version("varpack")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _chat_template(config: PackConfig, tokenizer: LoadedTokenizer) -> str | None:
    """``--chat-template`` (a file or the template itself), else the tokenizer's."""
    if config.chat_template is None:
        return tokenizer.chat_template
    if "{" not in config.chat_template:
        path = Path(config.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {config.chat_template}: no such file (or pass the Jinja template itself)")
        return path.read_text(encoding="utf-8")
    return config.chat_template


def plan_build(config: PackConfig) -> BuildPlan:
    """Resolve the dataset and tokenizer and compute the fingerprint; reads the data's bytes once to hash them."""
    config.validate()
    source = resolve_source(config)
    if source.known_examples == 0:
        raise InputError(f"{config.dataset}: holds no examples")
    tokenizer = load_tokenizer(config.tokenizer, config.bos_token, config.eos_token)
    example_format = resolve_format(
        config, source.columns, config.dataset, source.default_format, _chat_template(config, tokenizer)
    )
    if not example_format.is_chat and not tokenizer.suffix_ids:
        raise ConfigError(
            f"tokenizer {tokenizer.name} has no known EOS token, so examples would not end with one and the model "
            "would not learn to stop; pass --eos-token TOKEN (e.g. --eos-token '</s>' or '<|endoftext|>')"
        )
    inputs = BuildInputs(
        dataset=source.inputs,
        tokenizer=tokenizer.inputs(),
        template=example_format.template,
        loss_masking=example_format.loss_masking,
        max_len=config.max_len,
        overflow=config.overflow,
        packing=config.packing,
        seed=config.seed,
        package_version=package_version(),
        on_bad_row=config.on_bad_row,
    )
    fingerprint = compute_fingerprint(inputs)
    out_dir = storage.join(config.out, f"{source.name}-{fingerprint}")
    return BuildPlan(config, source, tokenizer, example_format, inputs, fingerprint, out_dir)


def read_build_manifest(out_dir: str) -> Manifest:
    """The validated manifest of the build in ``out_dir``, local or at a URL."""
    path = storage.join(out_dir, MANIFEST_NAME)
    try:
        return Manifest.from_json(storage.read_text(path), path)
    except (OSError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: cannot be read ({err})") from err


def _complete(manifest: Manifest, out_dir: str) -> bool:
    """Whether every shard the manifest lists is present with its recorded size, and rejected.jsonl if rows were."""
    if manifest.rejected is not None and manifest.rejected.rows and not storage.exists(storage.join(out_dir, REJECTED_NAME)):
        return False
    for shard in manifest.shards:
        path = storage.join(out_dir, shard.path)
        if not storage.exists(path) or storage.size(path) != shard.bytes:
            return False
    return True


def check_output(plan: BuildPlan, log: Callable[[str], None]) -> Manifest | None:
    """The manifest of a finished build to reuse, or None after clearing the way for a new build.

    Raises OutputDirError when ``--out`` is itself a build directory, when the build directory
    holds another fingerprint's build (without ``--force``) or files varpack did not write.
    """
    out, out_dir = plan.config.out, plan.out_dir
    if storage.exists(storage.join(out, MANIFEST_NAME)):
        raise OutputDirError(f"--out {out} is itself a shard directory (it holds {MANIFEST_NAME}); pass its parent directory")
    names = storage.list_files(out_dir)
    subdirs = [d for d in storage.list_subdirs(out_dir) if not d.startswith(spill.SPILL_PREFIX)]
    foreign = [n for n in names if not _BUILD_FILE.match(n)] + [f"{d}/" for d in subdirs]
    if foreign:
        raise OutputDirError(
            f"{out_dir} holds files varpack did not write ({', '.join(foreign[:3])}); move them away and run again"
        )
    if MANIFEST_NAME in names and not plan.config.force:
        try:
            manifest = read_build_manifest(out_dir)
        except ManifestError as err:
            log(f"rebuilding {out_dir}: its manifest is unreadable ({err})")
        else:
            if manifest.fingerprint != plan.fingerprint:
                raise OutputDirError(
                    f"{out_dir} holds the shards of another build (fingerprint {manifest.fingerprint}, expected "
                    f"{plan.fingerprint}); move it away, or pass --force to replace it"
                )
            if _complete(manifest, out_dir):
                return manifest
            log(f"rebuilding {out_dir}: shards listed in its manifest are missing or truncated")
    elif plan.config.force and names:
        log(f"--force: rebuilding {out_dir}")
    elif names:
        log(f"removing {len(names)} leftover files of an earlier run from {out_dir}")
    spill.remove_leftover_spills(out_dir)
    clear_build(out_dir)
    return None


def clear_build(out_dir: str) -> None:
    """Remove the files of a build (the manifest first, so no manifest ever points at missing shards)."""
    names = [n for n in storage.list_files(out_dir) if _BUILD_FILE.match(n)]
    names.sort(key=lambda n: n != MANIFEST_NAME)
    storage.remove([storage.join(out_dir, n) for n in names])


def _log_to_stderr(message: str) -> None:
    print(f"varpack: {message}", file=sys.stderr)


def build(
    config: PackConfig,
    log: Callable[[str], None] = _log_to_stderr,
    examples_per_group: int | None = None,
    rows_per_shard: int | None = None,
) -> BuildResult:
    """Make (or reuse) the shards ``config`` describes and return the manifest.

    ``examples_per_group`` and ``rows_per_shard`` override the packing group size and the shard
    size, so tests can reach several groups and shards with little data.
    """
    started = time.perf_counter()
    plan = plan_build(config)
    for note in plan.source.notes:
        log(note)
    existing = check_output(plan, log)
    if existing is not None:
        return BuildResult(existing, plan.out_dir, True, time.perf_counter() - started, _layout(plan))
    from pipeline import beam_pipeline, progress

    spill_dir = spill.new_spill_dir(plan.out_dir, _temp_location(config.beam_args))
    spec = beam_pipeline.BuildSpec(
        tasks=plan.source.tasks,
        tokenizer=plan.tokenizer,
        example_format=plan.example_format,
        inputs=plan.inputs,
        fingerprint=plan.fingerprint,
        out_dir=plan.out_dir,
        spill_dir=spill_dir,
        rows_per_shard=rows_per_shard or default_rows_per_shard(config.max_len),
        batch_size=config.batch_size,
        limit=config.num_examples,
        known_examples=plan.source.known_examples,
        max_bad_rows=config.max_bad_rows,
        **({"examples_per_group": examples_per_group} if examples_per_group else {}),
    )
    storage.make_dirs(plan.out_dir)
    log(f"packing {config.dataset} into {plan.out_dir}")
    if config.progress:
        progress.enable()
    try:
        beam_pipeline.run(spec, config.beam_args)
    except BaseException:
        spill.remove_spill(spill_dir)
        clear_build(plan.out_dir)
        storage.remove_empty_dir(plan.out_dir)
        raise
    finally:
        spill.remove_spill(spill_dir)
        progress.close()
    return BuildResult(read_build_manifest(plan.out_dir), plan.out_dir, False, time.perf_counter() - started, _layout(plan))


def _temp_location(beam_args: tuple[str, ...]) -> str | None:
    """Beam's ``--temp_location``, where a cluster's workers spill, or None to spill inside the build directory."""
    if not any(arg.startswith("--temp_location") for arg in beam_args):
        return None
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    return PipelineOptions(list(beam_args)).view_as(GoogleCloudOptions).temp_location


def _layout(plan: BuildPlan) -> str:
    """How each example is laid out and which special tokens go around it."""
    if plan.example_format.is_chat:
        return plan.example_format.describe()
    return f"{plan.example_format.describe()} ({plan.tokenizer.describe_affixes()})"
