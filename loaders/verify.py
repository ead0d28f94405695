"""Checksums of a local build: verified once per build on a host, and recorded.

The first reader to open a build with ``verify_checksum=True`` hashes every shard, then records
in the cache directory (``$VARPACK_CACHE_DIR/verified/``) each shard's identity on disk:
device, inode, size and modification time. Later readers on the host (the other ranks, the
DataLoader workers, the next run) find the record, see that every shard is still that same
file, and skip the hashing; a shard rewritten or replaced since no longer matches and is hashed
again. Readers that start together take turns on a file lock, so one hashes while the others
wait for its record. What this does not catch: bytes changed in place by the disk itself, with
no write through the filesystem (run with a fresh ``$VARPACK_CACHE_DIR`` to hash again).

A shard reopened later (after the loader closed it to bound its open files) is checked by size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from loaders.shard_reader import check_shard_file
from schemas import Manifest, WriteError, atomic_write, cache_dir
from schemas.manifest import shards_digest

RECORD_DIR = "verified"


def _identity(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]


def _read_record(record: Path | None) -> dict[str, list[int]]:
    """The recorded identities of verified shards, by path; empty when there is no readable record."""
    try:
        known = json.loads(record.read_text()) if record is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record_path(manifest: Manifest) -> Path:
    """Where the verification of this build (its fingerprint and exact shard list) is recorded."""
    digest = shards_digest([dataclasses.asdict(s) for s in manifest.shards])
    return cache_dir() / RECORD_DIR / f"{manifest.fingerprint}-{digest[:16]}.json"


def verify_build(manifest: Manifest, paths: list[Path]) -> int:
    """Check every shard's sha256 unless this host recorded it unchanged since; returns how many were hashed.

    Raises ShardError naming the first shard that is missing, truncated or corrupt. Without a
    writable cache directory every shard is hashed, and nothing is recorded.
    """
    record_file = record_path(manifest)
    record: Path | None = record_file
    try:
        record_file.parent.mkdir(parents=True, exist_ok=True)
        lock: contextlib.AbstractContextManager = _locked(record_file.with_suffix(".lock"))
    except OSError:
        record, lock = None, contextlib.nullcontext()
    with lock:
        known = _read_record(record)
        hashed = 0
        for path, info in zip(paths, manifest.shards):
            key = str(path.resolve())
            if path.is_file() and known.get(key) == _identity(path):
                continue
            check_shard_file(path, info, verify_checksum=True)
            known[key] = _identity(path)
            hashed += 1
        if hashed and record is not None:
            with contextlib.suppress(WriteError):
                atomic_write(record, json.dumps(known))
    return hashed
