"""The data files of one split of a dataset repository, laid out the way the Hugging Face Hub lays them out.

A repository is a local directory or ``hf://datasets/OWNER/NAME@REVISION``. Its files are chosen
the way ``datasets`` chooses them, without running any code the repository holds:

- the default config's ``data_files`` in the YAML header of ``README.md``, when it has one;
- otherwise the split names in directory or file names (``train/``, ``data/train-00000-of-00002.parquet``,
  ``validation.jsonl``, ...); files whose names name no split all belong to ``train``.

Loading scripts (``*.py`` at the root, e.g. ``flan.py``) are listed so the caller can say that
they are ignored: ``datasets`` 4 and later refuse to run them, and the data files they would
read are in the repository beside them.

>>> split_files("/data/flan", "validation").files   # doctest: +SKIP
('/data/flan/validation/anli_r1_10templates_validation.jsonl', ...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from pipeline import storage
from pipeline.errors import InputError
from pipeline.read.readers import FORMATS, file_format

README = "README.md"
# Files ``datasets`` writes beside the data (save_to_disk, dataset_infos): not data.
METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", re.DOTALL)


@dataclass(frozen=True)
class SplitFiles:
    """The data files of one split, sorted, and the loading scripts the repository holds."""

    files: tuple[str, ...]
    scripts: tuple[str, ...]
    splits: tuple[str, ...]  # every split the repository has
    other_splits: tuple[str, ...] = ()  # the data files of the other splits, not read


def _read_text(path: str) -> str | None:
    try:
        return storage.read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _default_data_files(readme: str | None) -> object:
    """The ``data_files`` of the default config in a dataset card's YAML header, or None."""
    match = _FRONT_MATTER.match(readme or "")
    if not match:
        return None
    try:
        header = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    configs = header.get("configs") if isinstance(header, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    default = next((c for c in configs if isinstance(c, dict) and (c.get("default") or c.get("config_name") == "default")), configs[0])
    return default.get("data_files") if isinstance(default, dict) else None


def _config_patterns(readme: str | None) -> dict[str, list[str]] | None:
    """``{split: [pattern, ...]}`` of the default config in a dataset card's YAML header, or None."""
    data_files = _default_data_files(readme)
    if data_files is None:
        return None
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, list) and not (data_files and isinstance(data_files[0], dict)):
        return {"train": list(data_files)}
    if isinstance(data_files, dict):
        return {split: [p] if isinstance(p, str) else list(p) for split, p in data_files.items()}
    patterns: dict[str, list[str]] = {}
    for entry in data_files if isinstance(data_files, list) else []:
        path = entry.get("path")
        patterns.setdefault(str(entry.get("split", "train")), []).extend([path] if isinstance(path, str) else list(path or []))
    return patterns


def _resolve(patterns: list[str], base: str) -> list[str]:
    """The data files under ``base`` that ``patterns`` (relative to it) match."""
    from datasets.data_files import DataFilesList

    try:
        resolved = DataFilesList.from_patterns(patterns, base_path=base)
    except FileNotFoundError:
        return []
    return sorted({str(path) for path in resolved if file_format(str(path))})


def _unnamed(base: str, named: set[str]) -> list[str]:
    """The data files under ``base`` (not ``datasets`` metadata) that no split's pattern matched; as on the Hub,
    hidden ones (a name starting with ``.``, or in a folder starting with ``__``) are not among them."""
    return [path for path in _resolve(["**"], base) if path not in named and storage.basename(path) not in METADATA]


def split_files(base: str, split: str) -> SplitFiles:
    """The data files of ``split`` in the repository at ``base``; raises InputError when it has none.

    Without a dataset card's ``configs``, files whose names name no split are ``train``, also
    beside files that do (``train.jsonl`` and ``more_data.jsonl``), where ``datasets`` would skip them.
    """
    from datasets.data_files import EmptyDatasetError, get_data_patterns

    scripts = tuple(sorted(storage.basename(p) for p in storage.glob(storage.join(base, "*.py"))))
    patterns = _config_patterns(_read_text(storage.join(base, README)))
    by_name = patterns is None
    if patterns is None:
        try:
            patterns = {str(name): list(p) for name, p in get_data_patterns(base).items()}
        except EmptyDatasetError:
            patterns = {}
    resolved = {name: _resolve(p, base) for name, p in patterns.items()}
    if by_name and resolved:
        unnamed = _unnamed(base, {path for files in resolved.values() for path in files})
        resolved["train"] = sorted({*resolved.get("train", []), *unnamed})
    splits = tuple(resolved)
    files = resolved.get(split, [])
    if not files:
        if split not in resolved:
            where = f"its splits are {', '.join(splits)}: pass --split NAME" if splits else f"it holds no {', '.join(FORMATS)} files"
            raise InputError(f"{base}: no split {split!r} ({where})")
        raise InputError(f"{base}: split {split!r} holds no {', '.join(FORMATS)} files")
    others = tuple(sorted({path for name, paths in resolved.items() if name != split for path in paths} - set(files)))
    return SplitFiles(tuple(files), scripts, splits, others)
