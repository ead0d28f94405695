"""Loader throughput: PackedIterableDataset against transformers' DataCollatorWithFlattening.

Builds a shard directory of FLAN-shaped examples (``pipeline.read.synthetic``'s ``synthetic-flan``
lengths, at most ``--capacity``; random token ids; a prompt-masked first part) with the real
packer and writer, then measures in one process, over shards in the page cache:

- ``tokens_per_s``: PackedIterableDataset (shuffled, ``--batch-rows`` rows per batch),
  iterated in-process, every batch collated into tensors; shard opening included.
- ``fixed_shape_tokens_per_s``: the same with ``pad_to_fixed_shape=True`` (real tokens only).
- ``flatten_collator_tokens_per_s``: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
  return_position_ids=True)`` on the same examples, shuffled, in batches of the same tokens
  per batch. It is handed ready Python lists (input_ids and prompt-masked labels), as a
  ``datasets`` row gives them, so reading the examples is not charged to it.

The last line printed is one JSON object.

    python scripts/bench_loader.py --examples 40000
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset  # noqa: E402
from pipeline.read.synthetic import SHAPES
from pipeline.write.random_build import random_token_build  # noqa: E402


def loader_run(directory: Path, batch_rows: int, epochs: int, fixed: bool) -> tuple[float, int]:
    """(seconds, batches) to iterate ``epochs`` shuffled epochs."""
    dataset = PackedIterableDataset(directory, batch_rows=batch_rows, verify_checksum=False, pad_to_fixed_shape=fixed)
    batches = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        for _ in dataset:
            batches += 1
    return time.perf_counter() - start, batches


def loader_tokens(directory: Path, batch_rows: int, epochs: int) -> int:
    """Real (unpadded) tokens the same epochs yield: the cu_seqlens totals of unpadded batches."""
    dataset = PackedIterableDataset(directory, batch_rows=batch_rows, verify_checksum=False)
    total = 0
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        total += sum(int(batch["cu_seq_lens_q"][-1]) for batch in dataset)
    return total


def collator_tokens_per_s(
    tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, tokens_per_batch: int, epochs: int, seed: int
) -> tuple[float, int]:
    """(tokens per second, tokens) for DataCollatorWithFlattening over the same examples."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    example_ends = np.cumsum(lengths)[:-1]
    features = [
        {"input_ids": ids.tolist(), "labels": np.where(mask == 1, ids, -100).tolist()}
        for ids, mask in zip(np.split(tokens, example_ends), np.split(loss_mask, example_ends))
    ]
    collated = 0
    elapsed = 0.0
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(lengths.size)
        ends = np.cumsum(lengths[order])
        cuts = np.searchsorted(ends, np.arange(tokens_per_batch, int(ends[-1]) + tokens_per_batch, tokens_per_batch), side="right")
        groups = [order[a:b] for a, b in zip(np.concatenate(([0], cuts[:-1])), cuts) if b > a]
        start = time.perf_counter()
        for group in groups:
            batch = collator([features[i] for i in group])
            collated += int(batch["cu_seq_lens_q"][-1])
        elapsed += time.perf_counter() - start
    return collated / elapsed, collated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=40000)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--batch-rows", type=int, default=16)
    parser.add_argument("--rows-per-shard", type=int, default=256, help="small shards, so the shuffle crosses several")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="shard directory (default: a temporary one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.out or tmp)
        start = time.perf_counter()
        flan = dataclasses.replace(SHAPES["synthetic-flan"], max_len=args.capacity)
        lengths = flan.lengths(np.random.default_rng(args.seed), args.examples)
        manifest, tokens, loss_mask = random_token_build(
            directory, lengths, args.capacity, args.rows_per_shard, vocab_size=32000, seed=args.seed
        )
        build_s = time.perf_counter() - start
        print(f"built {manifest.stats.examples} examples, {manifest.num_tokens} tokens, {manifest.num_rows} rows, "
              f"{len(manifest.shards)} shards in {build_s:.1f}s (fill {manifest.stats.fill:.4f})", file=sys.stderr)

        ours_tokens = loader_tokens(directory, args.batch_rows, args.epochs)
        ours_s, batches = loader_run(directory, args.batch_rows, args.epochs, fixed=False)
        fixed_s, _ = loader_run(directory, args.batch_rows, args.epochs, fixed=True)
        ours, fixed = ours_tokens / ours_s, ours_tokens / fixed_s
        reference, reference_tokens = collator_tokens_per_s(
            tokens, loss_mask, lengths, args.batch_rows * args.capacity, args.epochs, args.seed
        )

    result = {
        "tokens_per_s": round(ours),
        "flatten_collator_tokens_per_s": round(reference),
        "ratio": round(ours / reference, 2),
        "fixed_shape_tokens_per_s": round(fixed),
        "tokens_per_batch": args.batch_rows * args.capacity,
        "batch_rows": args.batch_rows,
        "capacity": args.capacity,
        "epochs": args.epochs,
        "loader_tokens": ours_tokens,
        "loader_batches": batches,
        "collator_tokens": reference_tokens,
        "examples": int(manifest.stats.examples),
        "shards": len(manifest.shards),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
