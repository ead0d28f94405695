"""Open time of a build with checksums verified: the first reader on a host against the ones after.

Packs one full shard of synthetic FLAN-shaped data (about 8M tokens, 40 MB) with the real
pipeline, then simulates a 1 GB and a 10 GB build by shard count: a manifest listing that shard
under N names (hard links, so the bytes are in the page cache: warm, as a rank that opens a
build another rank just read). The simulated build is of format 4, whose shards do not name
their place in a build (``schemas/shard_identity.py``), so one file can stand for many. For
each size, with an empty verification record:

- ``first_open_s``: ``PackedIterableDataset(build, verify_checksum=True)`` hashing every shard,
  what every rank paid on every open before verification was recorded;
- ``later_open_s``: the same call again, finding the record (the other ranks, the next run);
- ``unverified_open_s``: ``verify_checksum=False``, the floor;
- ``pack_first_reuse_s`` / ``pack_later_reuse_s``: ``pack``'s check of a finished build before
  reusing it (every shard's size and sha256), with an empty record and then with its own record:
  what every node of a job running ``pack`` before training pays.

The last line printed is one JSON object.

    python scripts/bench_verify.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from loaders import PackedIterableDataset  # noqa: E402
from pipeline.build import build  # noqa: E402
from pipeline.config import PackConfig  # noqa: E402
from pipeline.write.build_dir import reuse_problem  # noqa: E402
from pipeline.write.shard_writer import shard_name  # noqa: E402
from schemas import ROW_SCHEMA, file_sha256, read_manifest, write_manifest  # noqa: E402

GB = 1 << 30


def simulated_build(source: Path, directory: Path, target_bytes: int) -> int:
    """A format 4 build in ``directory`` of as many links to a copy of ``source``'s first shard, without its
    identity, as make ``target_bytes``; its shard count."""
    manifest = read_manifest(source)
    directory.mkdir(parents=True)
    copy = directory / "format-4-shard.arrow"
    table = pa.ipc.open_file(str(source / manifest.shards[0].path)).read_all().replace_schema_metadata(ROW_SCHEMA.metadata)
    with pa.OSFile(str(copy), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        writer.write_table(table, max_chunksize=table.num_rows)
    shard = dataclasses.replace(manifest.shards[0], sha256=file_sha256(copy), bytes=copy.stat().st_size)
    count = math.ceil(target_bytes / shard.bytes)
    shards = []
    for index in range(count):
        os.link(copy, directory / shard_name(index))
        shards.append(dataclasses.replace(shard, path=shard_name(index)))
    copy.unlink()
    rows = shard.rows * count
    stats = dataclasses.replace(manifest.stats, rows=rows, tokens=shard.tokens * count, capacity_tokens=rows * manifest.capacity)
    write_manifest(dataclasses.replace(manifest, shards=shards, stats=stats, format_version=4), directory)
    return count


def timed_open(directory: Path, verify_checksum: bool) -> float:
    started = time.perf_counter()
    PackedIterableDataset(directory, batch_rows=1, verify_checksum=verify_checksum)
    return time.perf_counter() - started


def timed_reuse_check(directory: Path) -> float:
    manifest = read_manifest(directory)
    started = time.perf_counter()
    problem = reuse_problem(manifest, str(directory))
    elapsed = time.perf_counter() - started
    if problem is not None:
        raise SystemExit(f"{directory}: {problem}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 10])
    parser.add_argument("--examples", type=int, default=28000, help="synthetic-flan examples to pack (one full shard)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["VARPACK_CACHE_DIR"] = str(tmp / "cache")
        packed = build(PackConfig(dataset="synthetic-flan", num_examples=args.examples, out=str(tmp / "out"),
                                  progress=False), log=lambda _: None)
        source = Path(packed.out_dir)
        results = {"shard_bytes": packed.manifest.shards[0].bytes, "sizes": []}
        for size in args.sizes_gb:
            directory = tmp / f"build-{size:g}gb"
            count = simulated_build(source, directory, int(size * GB))
            os.environ["VARPACK_CACHE_DIR"] = str(tmp / f"cache-loader-{size:g}")  # an empty record for each side
            first = timed_open(directory, verify_checksum=True)
            later = timed_open(directory, verify_checksum=True)
            unverified = timed_open(directory, verify_checksum=False)
            os.environ["VARPACK_CACHE_DIR"] = str(tmp / f"cache-pack-{size:g}")
            pack_first = timed_reuse_check(directory)
            pack_later = timed_reuse_check(directory)
            row = {"size_gb": size, "shards": count, "first_open_s": round(first, 3), "later_open_s": round(later, 3),
                   "unverified_open_s": round(unverified, 3), "later_over_first": round(later / first, 4),
                   "first_s_per_gb": round(first / size, 3), "pack_first_reuse_s": round(pack_first, 3),
                   "pack_later_reuse_s": round(pack_later, 3), "pack_later_over_first": round(pack_later / pack_first, 4)}
            print(json.dumps(row), flush=True)
            results["sizes"].append(row)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
