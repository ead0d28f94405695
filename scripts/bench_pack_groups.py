"""What packing in K independent groups costs in fill, against one global best-fit decreasing.

    python scripts/bench_pack_groups.py [--dist flan] [--examples 5000000] [--max-len 4096]

The pipeline packs a dataset of N examples in K = ceil(N / EXAMPLES_PER_GROUP) groups of
consecutive examples (pipeline/packing/groups.py). This packs the same lengths as one group and as
K groups for several K, and prints the fill of each; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pipeline.packing.algorithms import pack
from pipeline.read.synthetic import SHAPES


def grouped_fill(lengths: np.ndarray, groups: int, capacity: int) -> tuple[float, int]:
    """Fill and rows when the lengths are packed in ``groups`` consecutive groups."""
    tokens = rows = 0
    for part in np.array_split(lengths, groups):
        stats = pack(part, capacity).stats
        tokens += stats.tokens
        rows += stats.rows
    return tokens / (rows * capacity), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", choices=["flan", "orcamath"], default="flan")
    parser.add_argument("--examples", type=int, default=5_000_000)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 5, 10, 50, 100, 500])
    args = parser.parse_args()
    shape = SHAPES[f"synthetic-{args.dist}"]
    lengths = shape.lengths(np.random.default_rng(0), args.examples)
    results = []
    for groups in args.groups:
        started = time.perf_counter()
        fill, rows = grouped_fill(lengths, groups, args.max_len)
        results.append({
            "groups": groups,
            "examples_per_group": args.examples // groups,
            "fill": round(fill, 7),
            "rows": rows,
            "seconds": round(time.perf_counter() - started, 2),
        })
        print(json.dumps(results[-1]))
    base = results[0]["fill"]
    for r in results:
        r["fill_cost_pct"] = round(100 * (base - r["fill"]), 5)
        r["extra_rows"] = r["rows"] - results[0]["rows"]
    print(json.dumps({"dist": args.dist, "examples": args.examples, "max_len": args.max_len, "results": results}))


if __name__ == "__main__":
    main()
