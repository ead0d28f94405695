"""Opening a build as a Hugging Face Dataset: ``to_hf_dataset`` against ``datasets.load_dataset("arrow", ...)``.

Writes a build of FLAN-shaped random-token examples with ShardWriter, then in one process:

- ``to_hf_dataset``: the Dataset over the memory-mapped shards (manifest read, shards checked
  against it and the row schema); seconds, and bytes Arrow allocated for it.
- ``load_dataset``: ``datasets.load_dataset("arrow", data_files=shards, split="train")`` into an
  empty cache directory, what a user would otherwise write; seconds, and bytes it wrote to
  its cache.
- Both then sum ``num_tokens`` over every row, to show the rows are there.

The last line printed is one JSON object.

    python scripts/bench_interop.py --examples 200000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.interop import shard_paths, to_hf_dataset  # noqa: E402
from pipeline.read.synthetic import SHAPES
from pipeline.write.random_build import random_token_build  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        build, cache = Path(tmp) / "build", Path(tmp) / "hf-cache"
        flan = dataclasses.replace(SHAPES["synthetic-flan"], max_len=args.capacity)
        lengths = flan.lengths(np.random.default_rng(args.seed), args.examples)
        manifest, _, _ = random_token_build(build, lengths, args.capacity, vocab_size=32000, seed=args.seed)
        shard_bytes = sum(s.bytes for s in manifest.shards)

        allocated = pa.total_allocated_bytes()
        start = time.perf_counter()
        ours = to_hf_dataset(build)
        ours_s = time.perf_counter() - start
        ours_allocated = pa.total_allocated_bytes() - allocated
        ours_tokens = sum(ours.data.table.column("num_tokens").to_pylist())

        start = time.perf_counter()
        theirs = datasets.load_dataset("arrow", data_files=shard_paths(build), split="train", cache_dir=str(cache))
        theirs_s = time.perf_counter() - start
        theirs_tokens = sum(theirs.data.table.column("num_tokens").to_pylist())
        cache_bytes = directory_bytes(cache)

    result = {
        "to_hf_dataset_s": round(ours_s, 3),
        "load_dataset_s": round(theirs_s, 3),
        "speedup": round(theirs_s / ours_s, 1),
        "to_hf_dataset_allocated_bytes": ours_allocated,
        "load_dataset_cache_bytes": cache_bytes,
        "shard_bytes": shard_bytes,
        "rows": manifest.num_rows,
        "tokens": manifest.num_tokens,
        "same_tokens": ours_tokens == theirs_tokens == manifest.num_tokens,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
