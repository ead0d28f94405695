"""This host's record of the shards of a build that were hashed and found whole.

Hashing a build costs about 2.5 s per GB. The first check of a local build, by the loader
(``verify_checksum=True``) or by ``pack`` deciding to reuse it, hashes every shard and records,
in the cache directory (``$VARPACK_CACHE_DIR/verified/``), each shard's identity on disk:
device, inode, size, modification time and change time. Later checks on the host (the other
ranks, the DataLoader workers, the next run, the next ``pack`` of the same build) find the
shard still the same file and skip the hashing; a shard rewritten or replaced since no longer
matches and is hashed again. The change time moves on every write, ``touch`` or rename and
cannot be set from user space, so a shard overwritten in place with its modification time
put back (``touch -r``) is hashed again too. Checks that start together take turns on a file
lock, so one hashes while the others wait for its record. What this does not catch: bytes
changed in place by the disk itself, with no write through the filesystem (point
``$VARPACK_CACHE_DIR`` elsewhere to hash everything again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from pathlib import Path
from types import TracebackType

from schemas.errors import LinkError, WriteError
from schemas.io import atomic_write, cache_dir, make_own_dir, open_own
from schemas.manifest import Manifest, shards_digest

RECORD_DIR = "verified"


def record_path(manifest: Manifest) -> Path:
    """Where the verification of this build (its fingerprint and exact shard list) is recorded."""
    digest = shards_digest([dataclasses.asdict(s) for s in manifest.shards])
    return cache_dir() / RECORD_DIR / f"{manifest.fingerprint}-{digest[:16]}.json"


def disk_identity(stat: os.stat_result) -> tuple[int, int, int, int, int]:
    """A file's identity on disk: device, inode, size, modification and change time (ns).

    Any write, truncation, ``touch`` or rename changes it, and the change time cannot be set
    from user space; a file replaced by another has another inode.
    """
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class VerifiedShards:
    """The record of one build, held under its lock: ``unchanged(path, identity)`` says whether a shard
    was hashed whole and not rewritten since, ``add(path, identity)`` records one just hashed whole.

    Without a writable cache directory nothing is known and nothing recorded: every shard is
    hashed, as without a record.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.path: Path | None = record_path(manifest)
        self.known: dict[str, list[int]] = {}
        self.added = False
        self._lock_fd: int | None = None

    def __enter__(self) -> VerifiedShards:
        assert self.path is not None
        try:
            make_own_dir(self.path.parent)
            self._lock_fd = open_own(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
        except OSError:
            self.path = None
            return self
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            with os.fdopen(open_own(self.path, os.O_RDONLY), encoding="utf-8") as f:
                known = json.loads(f.read())
        except (OSError, ValueError):
            known = {}
        except LinkError:
            self.__exit__(None, None, None)
            raise
        self.known = known if isinstance(known, dict) else {}
        return self

    def unchanged(self, shard: Path, identity: tuple[int, int, int, int, int]) -> bool:
        """Whether ``shard``, whose identity on disk is ``identity`` now, is the very file that was hashed whole
        (same device, inode, size, mtime and ctime). The caller takes ``identity`` once and goes on with it."""
        return self.known.get(str(shard.resolve())) == list(identity)

    def add(self, shard: Path, identity: tuple[int, int, int, int, int]) -> None:
        """Record ``shard``, just hashed and found whole, with its identity on disk taken before it was hashed."""
        self.known[str(shard.resolve())] = list(identity)
        self.added = True

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self.added and self.path is not None:
                with contextlib.suppress(WriteError):
                    atomic_write(self.path, json.dumps(self.known))
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
