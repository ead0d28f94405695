"""A build as a ``pyarrow.dataset.Dataset`` or a Hugging Face ``datasets.Dataset``, without copying it.

Shards are Arrow IPC *files* (the random-access format, with a footer), which
``pyarrow.dataset`` (``format="arrow"``), Polars and DuckDB read, and which memory-map with zero
copy. A build directory also holds ``manifest.json`` (and ``report.png``, ``rejected.jsonl``), so
point those readers at the shard files, not the directory: the manifest lists them. Hugging
Face's ``Dataset.from_file`` reads only the IPC *stream* format; ``to_hf_dataset`` wraps the
memory-mapped shards instead, and ``datasets.load_dataset("arrow", data_files=...)`` reads them
too (copying them once into its cache).

``datasets`` is imported only by ``to_hf_dataset``: this module loads without it.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from loaders.remote import locate
from loaders.shard_reader import check_build_shard
from schemas import Manifest, ShardError, validate_table
from schemas.arrow_file import open_arrow_file


def _local_shards(
    build: str | os.PathLike[str], verify_checksum: bool, cache_dir: str | None
) -> tuple[Manifest, list[str]]:
    """The manifest and the local paths of its shards, each checked against it and its place in it."""
    location = locate(build)
    manifest = location.read_manifest()
    paths = location.local_shards(manifest, cache_dir, verify_checksum)
    for index, path in enumerate(paths):  # remote copies were hashed as they were fetched
        check_build_shard(path, manifest, index, verify_checksum and location.is_local)
    return manifest, [str(path) for path in paths]


def shard_paths(build: str | os.PathLike[str], verify_checksum: bool = False, cache_dir: str | None = None) -> list[str]:
    """The local paths of a build's shards, in manifest order, each checked against the manifest's size
    (and sha256 when ``verify_checksum``) and its place in the build (``schemas/shard_identity.py``).
    ``build`` is a build directory or manifest, local or any fsspec URL (remote shards are copied
    into ``cache_dir``, as the loader does)."""
    return _local_shards(build, verify_checksum, cache_dir)[1]


def arrow_dataset(build: str | os.PathLike[str], verify_checksum: bool = False, cache_dir: str | None = None) -> ds.Dataset:
    """The build's rows as a ``pyarrow.dataset.Dataset`` over its shard files (scans, filters, projections)."""
    return ds.dataset(shard_paths(build, verify_checksum, cache_dir), format="arrow")


def _memory_mapped(path: str) -> pa.Table:
    try:
        return open_arrow_file(path).read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ShardError(path, f"is not a readable Arrow IPC file ({err}); rebuild it") from err


def to_hf_dataset(build: str | os.PathLike[str], verify_checksum: bool = False, cache_dir: str | None = None) -> Any:
    """The build's rows as a Hugging Face ``datasets.Dataset``, one row per packed row, over the
    memory-mapped shards: nothing is copied or written to the ``datasets`` cache. Every shard is
    checked against the manifest and the row schema first.

    The dataset lives in memory as far as ``datasets`` knows: ``map(num_proc=N)`` pickles it
    (copying the rows); for that, ``datasets.load_dataset("arrow", data_files=shard_paths(build),
    split="train")``, which copies the shards into its cache once, fits better.
    """
    try:
        import datasets
    except ImportError as err:
        raise ImportError("to_hf_dataset needs the datasets package: pip install datasets") from err
    manifest, paths = _local_shards(build, verify_checksum, cache_dir)
    tables = []
    for path in paths:
        table = _memory_mapped(path)
        validate_table(table, manifest.capacity, path, manifest.num_example_ids)
        tables.append(table)
    # The build's fingerprint addresses its content: datasets would otherwise hash every row to make one.
    return datasets.Dataset(pa.concat_tables(tables), split=datasets.Split.TRAIN, fingerprint=manifest.fingerprint)
