"""Read local or remote data files (JSON lines, JSON arrays, Parquet, Arrow) as Arrow tables.

The driver scans each file once (``scan_file``): it hashes the bytes, lists the columns and
cuts the file into read tasks at row-group, row-range or line boundaries, counting the rows
of each. Workers then read one task each (``FileTask.read``) in batches of rows, keeping
only the columns the example format needs.

Messages name rows as the user finds them (``BatchRows``): ``FILE line N`` (1-based, blank
lines counted) in a JSON-lines file, ``FILE row N`` (0-based) in a Parquet, Arrow or JSON-array
file. A column may be a field of a struct column (``data.question``); dictionary-encoded
strings are read as strings (``select_columns``).
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.errors import InputError
from schemas.arrow_file import arrow_source

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Byte size of one JSON-lines read task, and the most rows of one Arrow read task.
JSONL_TASK_BYTES = 64 << 20
ARROW_TASK_ROWS = 1 << 18
_READ_BYTES = 8 << 20
# The Arrow type each kind of column is read as: messages as {role, content} or ShareGPT's {from, value}.
TEXT_TYPE = pa.string()
# Besides them, the fields chat templates read: OpenAI's tool calls (arguments as a JSON string, as the
# API writes them), the tool call a tool turn answers, and reasoning traces (Qwen3's, DeepSeek-R1's).
MESSAGE_FIELDS = ("role", "content", "from", "value")
TOOL_CALL_TYPE = pa.struct([
    ("id", pa.string()), ("type", pa.string()),
    ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
])
MESSAGES_TYPE = pa.list_(pa.struct([
    *((name, pa.string()) for name in MESSAGE_FIELDS),
    ("reasoning_content", pa.string()), ("tool_call_id", pa.string()), ("name", pa.string()),
    ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    ("weight", pa.float64()),  # a ShareGPT turn's weight, as axolotl reads it: 0 is not trained on
]))
_BLANK = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)
_BLANK_BYTE = np.zeros(256, dtype=bool)
_BLANK_BYTE[_BLANK] = True
_LEADING_BLANKS = re.compile(rb"[ \t\n\r\x0b\x0c]*")


@dataclass(frozen=True)
class BatchRows:
    """Names the rows of one batch the way the user finds them in its source.

    ``first_row`` is the batch's first row within the rows ``line_numbers`` covers; without
    ``line_numbers`` rows are named by index (``FILE row N``), with it by line (``FILE line N``).
    """

    origin: str
    first_row: int = 0
    line_numbers: Callable[[], np.ndarray] | None = None
    # JSON lines: the records (counted as ``line_numbers`` counts them) that are lines that are not objects, read as
    # null rows, each with the value its line holds.
    not_objects: Callable[[], dict[int, object]] | None = None

    def names(self, rows: Sequence[int]) -> list[str]:
        """``FILE line N`` or ``FILE row N`` for each of the batch's ``rows``."""
        if self.line_numbers is None:
            return [f"{self.origin} row {self.first_row + int(r)}" for r in rows]
        lines = self.line_numbers()
        return [f"{self.origin} line {int(lines[self.first_row + int(r)])}" for r in rows]

    def name(self, row: int) -> str:
        """``FILE line N`` or ``FILE row N`` for one row of the batch."""
        return self.names([row])[0]

    def not_an_object(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of the batch's ``rows`` is a JSON line that is not an object (always False for other formats)."""
        if self.not_objects is None:
            return np.zeros(len(rows), dtype=bool)
        return np.isin(self.first_row + np.asarray(rows), np.fromiter(self.not_objects(), dtype=np.int64))

    def as_read(self, row: int) -> object:
        """The value a JSON line that is not an object holds (``[1, 2]``, ``"text"``, ``None``), for one of the batch's
        rows that ``not_an_object`` finds."""
        assert self.not_objects is not None
        return self.not_objects()[self.first_row + int(row)]


def _records(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The line index, first non-blank byte and end of each record (non-blank line) of JSON-lines ``data``."""
    raw = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(raw == ord("\n"))
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [raw.size]))
    filled = np.flatnonzero(~_BLANK_BYTE[raw])
    first_filled = np.searchsorted(filled, starts)
    is_record = first_filled < np.searchsorted(filled, ends)
    return np.flatnonzero(is_record), filled[first_filled[is_record]], ends[is_record]


def count_records(data: bytes) -> int:
    """The records of JSON-lines ``data``: its lines that are not blank (a record is exactly one line).

    >>> count_records(b'{"a": 1}\\n\\n \\r\\n  {"a": 2}')
    2
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(raw == ord("\n"))
    starts, ends = np.concatenate(([0], newlines + 1)), np.append(newlines, raw.size)
    starts, ends = starts[starts < ends], ends[starts < ends]  # lines of at least one byte
    # A line that starts with a byte that is not blank is a record; the few others are looked at whole.
    unsure = _BLANK_BYTE[raw[starts]]
    records = int(unsure.size - unsure.sum())
    return records + sum(1 for start, end in zip(starts[unsure].tolist(), ends[unsure].tolist()) if data[start:end].strip())


def record_lines(data: bytes, first_line: int) -> np.ndarray:
    """The 1-based line number of each record (non-blank line) of JSON-lines ``data`` that starts at ``first_line``.

    >>> record_lines(b'{"a": 1}\\n\\n  \\n{"a": 2}\\n', first_line=1)
    array([1, 4])
    """
    return first_line + _records(data)[0]


def not_object_records(data: bytes) -> np.ndarray:
    """The records of JSON-lines ``data`` (by index) that are valid JSON but not objects: ``null``, ``5``, ``[1]``.

    >>> not_object_records(b'{"a": 1}\\nnull\\n\\n[1, 2]\\n{"a": 2}\\n[1,\\n')
    array([1, 2])
    """
    _, firsts, ends = _records(data)
    found = [
        record for record in np.flatnonzero(np.frombuffer(data, dtype=np.uint8)[firsts] != ord("{")).tolist()
        if _parses(data[firsts[record] : ends[record]])
    ]
    return np.array(found, dtype=np.int64)


def _parses(line: bytes) -> bool:
    """Whether ``line`` is one valid JSON value."""
    try:
        json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return True


def _as_empty_objects(data: bytes, records: np.ndarray) -> bytes:
    """JSON-lines ``data`` with the lines of ``records`` replaced by ``{}``: a row of nulls each, as Arrow reads ``null``."""
    _, firsts, ends = _records(data)
    pieces, at = [], 0
    for record in records.tolist():
        pieces += [data[at : firsts[record]], b"{}"]
        at = ends[record]
    return b"".join([*pieces, data[at:]])


def _strip_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte-order mark."""
    return data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data


def read_schema(columns: Sequence[str], kind: pa.DataType) -> dict[str, pa.DataType]:
    """The top-level columns to read, each with its Arrow type, for ``columns`` of type ``kind``.

    A dotted name (``data.question``) reads struct column ``data`` with the fields named.
    """
    fields: dict[str, pa.DataType] = {}
    for name in columns:
        top, *path = name.split(".")
        read_as = kind
        for field in reversed(path):
            read_as = pa.struct([(field, read_as)])
        existing = fields.get(top)
        if existing is not None and pa.types.is_struct(existing) and pa.types.is_struct(read_as):
            read_as = pa.struct([*existing, *read_as])
        fields[top] = read_as
    return fields


def select_columns(table: pa.Table, columns: Sequence[str], origin: str) -> pa.Table:
    """A table of ``columns``, each a top-level column or a dotted path into struct columns, strings decoded."""
    arrays = {}
    for name in columns:
        if name in table.column_names:
            values = table.column(name)
        else:
            top, *path = name.split(".")
            values = table.column(top)
            for depth, field in enumerate(path):
                if not pa.types.is_struct(values.type) or values.type.get_field_index(field) < 0:
                    parent = ".".join([top, *path[:depth]])
                    fields = [f.name for f in values.type] if pa.types.is_struct(values.type) else []
                    raise InputError(
                        f"{origin}: column {parent!r} has no field {field!r} (fields: {', '.join(fields) or 'none'})"
                    )
                values = pc.struct_field(values, field)
        if pa.types.is_dictionary(values.type):
            values = pc.cast(values, values.type.value_type)
        arrays[name] = values
    return pa.table(arrays)


def file_format(path: str) -> str | None:
    """The format of a data file from its suffix, or None for an unsupported file."""
    for suffix, name in FORMATS.items():
        if path.endswith(suffix):
            return name
    return None


@dataclass(frozen=True)
class FileTask:
    """Rows ``[first_row, first_row + rows)`` of one file; bytes ``[start, stop)`` for JSON lines.

    ``rows`` is None where the driver could not count them; ``limit`` caps the rows read.
    """

    path: str
    format: str
    first_row: int = 0
    rows: int | None = None
    start: int = 0
    stop: int | None = None
    row_group: int | None = None
    limit: int | None = None
    first_line: int = 1  # JSON lines: the line ``start`` begins

    @property
    def origin(self) -> str:
        return self.path

    def batch_rows(self, first_row: int) -> BatchRows:
        """Names for the rows of the batch that starts at row ``first_row`` of the file."""
        if self.format != "jsonl":
            return BatchRows(self.path, first_row)
        return BatchRows(
            self.path, first_row - self.first_row, functools.partial(_task_lines, self), functools.partial(_task_not_objects, self)
        )

    def read(self, columns: dict[str, pa.DataType], batch_size: int) -> Iterator[tuple[int, pa.Table]]:
        """Yield ``(first row in the file, table)`` batches of at most ``batch_size`` rows of ``columns``."""
        tables = self._read_parquet(columns, batch_size) if self.format == "parquet" else self._read_whole(columns, batch_size)
        row, end = self.first_row, self.first_row + (self.limit if self.limit is not None else np.iinfo(np.int64).max)
        for table in tables:
            if row >= end:
                return
            yield row, table.slice(0, end - row)
            row += table.num_rows

    def _read_parquet(self, columns: dict[str, pa.DataType], batch_size: int) -> Iterator[pa.Table]:
        # Batch by batch, so tokenizing starts before a large row group is read to the end.
        try:
            with storage.open_read(self.path) as f:
                batches = pq.ParquetFile(f).iter_batches(batch_size, row_groups=[self.row_group], columns=list(columns))
                for batch in batches:
                    yield pa.Table.from_batches([batch])
        except (OSError, pa.ArrowException) as err:
            raise InputError(f"{self.path}: cannot be read as Parquet ({err})") from err

    def _read_whole(self, columns: dict[str, pa.DataType], batch_size: int) -> Iterator[pa.Table]:
        table = self._read_table(columns)
        for offset in range(0, table.num_rows, batch_size):
            yield table.slice(offset, batch_size)

    def _read_table(self, columns: dict[str, pa.DataType]) -> pa.Table:
        try:
            if self.format == "arrow":
                table = _read_arrow(self.path).select(list(columns))
                return table.slice(self.first_row, self.rows)
            if self.format == "jsonl":
                return _read_json_lines(self._bytes(), columns, self)
            records = json.loads(self._bytes().decode("utf-8"))
            if isinstance(records, list):
                _arguments_as_text(records, columns)
            return _json_array_table(records, columns, self)
        except (OSError, pa.ArrowException) as err:
            raise InputError(f"{self.path}: cannot be read ({err})") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{self.path}: not valid JSON ({err})") from err

    def _bytes(self) -> bytes:
        with storage.open_read(self.path) as f:
            f.seek(self.start)
            data = f.read() if self.stop is None else f.read(self.stop - self.start)
        return _strip_bom(data) if self.start == 0 else data


@functools.lru_cache(maxsize=2)
def _task_lines(task: FileTask) -> np.ndarray:
    """The line number of each record of a JSON-lines task: read again only when a message names a row."""
    return record_lines(task._bytes(), task.first_line)


@functools.lru_cache(maxsize=2)
def _task_not_objects(task: FileTask) -> dict[int, object]:
    """The records of a JSON-lines task that are not objects, each with its value: found again only when a row reads
    as all nulls."""
    data = task._bytes()
    _, firsts, ends = _records(data)
    return {record: json.loads(data[firsts[record] : ends[record]]) for record in not_object_records(data).tolist()}


def _read_arrow(path: str) -> pa.Table:
    """An Arrow IPC file or stream (the format ``datasets`` caches), memory-mapped when local."""
    source = arrow_source(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _read_json_lines(data: bytes, columns: dict[str, pa.DataType], task: FileTask) -> pa.Table:
    """The rows of JSON-lines ``data``; a line that is not an object (``null``, ``5``) is a row of nulls, which the
    encoder reports as a bad row (``BatchRows.not_an_object``)."""
    options = pajson.ParseOptions(explicit_schema=pa.schema(columns), unexpected_field_behavior="ignore")
    # A block must hold the longest line; Arrow's row numbers in errors count from the block.
    read_options = pajson.ReadOptions(block_size=max(1 << 20, min(len(data) + 1, 1 << 30)))

    def read(data: bytes) -> pa.Table:
        return pajson.read_json(io.BytesIO(data), read_options=read_options, parse_options=options)

    table = None
    # Arrow reads a null line as a row of nulls, but refuses 5 or [1], and crashes on a first line of null.
    if _first_byte(data) in (b"{", b""):
        with contextlib.suppress(pa.ArrowInvalid):
            table = read(data)
    try:
        if table is None:
            table = read(_as_empty_objects(data, not_object_records(data)))
        table.validate(full=True)  # Arrow's JSON reader lets bytes that are not UTF-8 into strings
    except pa.ArrowInvalid as err:
        records = _with_text_arguments(data, columns)
        if records is None:
            raise _first_bad_json_line(data, columns, task) or InputError(f"{task.path}: {err}") from err
        return _json_array_table(records, columns, task)
    # Arrow reads records wherever they start, so two on a line (or one across lines) would be rows the driver did not
    # count: the count it made, or for a task it did not count, its lines, must be the rows read.
    rows = task.rows if task.rows is not None else count_records(data)
    if table.num_rows != rows:
        raise _first_bad_json_line(data, columns, task) or InputError(
            f"{task.path}: {table.num_rows} JSON records on {rows} lines from line {task.first_line}; "
            "JSON lines hold one record per line"
        )
    return table


def _with_text_arguments(data: bytes, columns: dict[str, pa.DataType]) -> list | None:
    """The records of JSON-lines ``data`` with each tool call's ``arguments`` object (the form chat templates
    take) as JSON text, which Arrow can type (``chat.py`` reads it back as the object), or None when no
    record holds one (or a line is not JSON: the caller names it)."""
    if not any(kind == MESSAGES_TYPE for kind in columns.values()):
        return None
    try:
        records = [json.loads(line) for line in data.split(b"\n") if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return records if _arguments_as_text(records, columns) else None


def _arguments_as_text(records: list, columns: dict[str, pa.DataType]) -> bool:
    """Turn each tool call's ``arguments`` object in the messages columns of ``records`` into JSON text; whether any was."""
    changed = False
    names = [name for name, kind in columns.items() if kind == MESSAGES_TYPE]
    for record in records:
        for name in names:
            value = record.get(name) if isinstance(record, dict) else None
            for message in value if isinstance(value, list) else ():
                calls = message.get("tool_calls") if isinstance(message, dict) else None
                for call in calls if isinstance(calls, list) else ():
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict) and isinstance(function.get("arguments"), dict | list):
                        function["arguments"] = json.dumps(function["arguments"], ensure_ascii=False)
                        changed = True
    return changed


def _first_byte(data: bytes) -> bytes:
    """The first byte of ``data`` that is not blank, or b"" when there is none."""
    start = _LEADING_BLANKS.match(data).end()
    return data[start : start + 1]


def _parse_line(line: bytes, where: str) -> object:
    """One JSON-lines record, or an InputError naming ``where`` (``FILE line N``) when it is not valid UTF-8 JSON."""
    try:
        return json.loads(line)
    except UnicodeDecodeError as err:
        raise InputError(f"{where}: not UTF-8 text (byte {line[err.start]:#04x} at byte {err.start} of the line); "
                         "JSON lines must be UTF-8: fix the line or convert the file") from err
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # `cat` of a file without its final newline, or records split by a bare CR
            raise InputError(f"{where}: holds more than one JSON record (another starts at byte {err.pos} of the line); "
                             "JSON lines hold one record per line") from err
        raise InputError(f"{where}: not valid JSON ({err})") from err
    except RecursionError as err:
        raise InputError(f"{where}: not valid JSON (nested too deeply to read)") from err


def _first_bad_json_line(data: bytes, columns: dict[str, pa.DataType], task: FileTask) -> InputError | None:
    """An error naming the first line of JSON lines ``data`` that is not valid UTF-8 JSON, or an object
    without the expected columns (lines that are not objects are bad rows, reported later)."""
    for line_number, line in enumerate(data.split(b"\n"), start=task.first_line):
        if not line.strip():
            continue
        where = f"{task.path} line {line_number}"
        try:
            record = _parse_line(line, where)
        except InputError as err:
            return err
        if not isinstance(record, dict):
            continue
        for name, kind in columns.items():
            problem = _value_problem(record.get(name), kind)
            if problem:
                return InputError(f"{where}: column {name!r} {problem}")
        if _has_lone_surrogate(record):
            return InputError(f"{where}: holds a lone surrogate (a \\ud800-\\udfff escape not in a pair), not Unicode "
                              "text; fix or remove the line")
    return None


def _has_lone_surrogate(value: object) -> bool:
    """Whether a decoded JSON value holds a string with an unpaired surrogate, which is not valid UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _value_problem(value: object, kind: pa.DataType) -> str | None:
    """What makes a JSON value unfit for a column of Arrow type ``kind`` (nulls are checked later)."""
    if value is None:
        return None
    if pa.types.is_struct(kind):
        if not isinstance(value, dict):
            return f"must be an object with fields {', '.join(f.name for f in kind)}, got {type(value).__name__}"
        problems = (_value_problem(value.get(f.name), f.type) for f in kind)
        return next((f"field {problem}" for problem in problems if problem), None)
    if kind == TEXT_TYPE:
        if not isinstance(value, str):
            return f"holds a value of type {type(value).__name__}, not a string"
        return "holds a lone surrogate, which is not Unicode text" if _has_lone_surrogate(value) else None
    if not isinstance(value, list):
        return f"must be a list of messages, got a value of type {type(value).__name__}"
    return next(filter(None, map(_message_problem, value)), None)


def _message_problem(message: object) -> str | None:
    """What makes one chat message unfit for the messages column: fields that are not strings, tool calls
    whose arguments are not JSON text, a lone surrogate."""
    if not isinstance(message, dict) or not all(isinstance(message.get(k), (str, type(None))) for k in MESSAGE_FIELDS):
        return f"must hold messages with string 'role' and 'content' (or 'from' and 'value'), got {message!r:.80}"
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("arguments"), (str, type(None)))):
            return f"must hold tool calls whose function 'arguments' is a JSON string (as OpenAI writes them), got {call!r:.80}"
    if _has_lone_surrogate(message):
        return "holds a lone surrogate, which is not Unicode text"
    return None


def _json_array_table(records: object, columns: dict[str, pa.DataType], task: FileTask) -> pa.Table:
    if not isinstance(records, list):
        raise InputError(f"{task.path}: a .json file must hold one array of objects (or be JSON lines)")
    arrays = {}
    for name, kind in columns.items():
        values = [record.get(name) if isinstance(record, dict) else None for record in records]
        for row, value in enumerate(values):
            problem = _value_problem(value, kind)
            if problem:
                raise InputError(f"{task.path} row {row}: column {name!r} {problem}")
        arrays[name] = pa.array(values, type=kind)
    return pa.table(arrays)


@dataclass(frozen=True)
class FileScan:
    """What the driver learns from one pass over a file."""

    path: str
    sha256: str
    columns: tuple[str, ...]
    tasks: tuple[FileTask, ...]




def _first_record_keys(path: str, data: bytes) -> tuple[str, ...]:
    """The keys of the first object line (lines that are not objects are bad rows, reported later)."""
    for number, line in enumerate(_strip_bom(data).split(b"\n"), start=1):
        if line.strip():
            record = _parse_line(line, f"{path} line {number}")
            if isinstance(record, dict):
                return tuple(record)
    return ()


def _record_keys(data: bytes) -> tuple[str, ...]:
    """The keys of every object line of JSON-lines ``data``, in the order they first appear.

    >>> _record_keys(b'{"instruction": "a", "output": "b"}\\n{"instruction": "c", "input": "d", "output": "e"}\\n')
    ('instruction', 'output', 'input')
    """
    data = _strip_bom(data)
    _, firsts, _ = _records(data)
    if (np.frombuffer(data, dtype=np.uint8)[firsts] == ord("{")).all():  # Arrow reads only lines of objects
        with contextlib.suppress(pa.ArrowInvalid, pa.ArrowTypeError):  # a bad line or a column of mixed types
            return tuple(pajson.read_json(io.BytesIO(data)).column_names)
    keys: dict[str, None] = {}
    for line in data.split(b"\n"):
        try:
            record = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):  # a bad line, reported when the rows are read
            continue
        if isinstance(record, dict):
            keys.update(dict.fromkeys(record))
    return tuple(keys)


def _scan_json_lines(path: str, f, digest) -> tuple[tuple[str, ...], list[FileTask]]:
    tasks: list[FileTask] = []
    columns: tuple[str, ...] | None = None
    start, row, line, carry = 0, 0, 1, b""
    while True:
        block = f.read(JSONL_TASK_BYTES)
        digest.update(block)
        data = carry + block
        if block:
            cut = data.rfind(b"\n") + 1  # tasks end on a line boundary; the rest goes to the next one
            chunk, carry = (data[:cut], data[cut:]) if cut else (b"", data)
        else:
            chunk, carry = data, b""
        if chunk:
            if columns is None:
                columns = _first_record_keys(path, chunk)
            columns = tuple(dict.fromkeys(columns + _record_keys(chunk)))  # a key first seen in a later row is a column too
            rows = count_records(_strip_bom(chunk) if start == 0 else chunk)
            if rows:
                tasks.append(
                    FileTask(path, "jsonl", first_row=row, rows=rows, start=start, stop=start + len(chunk), first_line=line)
                )
            start, row, line = start + len(chunk), row + rows, line + chunk.count(b"\n")
        if not block:
            return columns or (), tasks


def scan_file(path: str) -> FileScan:
    """Hash a data file, list its columns and cut it into read tasks with their row counts."""
    fmt = file_format(path)
    if fmt is None:
        raise InputError(f"{path}: unsupported file type; use .jsonl, .json, .parquet or .arrow")
    digest = hashlib.sha256()
    try:
        with storage.open_read(path) as f:
            if fmt == "jsonl":
                columns, tasks = _scan_json_lines(path, f, digest)
                return FileScan(path, digest.hexdigest(), columns, tuple(tasks))
            data = bytearray()
            while block := f.read(_READ_BYTES):
                digest.update(block)
                if fmt == "json":
                    data += block
        if fmt == "json":
            return _scan_json(path, bytes(data), digest.hexdigest())
        if fmt == "parquet":
            return _scan_parquet(path, digest.hexdigest())
        return _scan_arrow(path, digest.hexdigest())
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: cannot be read ({err})") from err


def scan_file_header(path: str) -> FileScan:
    """Columns and read tasks of a data file without reading it all (for files behind a pinned revision).

    Parquet files are cut at row groups with their row counts, from the footer; any other file is
    one task of uncounted rows, with the columns of its first JSON record or its Arrow schema.
    """
    fmt = file_format(path)
    if fmt == "parquet":
        return _scan_parquet(path, "")
    try:
        with storage.open_read(path) as f:
            if fmt == "jsonl":
                columns = _first_record_keys(path, f.readline())
            elif fmt == "arrow":
                columns = tuple(_read_arrow(path).column_names)
            else:
                return _scan_json(path, f.read(), "")
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: cannot be read ({err})") from err
    return FileScan(path, "", columns, (FileTask(path, fmt),))


def _scan_json(path: str, data: bytes, sha256: str) -> FileScan:
    if _strip_bom(data).lstrip()[:1] != b"[":  # JSON lines saved as .json
        columns, tasks = _scan_json_lines(path, io.BytesIO(data), hashlib.sha256())
        return FileScan(path, sha256, columns, tuple(tasks))
    try:
        records = json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid JSON ({err})") from err
    columns = tuple(dict.fromkeys(key for record in records if isinstance(record, dict) for key in record))
    return FileScan(path, sha256, columns, (FileTask(path, "json", rows=len(records)),) if records else ())


def _scan_parquet(path: str, sha256: str) -> FileScan:
    with storage.open_read(path) as f:
        parquet = pq.ParquetFile(f)
        metadata, columns = parquet.metadata, tuple(parquet.schema_arrow.names)
    tasks, row = [], 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        if rows:
            tasks.append(FileTask(path, "parquet", first_row=row, rows=rows, row_group=group))
        row += rows
    return FileScan(path, sha256, columns, tuple(tasks))


def _scan_arrow(path: str, sha256: str) -> FileScan:
    table = _read_arrow(path)
    tasks = tuple(
        FileTask(path, "arrow", first_row=row, rows=min(ARROW_TASK_ROWS, table.num_rows - row))
        for row in range(0, table.num_rows, ARROW_TASK_ROWS)
    )
    return FileScan(path, sha256, tuple(table.column_names), tasks)
