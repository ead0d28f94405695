"""Where a build lives: a local directory, or a URL (``schemas.storage``) whose shards are cached locally.

A local path (or ``file://`` URL) is read in place. Any other URL (``s3://``, ``gs://``,
``memory://``, ...) is copied shard by shard into ``<cache_dir>/<fingerprint>-<shards_digest>/``,
once: a later run finds the copies there and reuses them after checking their size and (unless
``verify_checksum=False``) checksum; a copy that fails is fetched again. The directory is
named by the content of the build (``shards_digest`` covers every shard's sha256), not by its
fingerprint alone, so another build that claims the same fingerprint with other bytes never
gets this one's copies, nor they its.
Every copy is verified against the manifest before it is renamed into place, so a reader
never sees a partial or corrupt file, and concurrent ranks copying the same shard are safe.
A copy cut off (the store stopped, the connection dropped) is started again with a pause
that doubles each time, then ends in a one-line StorageError; it never leaves a file behind.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import warnings
from dataclasses import dataclass
from pathlib import Path

from loaders.shard_reader import check_open_shard, check_shard_file
from schemas import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ShardError,
    ShardInfo,
    atomic_write,
    cache_dir,
    read_manifest,
)
from schemas import storage
from schemas.io import atomic_file, make_own_dir, make_own_subdirs
from schemas.manifest import shards_digest


@dataclass(frozen=True)
class BuildLocation:
    """A build's manifest and shard directory: local paths, or URLs."""

    source: str  # as the user gave it, for messages
    root: str  # the directory shard paths are relative to
    manifest_path: str

    @property
    def is_local(self) -> bool:
        return not storage.is_url(self.root)

    def read_manifest(self) -> Manifest:
        """Load and validate the manifest."""
        return read_manifest(self.manifest_path)

    def local_shards(
        self, manifest: Manifest, cache_root: str | os.PathLike[str] | None, verify_checksum: bool
    ) -> list[Path]:
        """Local paths of every shard, copying remote ones into the cache first.

        Local shards are returned as they are (``open_shard`` checks them). A cached copy is
        reused when its size (and checksum, when ``verify_checksum``) matches the manifest; a
        fresh copy is always checksummed before it is renamed into place.
        """
        if self.is_local:
            return [Path(self.root) / shard.path for shard in manifest.shards]
        directory = make_own_dir(Path(cache_root if cache_root is not None else cache_dir()) / cache_name(manifest))
        paths = [self._cached_copy(shard, directory, verify_checksum) for shard in manifest.shards]
        manifest_copy = directory / MANIFEST_NAME
        if not manifest_copy.is_file():
            atomic_write(manifest_copy, manifest.to_json())
        return paths

    def _cached_copy(self, shard: ShardInfo, directory: Path, verify_checksum: bool) -> Path:
        """The cached copy of ``shard``: reused when it checks out, else fetched and verified."""
        path = make_own_subdirs(directory, shard.path) / posixpath.basename(shard.path)  # no link on the way followed
        if path.is_file() and not path.is_symlink():  # a link is no copy of varpack's: replaced below
            try:
                check_shard_file(path, shard, verify_checksum)
                return path
            except ShardError:
                pass  # a stale or damaged copy: fetch it again below
        url = storage.join(self.root, shard.path)
        with atomic_file(path) as copy:
            try:
                storage.download(url, copy)
            except FileNotFoundError as err:
                raise ShardError(url, "shard file is missing at the source; rebuild the shards or fix the URL") from err
            try:
                check_open_shard(copy, path, shard)
            except ShardError as err:
                raise ShardError(
                    url, f"the copy does not match the manifest ({err}); the source shard is corrupt, rebuild it"
                ) from err
        return path


def cache_name(manifest: Manifest) -> str:
    """The name of the cache directory of a remote build's copies: its fingerprint and the digest of its shard list."""
    return f"{manifest.fingerprint}-{shards_digest([dataclasses.asdict(s) for s in manifest.shards])}"


def locate(source: str | os.PathLike[str]) -> BuildLocation:
    """Where the build named by ``source`` lives: a shard directory or a manifest path, local or a URL.

    A directory without a manifest that holds builds (the ``--out`` of ``pipeline.pack``) stands
    for its build when it holds one, with a warning; with several, ManifestError lists them.
    """
    text = os.fspath(source)
    path = storage.local_path(text)
    if not storage.is_url(path):
        local = Path(path).absolute()
        if not local.is_dir():
            return BuildLocation(text, str(local.parent), str(local))
        path = str(local)
    else:
        path = path.rstrip("/")
        if path.endswith(".json"):
            return BuildLocation(text, storage.parent(path), path)
    build = _only_build(path, text)
    if build != path:
        text = build
    return BuildLocation(text, build, posixpath.join(build, MANIFEST_NAME))


def _only_build(directory: str, source: str) -> str:
    """``directory`` itself, or the one build it holds when it has no manifest of its own."""
    if storage.exists(posixpath.join(directory, MANIFEST_NAME)):
        return directory
    builds = sorted(storage.parent(m) for m in storage.glob(posixpath.join(directory, "*", MANIFEST_NAME)))
    if not builds:
        return directory
    names = [posixpath.join(source.rstrip("/"), posixpath.basename(b)) for b in builds]
    if len(builds) > 1:
        raise ManifestError(
            f"{source}: no manifest here; this directory holds {len(builds)} builds ({', '.join(names)}): pass one of them"
        )
    warnings.warn(f"{source} holds no manifest but one build; using {names[0]}", stacklevel=3)
    return builds[0]

