"""Packed evaluation against padded evaluation of the same examples, per-example losses compared.

Builds shards of FLAN-shaped examples (``pipeline.read.synthetic``'s ``synthetic-flan`` lengths, at
most ``--capacity``; random token ids) and a small random Llama, then measures in one process, on
the same examples:

- ``packed_tokens_per_s``: ``loaders.train.evaluate.evaluate_packed``, ``--batch-rows`` packed rows per
  forward, on the best attention backend here (``varpack_segments`` on CPU).
- ``padded_tokens_per_s``: the examples in source order, ``--padded-batch`` a batch, right-padded
  with an ``attention_mask`` (what a padding collator gives a Trainer's evaluation), transformers'
  sdpa, per-example loss from the logits.
- ``largest_loss_gap``: the largest |packed - padded| per-example loss (a check, not a speed).

The last line printed is one JSON object.

    python scripts/bench_eval.py --examples 2000
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
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.evaluate import evaluate_packed  # noqa: E402
from pipeline.read.synthetic import SHAPES
from pipeline.write.random_build import random_token_build  # noqa: E402


def small_llama(vocab: int, capacity: int, attn: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=capacity,
                                      attn_implementation=attn, use_cache=False)
    return transformers.LlamaForCausalLM(config).eval()


def padded_losses(model, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, batch: int) -> np.ndarray:
    """Per-example mean loss from right-padded batches with an attention mask, in source order."""
    ends = np.cumsum(lengths)[:-1]
    all_examples = list(zip(np.split(tokens, ends), np.split(loss_mask, ends)))
    losses = []
    with torch.no_grad():
        for first in range(0, len(all_examples), batch):
            examples = all_examples[first : first + batch]
            width = max(t.size for t, _ in examples)
            ids = torch.zeros(len(examples), width, dtype=torch.long)
            labels = torch.full((len(examples), width), -100, dtype=torch.long)
            mask = torch.zeros(len(examples), width, dtype=torch.long)
            for row, (tokens, loss_mask) in enumerate(examples):
                ids[row, : tokens.size] = torch.from_numpy(tokens.astype(np.int64))
                labels[row, : tokens.size] = torch.where(torch.from_numpy(loss_mask.astype(bool)), ids[row, : tokens.size], -100)
                mask[row, : tokens.size] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            per_token = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
            counts = (labels[:, 1:] != -100).sum(1)
            losses.extend((per_token.sum(1) / counts.clamp(min=1)).tolist())
    return np.array(losses)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--batch-rows", type=int, default=2)
    parser.add_argument("--padded-batch", type=int, default=8)
    args = parser.parse_args(argv)
    flan = dataclasses.replace(SHAPES["synthetic-flan"], max_len=args.capacity)
    lengths = flan.lengths(np.random.default_rng(0), args.examples)
    with tempfile.TemporaryDirectory() as tmp:
        _, example_tokens, loss_mask = random_token_build(tmp, lengths, args.capacity, vocab_size=1000, seed=0)
        tokens = int(lengths.sum())
        packed_model = small_llama(1000, args.capacity, attn_implementation_for("auto"))
        start = time.perf_counter()
        result = evaluate_packed(packed_model, tmp, batch_rows=args.batch_rows)
        packed_seconds = time.perf_counter() - start
        padded_model = small_llama(1000, args.capacity, "sdpa")
        start = time.perf_counter()
        padded = padded_losses(padded_model, example_tokens, loss_mask, lengths, args.padded_batch)
        padded_seconds = time.perf_counter() - start
    gap = float(np.max(np.abs(result.example_loss - padded)))
    record = {
        "examples": args.examples, "tokens": tokens, "capacity": args.capacity,
        "packed_tokens_per_s": tokens / packed_seconds, "padded_tokens_per_s": tokens / padded_seconds,
        "packed_vs_padded": padded_seconds / packed_seconds, "largest_loss_gap": gap,
        "attn": packed_model.config._attn_implementation, "batch_rows": args.batch_rows, "padded_batch": args.padded_batch,
    }
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
