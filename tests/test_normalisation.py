"""One loss normalisation across ranks and micro-batches, in ``scripts/train.py`` (both loops).

An optimizer step's loss is its loss summed over every loss token (or loss weight) of all ranks
and micro-batches, divided by their global count. Two gloo ranks with two micro-batches each
(``torchrun``) then log the same loss, step after step, as one process accumulating the same four
batches, although the ranks' batches hold different counts: a per-rank mean (transformers #34191)
or a mean of micro-batch means (axolotl #3196) would not. ``--loss-reduction token`` and
``sequence``, a single build and a mixture, the plain loop and ``PackedTrainer``. On a mixture the
plain loop's lines also log each source's tokens and loss over every rank, as one process does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset, PackedMixture, load_mixture_file
from loaders.loss_weights import batch_normalizer

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "train.py"
MODEL = "llama:hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1"
RANKS, ACCUM, STEPS = 2, 2, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """A single build, and a mixture file of two builds with other length profiles (same vocabulary)."""
    root = tmp_path_factory.mktemp("normalisation")
    rng = np.random.default_rng(3)
    builds = {name: build_shard_dir(root / name, rng.integers(low, high, 120), capacity=128, vocab_size=128, seed=seed).path
              for seed, (name, low, high) in enumerate((("short", 4, 30), ("long", 20, 120)))}
    (root / "mixture.json").write_text(json.dumps({"sources": {name: str(path) for name, path in builds.items()},
                                                   "weights": {"short": 0.6, "long": 0.4}}))
    return {"shards": str(builds["short"]), "mixture": str(root / "mixture.json")}


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())}


def rank_batches(source: str, option: str, rank: int, reduction: str) -> list[dict]:
    """The first micro-batches of ``rank`` of RANKS, read as train.py reads them."""
    options = dict(batch_rows=2, shuffle=True, seed=0, loss_reduction=reduction, rank=rank, world_size=RANKS)
    dataset = (PackedMixture(**load_mixture_file(source), **options) if option == "--mixture"
               else PackedIterableDataset(source, **options))
    return [batch for _, batch in zip(range(ACCUM * STEPS), dataset)]


CASES = [("plain", "token", "--shards"), ("plain", "sequence", "--mixture"),
         ("hf", "token", "--shards"), ("hf", "sequence", "--mixture")]


@pytest.mark.parametrize("trainer,reduction,option", CASES)
def test_two_ranks_of_two_micro_batches_log_the_loss_of_one_process(data, tmp_path, trainer, reduction, option):
    from test_train import load_script

    source = data[option.removeprefix("--")]
    # The ranks' steps hold different normalisers, so a per-rank or per-micro-batch mean would differ.
    per_rank = [[batch_normalizer(b) for b in rank_batches(source, option, rank, reduction)] for rank in range(RANKS)]
    first = [sum(counts[:ACCUM]) for counts in per_rank]
    assert abs(first[0] - first[1]) > 0.05 * max(first), per_rank
    step = [count for counts in per_rank for count in counts[:ACCUM]]
    assert max(step) - min(step) > 0.1 * max(step), per_rank

    common = [option, source, "--random-init", MODEL, "--attn", "sdpa_segments", "--precision", "fp32", "--lr", "1e-2",
              "--batch-rows", "2", "--log-every", "1", "--max-steps", str(STEPS), "--trainer", trainer,
              "--loss-reduction", reduction]
    load_script().main([*common, "--grad-accum", str(RANKS * ACCUM), "--out", str(tmp_path / "one")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
               str(SCRIPT), *common, "--grad-accum", str(ACCUM), "--out", str(tmp_path / "ranks")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    one, ranks = records(tmp_path / "one"), records(tmp_path / "ranks")
    assert sorted(ranks) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert ranks[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), (step, ranks, one)
        if option == "--mixture" and trainer == "plain":
            # Each line's tokens and loss per source cover every rank and micro-batch since the last line.
            assert ranks[step]["source_tokens"] == one[step]["source_tokens"], step
            assert ranks[step]["source_loss"] == pytest.approx(one[step]["source_loss"], rel=1e-5), step

