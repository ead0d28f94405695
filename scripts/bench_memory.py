"""Peak memory of ``python -m pipeline.pack`` at two dataset sizes: does it grow with tokens or only with examples?

    python scripts/bench_memory.py [--dataset synthetic-flan] [--small 34000] [--factor 10]

Each size runs ``python -m pipeline.pack --dataset DATASET --num-examples N`` in a fresh
process (the default in-process runner) and reads its peak resident memory from the kernel
(``wait4``'s ``ru_maxrss``). The growth between the two sizes, divided by the examples added,
is the memory each example costs; tokens wait in spill files, so it should not depend on their
length. On the smaller size, the pipeline's tokens/s is compared with the tokenizers library's
raw ``encode_batch`` over the same texts in memory, measured in the same run.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.encode.tokenizer import load_tokenizer
from pipeline.read.synthetic import BLOCK_EXAMPLES, SHAPES, generate_block
from schemas import read_manifest

REPO = Path(__file__).resolve().parents[1]


def run_pack(dataset: str, examples: int, out: Path) -> dict:
    """Run one build in a fresh process: its peak RSS, wall time and manifest statistics."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "true"}
    args = [sys.executable, "-m", "pipeline.pack", "--dataset", dataset, "--num-examples", str(examples),
            "--out", str(out), "--no-progress"]
    started = time.perf_counter()
    process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"pack failed: {process.stderr.read().decode()[-2000:]}")
    (build,) = [p for p in out.iterdir() if p.is_dir()]
    stats = read_manifest(build).stats
    return {"examples": stats.examples, "tokens": stats.tokens, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "elapsed_s": round(elapsed, 2), "tokens_per_s": round(stats.tokens / elapsed)}


def raw_encode_rate(dataset: str, examples: int) -> float:
    """Tokens/s of ``encode_batch`` over the dataset's prompts and responses, texts in memory."""
    backend = load_tokenizer().backend()
    texts = []
    for b in range(-(-examples // BLOCK_EXAMPLES)):
        table = generate_block(SHAPES[dataset], b, min(BLOCK_EXAMPLES, examples - b * BLOCK_EXAMPLES))
        texts += table.column("prompt").to_pylist() + table.column("response").to_pylist()
    started = time.perf_counter()
    tokens = sum(len(e) for i in range(0, len(texts), 4096) for e in backend.encode_batch(texts[i : i + 4096], add_special_tokens=False))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="synthetic-flan", choices=sorted(SHAPES))
    parser.add_argument("--small", type=int, default=34_000, help="examples of the smaller build (default: %(default)s)")
    parser.add_argument("--factor", type=int, default=10, help="the larger build has this many times more (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = run_pack(args.dataset, args.small, Path(tmp) / "small")
        raw = raw_encode_rate(args.dataset, args.small)  # right after, under the same load
        print(json.dumps({"small": small, "raw_encode_batch_tokens_per_s": round(raw)}), flush=True)
        large = run_pack(args.dataset, args.small * args.factor, Path(tmp) / "large")
        print(json.dumps({"large": large}), flush=True)
    added = large["examples"] - small["examples"]
    growth = large["peak_rss_bytes"] - small["peak_rss_bytes"]
    print(json.dumps({
        "dataset": args.dataset,
        "small": small,
        "large": large,
        "rss_growth_bytes_per_example": round(growth / added, 1),
        "rss_growth_bytes_per_token": round(growth / (large["tokens"] - small["tokens"]), 3),
        "raw_encode_batch_tokens_per_s": round(raw),
        "pipeline_vs_encode_batch_small": round(small["tokens_per_s"] / raw, 3),
    }))


if __name__ == "__main__":
    main()
