"""Checksums of a local build, verified once per build on a host (``schemas/verified.py``).

A shard opened later (after the loader closed it to bound its open files, or in a DataLoader
worker) is compared with its identity on disk when it was verified, and hashed again if it
changed (``loaders/shard_reader.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loaders.remote import BuildLocation
from loaders.shard_reader import Identity, check_shard_file
from schemas import Manifest, ShardError
from schemas.verified import VerifiedShards, disk_identity


@dataclass(frozen=True)
class VerifiedBuild:
    """The outcome of ``verify_build``: how many shards were hashed, and each one's identity on disk when it was
    found whole."""

    hashed: int
    identities: list[Identity]


def checked_shards(
    location: BuildLocation, manifest: Manifest, cache_root: str | os.PathLike[str] | None, verify_checksum: bool
) -> tuple[list[Path], list[Identity | None]]:
    """The local path of every shard of the build, and the identity on disk each was verified with (None where
    ``open_build_shard`` is to take it on first open): remote shards are copied into the cache and checked
    there, local ones hashed here unless this host recorded them unchanged (``verify_checksum=False``: sizes only).
    What every reader of a build (training, evaluation) opens its shards with."""
    paths = location.local_shards(manifest, cache_root, verify_checksum)
    if verify_checksum and location.is_local:
        return paths, list(verify_build(manifest, paths).identities)
    return paths, [None] * len(paths)


def verify_build(manifest: Manifest, paths: list[Path]) -> VerifiedBuild:
    """Check every shard's sha256 unless this host recorded it unchanged since.

    Raises ShardError naming the first shard that is missing, truncated or corrupt, or that changed while it was hashed.
    """
    hashed = 0
    identities = []
    with VerifiedShards(manifest) as record:
        for path, info in zip(paths, manifest.shards):
            before = _identity(path)  # one identity: what the record vouches for is what the reader compares with
            if record.unchanged(path, before):
                identities.append(before)
                continue
            check_shard_file(path, info, verify_checksum=True)
            if _identity(path) != before:
                raise ShardError(str(path), "was changed on disk while it was hashed; run again once nothing writes it")
            record.add(path, before)
            identities.append(before)
            hashed += 1
    return VerifiedBuild(hashed, identities)


def _identity(path: Path) -> Identity:
    try:
        return disk_identity(os.stat(path))
    except FileNotFoundError as err:
        raise ShardError(str(path), "shard file is missing; rebuild the shards or fix the path") from err
