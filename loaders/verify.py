"""Checksums of a local build, verified once per build on a host (``schemas/verified.py``).

A shard opened later (after the loader closed it to bound its open files, or in a DataLoader
worker) is compared with its identity on disk when it was first opened, and hashed again if it
changed (``loaders/shard_reader.py``).
"""

from __future__ import annotations

from pathlib import Path

from loaders.shard_reader import check_shard_file
from schemas import Manifest
from schemas.verified import VerifiedShards


def verify_build(manifest: Manifest, paths: list[Path]) -> int:
    """Check every shard's sha256 unless this host recorded it unchanged since; returns how many were hashed.

    Raises ShardError naming the first shard that is missing, truncated or corrupt.
    """
    hashed = 0
    with VerifiedShards(manifest) as record:
        for path, info in zip(paths, manifest.shards):
            if record.unchanged(path):
                continue
            check_shard_file(path, info, verify_checksum=True)
            record.add(path)
            hashed += 1
    return hashed
