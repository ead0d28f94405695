"""Each shard names its place in its build, so no manifest can drop, repeat or move it.

A manifest binds its shard list (``shards_digest``) and its other fields (``manifest_digest``),
but it could be rewritten as an older format version, which has neither. So from format
version 5 the one shard writer (``pipeline/write/shard_writer.py``) also stores, in every shard's
Arrow schema metadata, the build it belongs to and where in it:

    varpack.fingerprint = "0f3c9a2e5b7d1c44", varpack.shard_index = "3", varpack.last_shard = "0"

Whatever opens a build's shards (the loader, ``loaders/interop.py``, pack's reuse check)
compares each with its place in the manifest's list. A shard dropped, repeated or moved, the
last one dropped, or a manifest that claims a format older than its shards, is refused. Builds
of older formats, whose shards carry no identity, are still read.

>>> identity = ShardIdentity("0f3c9a2e5b7d1c44", index=3, last=False)
>>> ShardIdentity.from_metadata(identity.to_metadata()) == identity
True
>>> identity.describe()
'shard 3 of build 0f3c9a2e5b7d1c44'
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from schemas.manifest import Manifest

# The format version from which every shard carries its identity.
IDENTITY_FORMAT_VERSION = 5
_FINGERPRINT, _INDEX, _LAST = b"varpack.fingerprint", b"varpack.shard_index", b"varpack.last_shard"


@dataclass(frozen=True)
class ShardIdentity:
    """Shard ``index`` of the build with ``fingerprint``; ``last`` when no shard follows it."""

    fingerprint: str
    index: int
    last: bool

    @classmethod
    def in_build(cls, manifest: Manifest, index: int) -> ShardIdentity:
        """The identity shard ``index`` of ``manifest``'s list must carry."""
        return cls(manifest.fingerprint, index, index == len(manifest.shards) - 1)

    def to_metadata(self) -> dict[bytes, bytes]:
        return {_FINGERPRINT: self.fingerprint.encode(), _INDEX: str(self.index).encode(), _LAST: b"1" if self.last else b"0"}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> ShardIdentity | None:
        """The identity in a shard's schema metadata, or None for a shard of a format older than 5.

        Raises ValueError when the metadata holds a broken identity.
        """
        metadata = metadata or {}
        if _FINGERPRINT not in metadata:
            return None
        try:
            return cls(metadata[_FINGERPRINT].decode(), int(metadata[_INDEX]), metadata[_LAST] == b"1")
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"a broken build identity in its schema metadata ({err!r})") from err

    def describe(self) -> str:
        where = f"the last shard ({self.index})" if self.last else f"shard {self.index}"
        return f"{where} of build {self.fingerprint}"


def with_identity(schema: pa.Schema, identity: ShardIdentity) -> pa.Schema:
    """``schema`` with ``identity`` added to its metadata."""
    return schema.with_metadata({**(schema.metadata or {}), **identity.to_metadata()})


def identity_problem(schema: pa.Schema, manifest: Manifest, index: int) -> str | None:
    """Why a shard whose Arrow schema is ``schema`` cannot be shard ``index`` of ``manifest``'s list, or None."""
    rebuild = "rebuild the shards (pack --force)"
    try:
        found = ShardIdentity.from_metadata(schema.metadata)
    except ValueError as err:
        return f"carries {err}; {rebuild}"
    version = manifest.format_version
    if found is None:
        if version < IDENTITY_FORMAT_VERSION:
            return None
        return f"carries no build identity, though its manifest (format {version}) says every shard does: {rebuild}"
    if version < IDENTITY_FORMAT_VERSION:
        return (
            f"is {found.describe()} of format {IDENTITY_FORMAT_VERSION} or later, but its manifest claims format "
            f"{version}: the manifest was rewritten; {rebuild}"
        )
    expected = ShardIdentity.in_build(manifest, index)
    if found != expected:
        return (
            f"is {found.describe()}, but the manifest lists it as {expected.describe()}: the manifest was rewritten "
            f"or shard files were moved; {rebuild}"
        )
    return None


def file_identity_problem(source: pa.BufferReader, manifest: Manifest, index: int) -> str | None:
    """``identity_problem`` of a shard's bytes (``schemas.arrow_file.arrow_source``), reading only its schema (an Arrow
    IPC file's footer).

    Not a Python file object: pyarrow reads one from its own I/O threads, which keep it and take the GIL to let go of
    it, and one doing so as the interpreter exits aborts the process ("terminate called without an active exception").
    """
    try:
        schema = pa.ipc.open_file(source).schema
    except (pa.ArrowException, OSError, ValueError) as err:
        return f"is not a readable Arrow IPC file ({err}); rebuild the shards (pack --force)"
    return identity_problem(schema, manifest, index)
