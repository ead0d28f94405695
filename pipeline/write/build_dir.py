"""The build directory's lifecycle: what belongs in it, whether a finished build can be reused,
clearing the way for a new build, removing what killed or failed runs left, and never a finished
build. The build's story (``pipeline/build.py``) calls these holding the build's lock
(``pipeline/write/lock.py``): the lock alone for anything that deletes.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from pipeline import storage
from pipeline.build_plan import BuildPlan
from pipeline.encode.bad_rows import REJECTED_NAME
from pipeline.errors import OutputDirError
from pipeline.packing import spill
from schemas import MANIFEST_NAME, Manifest, ManifestError, read_manifest, stream_sha256
from schemas.arrow_file import arrow_source
from schemas.io import temporary_target
from schemas.shard_identity import file_identity_problem
from schemas.verified import VerifiedShards, disk_identity

# The files a build writes: shards, the rejected rows, the manifest and the report figure.
BUILD_FILE = re.compile(r"^(shard-\d+\.arrow|manifest\.json|rejected\.jsonl|report\.png)$")
# At a URL each run writes its shards into its own attempt directory inside the build's.
ATTEMPT_PREFIX = "attempt-"


def is_build_file(name: str) -> bool:
    """Whether a build writes a file of this name, or its temporary while writing it."""
    return BUILD_FILE.match(temporary_target(name) or name) is not None


def read_build_manifest(out_dir: str) -> Manifest:
    """The validated manifest of the build in ``out_dir``, local or at a URL."""
    return read_manifest(storage.join(out_dir, MANIFEST_NAME), storage.read_bytes)


def reuse_problem(manifest: Manifest, out_dir: str) -> str | None:
    """Why a finished build cannot be reused (a file missing, truncated, failing its checksum, or not
    the shard of this build its place in the manifest says: ``schemas/shard_identity.py``), or None.

    A local build's shards are hashed once per host (``schemas/verified.py``): a shard this host
    hashed whole before, and that is still the same file, is not hashed again. A shard's schema is
    read from its bytes (mapped, or downloaded), never through a Python file object that pyarrow's
    threads would read (``schemas.shard_identity.file_identity_problem``).
    """
    if manifest.rejected is not None and manifest.rejected.rows and not storage.exists(storage.join(out_dir, REJECTED_NAME)):
        return f"{REJECTED_NAME} is missing"
    record = None if storage.is_url(out_dir) else VerifiedShards(manifest)
    with record or contextlib.nullcontext():
        for index, shard in enumerate(manifest.shards):
            path = storage.join(out_dir, shard.path)
            if not storage.exists(path):
                return f"{shard.path} is missing"
            if (size := storage.size(path)) != shard.bytes:
                return f"{shard.path} is {size} bytes, the manifest says {shard.bytes}"
            if record is None:
                source = arrow_source(path)  # downloaded once: hashed, then its footer read, in memory
                if stream_sha256(source) != shard.sha256:
                    return f"{shard.path} fails its checksum (the file is corrupt)"
                source.seek(0)
            elif (problem := _hash_unless_recorded(Path(path), shard.sha256, record)) is not None:
                return f"{shard.path} {problem}"
            else:
                source = arrow_source(path)  # mapped
            if (problem := file_identity_problem(source, manifest, index)) is not None:
                return f"{shard.path} {problem}"
    return None


def _hash_unless_recorded(path: Path, sha256: str, record: VerifiedShards) -> str | None:
    """Why the local shard at ``path`` fails its checksum, or None; hashed unless ``record`` holds it unchanged.

    Its identity on disk is taken once, on the open file, before it is hashed: a shard rewritten while it is
    hashed is not recorded as verified (with the identity of the rewrite), it fails."""
    with storage.open_read(str(path)) as f:
        before = disk_identity(os.fstat(f.fileno()))
        if record.unchanged(path, before):
            return None
        if stream_sha256(f) != sha256:
            return "fails its checksum (the file is corrupt)"
        if disk_identity(os.fstat(f.fileno())) != before:
            return "was changed on disk while it was hashed"
    record.add(path, before)
    return None


def build_files(plan: BuildPlan) -> list[str]:
    """The names of the files in the build directory.

    Raises OutputDirError when ``--out`` is itself a build directory, or when the build
    directory holds files varpack did not write.
    """
    out, out_dir = plan.config.out, plan.out_dir
    if storage.exists(storage.join(out, MANIFEST_NAME)):
        raise OutputDirError(f"--out {out} is itself a shard directory (it holds {MANIFEST_NAME}); pass its parent directory")
    names = storage.list_files(out_dir)
    subdirs = [d for d in storage.list_subdirs(out_dir) if not d.startswith(spill.SPILL_PREFIX)]
    foreign = [n for n in names if not is_build_file(n)] + [f"{d}/" for d in subdirs]
    if foreign:
        raise OutputDirError(
            f"{out_dir} holds files varpack did not write ({', '.join(foreign[:3])}); move them away and run again"
        )
    return names


def reusable(plan: BuildPlan) -> Manifest | None:
    """The manifest of a finished build of ``plan`` whose every file checks out, or None; only reads."""
    if MANIFEST_NAME not in build_files(plan):
        return None
    try:
        manifest = read_build_manifest(plan.out_dir)
    except ManifestError:
        return None
    if manifest.fingerprint != plan.fingerprint or reuse_problem(manifest, plan.out_dir) is not None:
        return None
    return manifest


def check_output(plan: BuildPlan, log: Callable[[str], None]) -> Manifest | None:
    """The manifest of a finished build to reuse, or None after clearing the way for a new build.

    A local build directory is only ever checked, and cleared, by the run holding its lock.
    Reuse verifies every shard's size and checksum, and removes what killed runs left beside
    the build; a build that fails is rebuilt. Raises
    OutputDirError when ``--out`` is itself a build directory, when the build directory holds
    another fingerprint's build (without ``--force``) or files varpack did not write.
    """
    out_dir, force = plan.out_dir, plan.config.force
    local = not storage.is_url(out_dir)
    names = build_files(plan)
    # Before anything is deleted or written in it: a link planted there, or another user's directory, is refused.
    storage.make_own_dir(out_dir)
    problem = None
    keep: tuple[str, ...] = ()
    if MANIFEST_NAME in names:
        try:
            manifest = read_build_manifest(out_dir)
        except ManifestError as err:
            problem = f"its manifest is unreadable ({err})"
        else:
            if manifest.fingerprint != plan.fingerprint and not force:
                raise OutputDirError(
                    f"{out_dir} holds the shards of another build (fingerprint {manifest.fingerprint}, expected "
                    f"{plan.fingerprint}); move it away, or pass --force to replace it"
                )
            if force and manifest.fingerprint == plan.fingerprint and local:
                # Same inputs, same bytes: each shard is replaced by a rename, so a loader reading it meanwhile goes on.
                log(f"--force: rebuilding {out_dir} in place")
                remove_leftovers(out_dir)
                return None
            problem = "--force" if force else reuse_problem(manifest, out_dir)
            if problem is None:
                if local:
                    remove_leftovers(out_dir, log)
                return manifest
        if not local and not force:
            raise OutputDirError(f"{out_dir} cannot be reused: {problem}; pass --force to build it again")
        log(f"rebuilding {out_dir}: {problem}")
    elif names and local:
        keep = previous_rejected(names, out_dir, log)
        if len(names) > len(keep):
            log(f"removing {len(names) - len(keep)} leftover files of an interrupted run from {out_dir}")
    if local:
        remove_leftovers(out_dir)
        clear_build(out_dir, keep)
    elif problem is not None:
        # No lock at a URL: only the manifest goes, so the next manifest published wins; attempts stay.
        storage.remove([storage.join(out_dir, MANIFEST_NAME)])
    return None


def previous_rejected(names: list[str], out_dir: str, log: Callable[[str], None]) -> tuple[str, ...]:
    """``(REJECTED_NAME,)`` when ``names``, a build directory without a manifest, hold the rows an earlier run of the
    build rejected (one that wrote no build: every row bad, or stopped), which are kept until this run lists its own."""
    if REJECTED_NAME not in names:
        return ()
    log(f"keeping {storage.join(out_dir, REJECTED_NAME)}, the rows rejected by an earlier run that wrote no build, "
        "until this run lists its own")
    return (REJECTED_NAME,)


def clear_build(out_dir: str, keep: tuple[str, ...] = ()) -> None:
    """Remove the files of a build but ``keep`` (the manifest first, so no manifest ever points at missing shards)."""
    names = [n for n in storage.list_files(out_dir) if is_build_file(n) and n not in keep]
    names.sort(key=lambda n: n != MANIFEST_NAME)
    storage.remove([storage.join(out_dir, n) for n in names])


def leftovers(out_dir: str) -> list[str]:
    """The names of the temporary files and spill directories that runs killed in the middle left in a local build directory."""
    spills = [d for d in storage.list_subdirs(out_dir) if d.startswith(spill.SPILL_PREFIX)]
    return [n for n in storage.list_files(out_dir) if temporary_target(n) is not None] + spills


def remove_leftovers(out_dir: str, log: Callable[[str], None] | None = None) -> None:
    """Remove ``leftovers(out_dir)``; only while holding the build's lock alone, so no live run's files go."""
    found = leftovers(out_dir)
    if found and log is not None:
        log(f"removing {len(found)} leftover files of interrupted runs from {out_dir}")
    for name in found:
        path = storage.join(out_dir, name)
        if name.startswith(spill.SPILL_PREFIX):
            spill.remove_spill(path)
        else:
            storage.remove([path])


def discard(out_dir: str, shard_dir: str, keep: tuple[str, ...] = ()) -> None:
    """Remove what a failed run wrote but ``keep``, never a finished build: with a manifest present, only temporaries."""
    storage.check_own_dir(out_dir)
    if shard_dir != out_dir:
        storage.remove([storage.join(shard_dir, n) for n in storage.list_files(shard_dir)])
    elif storage.exists(storage.join(out_dir, MANIFEST_NAME)):
        remove_leftovers(out_dir)
    else:
        clear_build(out_dir, keep)
        storage.remove_empty_dir(out_dir)


def has_figure(out_dir: str) -> bool:
    """Whether the build holds its report figure (one made with --no-report, or without matplotlib, does not)."""
    from pipeline.report.figures import REPORT_NAME

    return storage.exists(storage.join(out_dir, REPORT_NAME))


def needs_lock_alone(plan: BuildPlan, wants_figure: bool) -> bool:
    """Whether reusing the build means writing in its directory: removing what killed runs left, or writing
    its missing figure. Not in a place this run cannot write to, where neither can happen."""
    if not os.access(plan.config.out, os.W_OK) or not os.access(plan.out_dir, os.W_OK):
        return False
    return bool(leftovers(plan.out_dir)) or (wants_figure and not has_figure(plan.out_dir))
