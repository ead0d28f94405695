"""``pack_dataset``: pack rows held in memory, from Python, with the options of ``pack``.

A ``datasets.Dataset``, a ``pyarrow.Table`` or an iterable of dicts is written once as
``NAME.parquet`` in a temporary directory and packed from there, so the build is the one the
command line makes of that file, byte for byte:

    pack_dataset(table, out="shards", name="rows", max_len=2048)
    # is the build of
    pyarrow.parquet.write_table(table.replace_schema_metadata(None), "rows.parquet")
    python -m pipeline.pack --dataset rows.parquet --out shards --max-len 2048

The table is written without its schema's metadata: a Dataset's carries its own fingerprint,
which changes with how the Dataset was made, not with its rows, and would defeat the reuse.

Options are PackConfig's fields, the command line's options with underscores
(``max_len``, ``prompt_template``, ``on_bad_row``, ...); Apache Beam options go in
``beam_args``. The temporary file is removed when the build ends, so a runner whose workers run
on other machines needs the data written to storage they reach, packed with ``--dataset``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import PackConfig
from pipeline.errors import ConfigError
from pipeline.pack import beam_options, build_and_report
from schemas import VarpackError

# The name becomes the build's source name (``NAME-<fingerprint>``) and its dataset id (``local:NAME.parquet``).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def pack_dataset(data: Any, out: str = "shards", *, name: str = "data", **options: Any) -> str:
    """Pack ``data`` (a ``datasets.Dataset``, a ``pyarrow.Table`` or an iterable of dicts) into ``out``
    and return the build's directory; a build of the same rows and options is reused.

    Raises ConfigError for an unknown option or a bad name, and pack's own errors (one line each,
    naming the row) for bad rows; nothing is left half-written.
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(f"pack_dataset: name {name!r} must be letters, digits, '.', '_' or '-' (at most 100)")
    fields = {field.name for field in dataclasses.fields(PackConfig)} - {"dataset", "out"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"pack_dataset: unknown option {unknown[0]!r}; the options are PackConfig's fields: {', '.join(sorted(fields))}")
    options["beam_args"] = beam_options(options.get("beam_args", ()))
    table = as_table(data)
    if table.num_rows == 0:
        raise ConfigError("pack_dataset: no rows")
    with tempfile.TemporaryDirectory(prefix="varpack-rows-") as scratch:
        path = Path(scratch) / f"{name}.parquet"
        pq.write_table(table.replace_schema_metadata(None), path)
        config = PackConfig(dataset=str(path), out=out, **options)
        try:
            return build_and_report(config).out_dir
        except VarpackError as err:  # name the data passed, not the scratch file removed by now
            raise _renamed(err, str(path), "pack_dataset data") from err


def _renamed(err: VarpackError, path: str, name: str) -> VarpackError:
    """``err`` with ``path`` in its message read as ``name``: the same class and attributes."""
    renamed = type(err).__new__(type(err))
    Exception.__init__(renamed, str(err).replace(path, name))
    renamed.__dict__.update(err.__dict__)
    return renamed


def as_table(data: Any) -> pa.Table:
    """The rows of ``data`` as one Arrow table (a Dataset's selection and order applied)."""
    if isinstance(data, pa.Table):
        return data
    datasets = sys.modules.get("datasets")  # imported only if the caller has it loaded
    if datasets is not None and isinstance(data, datasets.Dataset):
        return data.flatten_indices().data.table
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise ConfigError(
            f"pack_dataset: data must be a datasets.Dataset, a pyarrow.Table or an iterable of dicts, not {type(data).__name__}; "
            "to pack a file or a Hub dataset, pass its path or id to `python -m pipeline.pack --dataset`"
        )
    rows = list(data)
    for number, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"pack_dataset: row {number} is a {type(row).__name__}, not a dict")
    try:  # the columns are the keys of every row, not only the first: a key first seen in row 5 is a column
        return pa.Table.from_struct_array(pa.array(rows, type=None if rows else pa.struct([])))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ConfigError(f"pack_dataset: the rows do not make one table ({err}); give each column one type") from err
