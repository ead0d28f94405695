"""Exceptions shared by the write side and the read side.

Every message names the file, row or column at fault and says what to do. Each class carries
its ``kind`` (config, input, output, manifest, shard, packing, write): what failed, for code
that handles errors by kind rather than by class. ``VarpackError.behind`` finds the error
behind another one, also when a Beam worker process sent it back only as the text of its
traceback (its last line names the class; the module path is ignored).
"""

from __future__ import annotations

import re
from typing import ClassVar

# The last line of a traceback: "package.module.ClassName: message".
_TRACEBACK_LAST_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): (.*)$")


class VarpackError(Exception):
    """Base class of every error varpack raises on purpose."""

    kind: ClassVar[str] = "error"
    _by_name: ClassVar[dict[str, type[VarpackError]]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        VarpackError._by_name[cls.__name__] = cls

    @classmethod
    def behind(cls, err: BaseException | None) -> VarpackError | None:
        """The VarpackError in ``err``'s chain of causes, or the last one named in the text of a worker's traceback."""
        seen = err
        while seen is not None:
            if isinstance(seen, VarpackError):
                return seen
            seen = seen.__cause__ or seen.__context__
        found = None
        for line in str(err).splitlines() if err is not None else ():
            match = _TRACEBACK_LAST_LINE.match(line.strip())
            if match and match.group(1) in cls._by_name:
                found = cls._by_name[match.group(1)].__new__(cls._by_name[match.group(1)])
                Exception.__init__(found, match.group(2))
        return found


class ManifestError(VarpackError):
    """The manifest is missing, unreadable, malformed or of an unsupported version."""

    kind = "manifest"


class FormatVersionError(ManifestError):
    """The manifest was written by a newer format version than this code reads."""


class ShardError(VarpackError):
    """A shard file is missing, truncated, corrupt, or breaks a row invariant."""

    kind = "shard"

    def __init__(self, shard: str, message: str, row: int | None = None) -> None:
        where = f"{shard} row {row}" if row is not None else shard
        super().__init__(f"{where}: {message}")
        self.shard = shard
        self.row = row


class PackingError(VarpackError):
    """The packer was given lengths or settings it cannot pack."""

    kind = "packing"


class WriteError(VarpackError):
    """A file could not be written: the disk is full, or the directory is not writable."""

    kind = "write"



class LinkError(WriteError):
    """A file varpack keeps in a shared place (a lock, a temporary file, the cache) is a link it did not make."""
