"""The user's path against the benchmark: ``train.py`` and ``PackedTrainer`` as documented, and
``bench_train``'s best mode, on the same build, model and tokens per step, in one call.

Three runs, one after the other, each in its own process so that one holds the card at a time:

1. ``bench_train.py`` with ``--bench-mode`` (default ``ours_buckets_head_stepgraph``, the best mode
   at about 8k tokens a step), ``--repeats`` alternating repetitions: the median tokens/s;
2. ``train.py`` with ``--train-flags`` (default ``--compile --step-graph --precision bf16-weights``)
   for ``--steps`` steps, logged every ``--log-every``;
3. ``train.py --trainer hf`` (``PackedTrainer``) with ``--trainer-flags`` (default ``--compile
   --step-graph --precision bf16-weights``), the same steps and logs.

``--runs`` picks 2, 3 or both (default both).

Each logged window of 2 and 3 is compared with 1 (``vs_bench``); ``train_py_vs_bench`` and
``trainer_vs_bench`` are the median over the windows after the first, which holds the
compilation, the prewarm and the captures. The benchmark keeps its weights and AdamW state in bf16, so the
default flags do too (``--precision bf16-weights``); train.py's default, fp32 weights under bf16 autocast,
is measured by leaving that out of the flags.

    python scripts/bench_user_path.py --shards BUILD --out benchmarks/bench_user_path_h200.json

Without CUDA the flags must leave out what needs it (``--bench-mode ours_eager --train-flags ''
--trainer-flags ''``): a smoke run at a tiny size. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


@dataclass
class UserPathConfig:
    """One comparison; the CLI maps onto it one to one."""

    shards: str = ""
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    tie_word_embeddings: bool = False
    batch_rows: int = 2
    steps: int = 300
    log_every: int = 50
    lr: float = 3e-4
    warmup_lr_steps: int = 20
    bench_mode: str = "ours_buckets_head_stepgraph"
    bench_warmup_steps: int = 8
    bench_timed_steps: int = 40
    repeats: int = 3
    num_workers: int = 2
    vocab_multiple: int = 64  # both sides' model vocabulary: the build's rounded up to a multiple of this (bench_train's)
    train_flags: str = "--compile --step-graph --precision bf16-weights"
    trainer_flags: str = "--compile --step-graph --precision bf16-weights"
    runs: str = "train_py,trainer"
    out: str = ""


def random_init_spec(config: UserPathConfig) -> str:
    """train.py's ``--random-init`` for bench_train's model, its vocabulary padded as bench_train pads it."""
    from schemas import read_manifest

    vocab_size = -(-read_manifest(config.shards).inputs.tokenizer.vocab_size // config.vocab_multiple) * config.vocab_multiple
    values = {"vocab_size": vocab_size, "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
              "num_key_value_heads": config.num_kv_heads, "max_position_embeddings": 8192,
              "tie_word_embeddings": str(config.tie_word_embeddings).lower()}
    return "llama:" + ",".join(f"{key}={value}" for key, value in values.items())


def run(command: list[str]) -> str:
    """Run ``command`` with this checkout importable; its stdout, or SystemExit with its last error lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"bench_user_path.py: {shlex.join(command[1:3])} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def bench(config: UserPathConfig, workdir: Path) -> dict:
    """bench_train's mode on the build: median tokens/s, range and peak memory over the repetitions."""
    out = workdir / "bench.json"
    model = ["--hidden-size", str(config.hidden_size), "--intermediate-size", str(config.intermediate_size),
             "--num-layers", str(config.num_layers), "--num-heads", str(config.num_heads),
             "--num-kv-heads", str(config.num_kv_heads), *(["--tie-word-embeddings"] if config.tie_word_embeddings else [])]
    run([sys.executable, str(SCRIPTS / "bench_train.py"), "--shards", f"build={config.shards}", *model,
         "--rows-per-step", str(config.batch_rows), "--budget-rows", "0", "--modes", config.bench_mode,
         "--warmup-steps", str(config.bench_warmup_steps), "--timed-steps", str(config.bench_timed_steps),
         "--repeats", str(config.repeats), "--num-workers", str(config.num_workers), "--lr", str(config.lr),
         "--vocab-multiple", str(config.vocab_multiple),
         "--warmup-lr-steps", str(config.warmup_lr_steps), "--out", str(out)])
    result = json.loads(out.read_text())
    mode = result["datasets"]["build"]["cells"]["small"]["modes"][config.bench_mode]
    if "tokens_per_s" not in mode:
        raise SystemExit(f"bench_user_path.py: bench_train's {config.bench_mode} failed: {mode.get('error')}")
    return {"mode": config.bench_mode, "tokens_per_s": mode["tokens_per_s"], "tokens_per_s_range": mode["tokens_per_s_range"],
            "peak_mem_gib": mode["peak_mem_gib"], "repetitions": mode["repetitions"], "config": result["config"]}


def user_run(config: UserPathConfig, workdir: Path, name: str, flags: str, bench_tokens_per_s: float) -> dict:
    """train.py (``--trainer`` plain or hf) for the steps: its command and each logged window against the benchmark."""
    out = workdir / name
    options = ["--random-init", random_init_spec(config), "--batch-rows", str(config.batch_rows),
               "--max-steps", str(config.steps), "--log-every", str(config.log_every), "--lr", str(config.lr),
               "--warmup-steps", str(config.warmup_lr_steps), *(["--trainer", "hf"] if name == "trainer" else []),
               *shlex.split(flags)]
    run([sys.executable, str(SCRIPTS / "train.py"), "--shards", config.shards, *options, "--out", str(out)])
    windows, last = [], 0
    for line in (out / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "tokens_per_s" not in record:
            continue
        window = {"steps": [last + 1, record["step"]], "tokens_per_s": record["tokens_per_s"],
                  "peak_mem_gib": record["peak_mem_gib"], "vs_bench": record["tokens_per_s"] / bench_tokens_per_s}
        if "step_graphs" in record:
            window["step_graphs"] = record["step_graphs"]
        windows.append(window)
        last = record["step"]
    return {"command": shlex.join(["python", "scripts/train.py", "--shards", "BUILD", *options]), "windows": windows}


def after_warm_up(run_result: dict) -> tuple[float | None, list[float] | None]:
    """The median and range of ``vs_bench`` over the windows after the first (which holds the warm-up)."""
    ratios = [window["vs_bench"] for window in run_result["windows"][1:]]
    if not ratios:
        return None, None
    return statistics.median(ratios), [min(ratios), max(ratios)]


def parse_args(argv: list[str] | None) -> UserPathConfig:
    defaults = UserPathConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value), default=value, required=name == "shards")
    config = UserPathConfig(**vars(parser.parse_args(argv)))
    if config.vocab_multiple < 1:
        parser.error(f"--vocab-multiple {config.vocab_multiple}: give a whole number of at least 1 (1 keeps the tokenizer's)")
    if not config.runs or not set(config.runs.split(",")) <= {"train_py", "trainer"}:
        parser.error(f"--runs {config.runs!r}: choose train_py, trainer or both, comma-separated")
    if config.steps < 2 * config.log_every:
        parser.error(f"--steps {config.steps} gives fewer than two windows of --log-every {config.log_every}: the first "
                     "holds the warm-up")
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    import torch

    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "config": asdict(config),
                    "tokens_per_step": f"{config.batch_rows} rows a step"}
    def keep() -> None:
        """Write what is measured so far: a run stopped at its time limit keeps it."""
        if config.out:
            Path(config.out).parent.mkdir(parents=True, exist_ok=True)
            Path(config.out).write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        result["bench"] = bench(config, workdir)
        keep()
        reference = result["bench"]["tokens_per_s"]
        for name, flags in (("train_py", config.train_flags), ("trainer", config.trainer_flags)):
            if name not in config.runs.split(","):
                continue
            result[name] = user_run(config, workdir, name, flags, reference)
            result[f"{name}_vs_bench"], result[f"{name}_vs_bench_range"] = after_warm_up(result[name])
            keep()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
