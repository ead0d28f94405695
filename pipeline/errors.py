"""Errors of the offline pipeline that the command line reports as one line and exit status 1.

Each message names the dataset, file, row or column at fault and says what to do.
"""

from __future__ import annotations

from schemas import VarpackError


class ConfigError(VarpackError):
    """A setting or a combination of settings that cannot work."""

    kind = "config"


class InputError(VarpackError):
    """The input data is missing, unreadable or malformed (a column, a row, a value)."""

    kind = "input"


class NothingKeptError(InputError):
    """Every row read is a bad row: the build stops, and keeps only ``rejected.jsonl``, which lists them."""


class HubUnreachableError(InputError):
    """The Hugging Face Hub is needed and cannot be reached."""


class OutputDirError(VarpackError):
    """The output directory holds something a build must not overwrite, or another run is building it."""

    kind = "output"


class TokenMismatchError(InputError):
    """An example's tokens differ from the reference tokenization; the message shows both, one line each."""

    lines_kept = True
