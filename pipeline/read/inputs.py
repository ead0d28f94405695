"""What a build reads of its source and what it leaves out: the files read, the columns that reach
the tokens and those that do not. A column present but not read is a warning, an error under ``--strict``.

>>> read = InputsRead(files=("train.jsonl",), columns_used=("question", "answer"), columns_unused=("id",))
>>> read.warnings()
['train.jsonl: column id is not read (the examples use question, answer)']
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import InputError
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import FORMATS, file_format
from pipeline.read.sources import Source
from schemas import PackingStats


@dataclass(frozen=True)
class InputsRead:
    """The files a build reads and those in its directory it does not, the source columns its examples use, and
    those they do not."""

    files: tuple[str, ...] = ()
    files_unread: tuple[str, ...] = ()
    columns_used: tuple[str, ...] = ()
    columns_unused: tuple[str, ...] = ()

    @classmethod
    def of(cls, source: Source, example_format: ExampleFormat) -> InputsRead:
        """What ``source`` read as ``example_format`` uses of it."""
        used = tuple(dict.fromkeys(column.split(".")[0] for column in example_format.columns))
        present = source.all_columns if source.all_columns is not None else source.columns or ()
        unused = tuple(column for column in present if column not in used)
        return cls(source.files, source.files_unread, used, unused)

    def record(self, stats: PackingStats) -> None:
        """Put the files and columns into the manifest's statistics."""
        stats.source_files = list(self.files)
        stats.source_columns_used = list(self.columns_used)
        stats.source_columns_unused = list(self.columns_unused)

    def warnings(self) -> list[str]:
        """One line per thing present in the source that no example reads."""
        where = self.files[0] if len(self.files) == 1 else "the dataset"
        files = [
            f"{name}: not read (hidden: as on the Hub, a file or folder whose name starts with '.', or a folder starting "
            "with '__', is skipped; rename it to read it)" if file_format(name) else f"{name}: not read (not a {', '.join(FORMATS)} file)"
            for name in self.files_unread
        ]
        return files + [
            f"{where}: column {column} is not read (the examples use {', '.join(self.columns_used)})"
            for column in self.columns_unused
        ]

    def check(self, strict: bool) -> None:
        """Under ``--strict``, raise InputError for the first thing present but not read."""
        lines = self.warnings()
        if strict and lines:
            raise InputError(f"{lines[0]} (--strict)")
