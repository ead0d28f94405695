"""Loader throughput: PackedIterableDataset against transformers' DataCollatorWithFlattening.

Builds a shard directory of FLAN-shaped examples (``pipeline.read.synthetic``'s ``synthetic-flan``
lengths, at most ``--capacity``; random token ids; a prompt-masked first part) with the real
packer and writer, then measures in one process, over shards in the page cache:

- ``tokens_per_s``: PackedIterableDataset (shuffled, ``--batch-rows`` rows per batch),
  iterated in-process, every batch collated into tensors; shard opening included.
- ``fixed_shape_tokens_per_s``: the same with ``pad_to_fixed_shape=True`` (real tokens only).
- ``mixture_tokens_per_s``: ``PackedMixture`` over the same examples cut into ``--mixture-sources``
  builds (weights 1, 2, 3, ...), at the same tokens per batch, and ``mixture_ratio``: it over
  ``setup_tokens_per_s``, the single build's loader timed the same way. Both count making the
  loader (reading the row index; the mixture also opens its shards and plans its first epoch)
  as well as iterating, since each does part of the other's work in its constructor; each is
  the best of ``--repeats`` runs. ``setup_s`` and ``mixture_setup_s``: the constructors alone.
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
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset, PackedMixture  # noqa: E402
from pipeline.read.synthetic import SHAPES  # noqa: E402
from pipeline.write.random_build import random_token_build  # noqa: E402


def loader_run(make: Callable[..., PackedIterableDataset], epochs: int, fixed: bool) -> tuple[float, float, int]:
    """(seconds to make the loader, seconds to iterate ``epochs`` shuffled epochs, batches)."""
    batches = 0
    start = time.perf_counter()
    dataset = make(verify_checksum=False, pad_to_fixed_shape=fixed)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        for _ in dataset:
            batches += 1
    return setup, time.perf_counter() - start, batches


def loader_tokens(make: Callable[..., PackedIterableDataset], epochs: int) -> int:
    """Real (unpadded) tokens the same epochs yield: the cu_seqlens totals of unpadded batches."""
    dataset = make(verify_checksum=False)
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
    parser.add_argument("--mixture-sources", type=int, default=3, help="builds the mixture run reads the examples from")
    parser.add_argument("--repeats", type=int, default=5, help="the loader and mixture runs: the best of this many")
    parser.add_argument("--out", default=None, help="shard directory (default: a temporary one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.out or tmp)
        start = time.perf_counter()
        flan = dataclasses.replace(SHAPES["synthetic-flan"], max_len=args.capacity)
        lengths = flan.lengths(np.random.default_rng(args.seed), args.examples)
        manifest, tokens, loss_mask = random_token_build(
            directory / "single", lengths, args.capacity, args.rows_per_shard, vocab_size=32000, seed=args.seed
        )
        sources = {f"part{i}": directory / f"part{i}" for i in range(args.mixture_sources)}
        weights = {name: i + 1 for i, name in enumerate(sources)}
        for path, part in zip(sources.values(), np.array_split(lengths, args.mixture_sources)):
            random_token_build(path, part, args.capacity, args.rows_per_shard, vocab_size=32000, seed=args.seed)
        build_s = time.perf_counter() - start
        print(f"built {manifest.stats.examples} examples, {manifest.num_tokens} tokens, {manifest.num_rows} rows, "
              f"{len(manifest.shards)} shards in {build_s:.1f}s (fill {manifest.stats.fill:.4f})", file=sys.stderr)

        single = functools.partial(PackedIterableDataset, directory / "single", batch_rows=args.batch_rows)
        mixture = functools.partial(PackedMixture, sources, weights=weights, batch_rows=args.batch_rows)
        ours_tokens = loader_tokens(single, args.epochs)
        mixture_tokens = loader_tokens(mixture, args.epochs)
        # Alternated, so that both see the same load on a shared machine; the fastest run of each counts.
        runs = [(loader_run(single, args.epochs, fixed=False), loader_run(mixture, args.epochs, fixed=False))
                for _ in range(args.repeats)]
        setup_s, ours_s, batches = min((one for one, _ in runs), key=lambda run: run[0] + run[1])
        mixture_setup_s, mixture_s, _ = min((mixed for _, mixed in runs), key=lambda run: run[0] + run[1])
        _, fixed_s, _ = loader_run(single, args.epochs, fixed=True)
        ours, fixed = ours_tokens / ours_s, ours_tokens / fixed_s
        mixed = mixture_tokens / (mixture_setup_s + mixture_s)
        ours_with_setup = ours_tokens / (setup_s + ours_s)
        reference, reference_tokens = collator_tokens_per_s(
            tokens, loss_mask, lengths, args.batch_rows * args.capacity, args.epochs, args.seed
        )

    result = {
        "tokens_per_s": round(ours),
        "flatten_collator_tokens_per_s": round(reference),
        "ratio": round(ours / reference, 2),
        "fixed_shape_tokens_per_s": round(fixed),
        "mixture_tokens_per_s": round(mixed),
        "setup_tokens_per_s": round(ours_with_setup),
        "mixture_ratio": round(mixed / ours_with_setup, 2),
        "mixture_sources": args.mixture_sources,
        "setup_s": round(setup_s, 3),
        "mixture_setup_s": round(mixture_setup_s, 3),
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
