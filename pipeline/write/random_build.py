"""A build of random token ids with given example lengths, written without a tokenizer: for tests and loader benchmarks."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from pipeline.write.shard_writer import ShardWriter
from schemas import BuildInputs, DatasetInputs, LossMasking, Manifest, Overflow, PackingAlgorithm, TokenizerInputs


def random_token_build(
    out_dir: str | os.PathLike[str],
    lengths: np.ndarray | list[int],
    capacity: int,
    rows_per_shard: int | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
    overflow: str = Overflow.SPLIT,
) -> tuple[Manifest, np.ndarray, np.ndarray]:
    """Write a build of examples of the given lengths made of random token ids in [1, vocab_size), packed with
    best-fit decreasing: ``(manifest, tokens, loss_mask)``, the examples back to back. The first part of each
    example (up to half of it; none for about a third of them) is a prompt, not trained on. For builds of a
    known shape without a tokenizer: tests and loader benchmarks."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    tokens = rng.integers(1, vocab_size, int(lengths.sum()), dtype=np.int32)
    prompt = (lengths * rng.uniform(0.0, 0.5, lengths.size) * (rng.random(lengths.size) > 0.3)).astype(np.int64)
    position = np.arange(tokens.size) - np.repeat(starts, lengths)
    loss_mask = (position >= np.repeat(prompt, lengths)).astype(np.uint8)
    inputs = BuildInputs(
        dataset=DatasetInputs(
            id="synthetic-random",
            split="train",
            content_hash=hashlib.sha256(tokens.tobytes() + loss_mask.tobytes()).hexdigest(),
            num_examples=int(lengths.size),
        ),
        tokenizer=TokenizerInputs(name="synthetic", content_hash=f"vocab-{vocab_size}", vocab_size=vocab_size),
        template="none",
        loss_masking=LossMasking.GIVEN,
        max_len=capacity,
        overflow=overflow,
        packing=PackingAlgorithm.BEST_FIT_DECREASING,
        seed=seed,
        package_version="0.1.0",
    )
    with ShardWriter(out_dir, inputs, rows_per_shard) as writer:
        writer.write_examples(tokens, lengths, loss_mask)
    return writer.manifest, tokens, loss_mask
