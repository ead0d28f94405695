"""Every benchmark under scripts/ runs at its smallest size and ends with one JSON line holding its anchor.

A benchmark that no longer runs (a renamed function, a changed default, a failing assertion)
fails here instead of on the day someone needs its numbers. These are smoke runs: the figures
are not checked, only that the comparison against the anchor was made.
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

REPO = Path(__file__).resolve().parents[1]

# script, its smallest arguments, the anchor fields its last JSON line must hold.
BENCHES = [
    ("bench_eval.py", ["--examples", "8", "--capacity", "128", "--batch-rows", "2", "--padded-batch", "4"],
     ["padded_tokens_per_s", "packed_vs_padded"]),
    ("bench_interop.py", ["--examples", "200", "--capacity", "512"], ["load_dataset_s", "speedup"]),
    ("bench_loader.py", ["--examples", "300", "--capacity", "1024", "--batch-rows", "2", "--rows-per-shard", "16",
                         "--epochs", "1"], ["flatten_collator_tokens_per_s", "ratio"]),
    ("bench_memory.py", ["--small", "50", "--factor", "2"], ["raw_encode_batch_tokens_per_s", "pipeline_vs_encode_batch_small"]),
    ("bench_pack.py", ["--examples", "2000", "--repeats", "1", "--slow-repeats", "1"], ["sequential_fill", "speedup_vs_sequential"]),
    ("bench_pack_groups.py", ["--examples", "2000", "--groups", "1", "2"], ["results"]),
    ("bench_verify.py", ["--examples", "300", "--sizes-gb", "0.001"], ["sizes"]),
]


# A tiny Llama, as bench_train.py and bench_user_path.py take its shape.
TINY_LLAMA = ["--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The benchmarks' ``$VARPACK_CACHE_DIR`` (not the user's), one for the module: a tokenizer is converted once."""
    return tmp_path_factory.mktemp("cache")


def run_bench(script: str, args: list[str], tmp_path: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "VARPACK_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("script", "args", "anchors"), BENCHES, ids=[b[0] for b in BENCHES])
def test_bench_runs_and_reports_its_anchor(script: str, args: list[str], anchors: list[str], tmp_path: Path,
                                           cache: Path) -> None:
    result = run_bench(script, args, tmp_path, cache)
    missing = [key for key in anchors if key not in result]
    assert not missing, f"{script}'s last JSON line lacks {missing}: {sorted(result)}"


@pytest.fixture(scope="module")
def random_build(tmp_path_factory) -> Path:
    """Whole examples of random tokens from a vocabulary of 1000, which keeps the LM head as tiny as the layers, in rows
    of 1024 tokens; the benchmarks read it and leave it as it is."""
    lengths = np.random.default_rng(0).integers(50, 1000, 120)
    return build_shard_dir(tmp_path_factory.mktemp("shards"), lengths, capacity=1024, vocab_size=1000, overflow="drop").path


@pytest.fixture(scope="module")
def eager_against_flatten(random_build, tmp_path_factory, cache) -> dict:
    """bench_train.py's last JSON line: the eager reference (``flatten``) against varpack's eager mode on
    ``random_build``, two repetitions each, one DataLoader worker."""
    return run_bench("bench_train.py", [
        "--shards", f"random={random_build}", *TINY_LLAMA, "--rows-per-step", "1", "--budget-rows", "0",
        "--warmup-steps", "1", "--timed-steps", "1", "--repeats", "2", "--num-workers", "1", "--modes", "flatten,ours_eager",
    ], tmp_path_factory.mktemp("bench-train"), cache)


def test_bench_train_runs_on_cpu_and_compares_with_the_best_reference(eager_against_flatten: dict) -> None:
    """bench_train's harness (DataLoader workers, one process per mode, alternating repetitions, each building and
    freeing its model) on a tiny Llama on the CPU: the eager reference against varpack's eager mode."""
    result = eager_against_flatten
    cell = result["headline"]["random/small"]
    assert (cell["best_reference"], cell["best_ours"]) == ("flatten", "ours_eager")
    assert cell["best_speed_vs_best_reference"] > 0
    modes = result["datasets"]["random"]["cells"]["small"]["modes"]
    assert [run["repetition"] for run in modes["ours_eager"]["runs"]] == [0, 1]
    # Each repetition builds its model from the initial weights and frees it at its end (one mode's memory on the
    # card at a time): the repetitions train alike.
    for mode in ("flatten", "ours_eager"):
        first, second = modes[mode]["runs"]
        assert second["mean_loss_timed"] == pytest.approx(first["mean_loss_timed"], rel=1e-5), mode
        assert first["mem_left_gib"] == second["mem_left_gib"] == 0.0
    # Same examples in every mode: the same real tokens per step.
    assert modes["flatten"]["runs"][0]["real_tokens_per_step"] == modes["ours_eager"]["runs"][0]["real_tokens_per_step"]


def test_bench_train_trains_lora_adapters_in_every_mode(random_build, eager_against_flatten, tmp_path: Path,
                                                      cache: Path) -> None:
    """``--lora-rank``: every mode trains only LoRA adapters on every linear layer but the LM head (peft), and the
    model FLOPs count the frozen weights' forward and input gradient (4 per weight) rather than 6: against the same
    model trained in full on the same build (``eager_against_flatten``)."""
    pytest.importorskip("peft")
    lora = run_bench("bench_train.py", [
        "--shards", f"random={random_build}", *TINY_LLAMA, "--rows-per-step", "1", "--budget-rows", "0",
        "--warmup-steps", "1", "--timed-steps", "1", "--repeats", "1", "--num-workers", "0",
        "--modes", "flatten,ours_eager", "--lora-rank", "2",
    ], tmp_path, cache)
    full_run = eager_against_flatten["datasets"]["random"]["cells"]["small"]["modes"]["ours_eager"]["runs"][0]
    modes = lora["datasets"]["random"]["cells"]["small"]["modes"]
    # One layer: q, k, v, o (32 x 32 with 2 KV heads of 16: k and v are 16 x 32), gate, up (64 x 32), down (32 x 64),
    # each with A (2 x in) and B (out x 2).
    shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)]
    adapters = sum(2 * i + o * 2 for o, i in shapes)
    for mode in ("flatten", "ours_eager"):
        run = modes[mode]["runs"][0]
        assert run["trained_parameters"] == adapters, mode
    layers = sum(o * i for o, i in shapes)
    head = 1024 * 32  # the build's 1000 tokens padded to a multiple of 64 (--vocab-multiple's default)
    assert full_run["flops_per_token"] - modes["ours_eager"]["runs"][0]["flops_per_token"] == pytest.approx(
        6 * (layers + head) - 4 * (layers + head) - 6 * adapters)


def test_bench_pipeline_reports_scaling_against_datasets_and_trl(tmp_path: Path, cache: Path) -> None:
    """bench_pipeline at its smallest: a sweep over 1 and 2 local workers, a DaskRunner build on a 1-worker cluster and
    datasets + TRL on the same examples, each with its tokens/s and its workers' peak RSS, in one JSON line."""
    pytest.importorskip("trl")
    pytest.importorskip("distributed")
    result = run_bench("bench_pipeline.py", ["--workers", "1,2", "--examples-per-worker", "150", "--examples", "300",
                                             "--dask-workers", "1", "--baseline-procs", "2"], tmp_path, cache)
    assert sorted(result["workers"]) == ["1", "2"]
    assert result["workers"]["1"]["efficiency"] == 1.0
    for run in [*result["workers"].values(), result["direct_full"], result["dask"], result["datasets_trl"]]:
        assert run["tokens_per_s"] > 0 and run["peak_rss_worker_bytes"] > 0
    assert result["direct_full"]["examples"] == result["dask"]["examples"] == result["datasets_trl"]["examples"] == 300
    assert result["efficiency"] == result["workers"]["2"]["efficiency"]
    assert result["vs_datasets_trl"] == round(result["datasets_trl"]["wall_s"] / result["direct_full"]["wall_s"], 4)


def test_bench_user_path_compares_both_documented_commands_with_the_benchmark(random_build, tmp_path: Path,
                                                                              cache: Path) -> None:
    """bench_user_path.py on the CPU at a tiny size: train.py and PackedTrainer (train.py --trainer hf) run as
    documented, each logged window against bench_train's mode on the same build and model, and the comparison is
    made from the windows after the first."""
    result = run_bench("bench_user_path.py", [
        "--shards", str(random_build), *TINY_LLAMA, "--batch-rows", "1", "--steps", "4", "--log-every", "2",
        "--bench-mode", "ours_eager", "--bench-warmup-steps", "1", "--bench-timed-steps", "1", "--repeats", "1",
        "--num-workers", "0", "--train-flags", "", "--trainer-flags", "",
    ], tmp_path, cache)
    assert result["bench"]["mode"] == "ours_eager" and result["bench"]["tokens_per_s"] > 0
    for name in ("train_py", "trainer"):
        windows = result[name]["windows"]
        assert [w["steps"] for w in windows] == [[1, 2], [3, 4]], name
        assert result[f"{name}_vs_bench"] == pytest.approx(windows[1]["tokens_per_s"] / result["bench"]["tokens_per_s"])
    assert "--trainer hf" in result["trainer"]["command"] and "--trainer" not in result["train_py"]["command"]
    # Both sides build the model bench_train builds: the build's 1000 tokens padded to a multiple of 64.
    assert all("vocab_size=1024," in result[name]["command"] for name in ("train_py", "trainer"))
