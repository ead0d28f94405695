"""Exceptions shared by the write side and the read side.

Every message names the file, row or column at fault and says what to do.
"""

from __future__ import annotations


class VarpackError(Exception):
    """Base class of every error varpack raises on purpose."""


class ManifestError(VarpackError):
    """The manifest is missing, unreadable, malformed or of an unsupported version."""


class FormatVersionError(ManifestError):
    """The manifest was written by a newer format version than this code reads."""


class ShardError(VarpackError):
    """A shard file is missing, truncated, corrupt, or breaks a row invariant."""

    def __init__(self, shard: str, message: str, row: int | None = None) -> None:
        where = f"{shard} row {row}" if row is not None else shard
        super().__init__(f"{where}: {message}")
        self.shard = shard
        self.row = row


class PackingError(VarpackError):
    """The packer was given lengths or settings it cannot pack."""
