"""Training throughput on one GPU: varpack shards against what users do today, in one run.

On the same model (Llama, random init, bf16 weights, FlashAttention-2 kernels) and the same
examples, at the same real tokens per optimizer step:

1. ``padded``: batches padded to the longest example, with ``attention_mask``
   (transformers' ``flash_attention_2``);
2. ``flatten``: the reference, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
   (transformers' ``flash_attention_2``);
3. ours: ``PackedIterableDataset`` batches of ``--rows-per-step`` rows, measured three ways:
   ``ours_fa2`` (transformers' ``flash_attention_2``), ``ours_eager`` (varpack's registered
   ``varpack_fa2``, same kernel, no per-forward host sync) and, with ``--compile``,
   ``ours_compiled`` (``pad_to_fixed_shape`` and per-layer ``torch.compile``); the fastest is mode 3;
4. ``ours_budget``: ``--budget-rows`` rows per step, chosen for throughput, run the way the
   fastest mode 3 ran.

Same data: mode 3's first ``--warmup-steps`` and next ``--timed-steps`` batches form a warm-up
and a timed window; modes 1 and 2 train on exactly the examples of each window (cut out of the
batches by ``cu_seq_lens``), shuffled and cut into as many steps of equal real tokens; mode 4's
windows are the same rows in fewer, larger steps. Throughput counts real (non-pad) tokens
over the timed window; peak memory is that of the whole mode, model and optimizer included.
Every mode starts from the same initial weights.

``--convergence-steps N`` instead trains modes 1 and 3 for N steps on identical data per step
(mode 1's batch is mode 3's batch cut back into its examples and padded) and writes the loss
per step (per trained token, the same average in both) to ``--convergence-csv``.
The last line printed is one JSON object.

    python scripts/bench_train.py --shards flan=shards/flan --shards orcamath=shards/orcamath \
        --compile --out benchmarks/bench_train_h200.json
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset  # noqa: E402
from loaders.attention import attn_implementation_for  # noqa: E402
from schemas import read_manifest  # noqa: E402
from train import compile_layers, linear_warmup, loss_tokens, real_tokens  # noqa: E402

Batch = dict[str, torch.Tensor | int]
DEVICE = torch.device("cuda")


@dataclass
class BenchConfig:
    """One benchmark run; the CLI maps onto it one to one."""

    shards: list[str] = field(default_factory=list)  # name=directory
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    rows_per_step: int = 2
    budget_rows: int = 8
    # Mode 1 splits a step into micro-batches (gradient accumulation) above this many padded tokens.
    padded_token_cap: int = 49152
    warmup_steps: int = 8
    timed_steps: int = 48
    lr: float = 3e-4
    warmup_lr_steps: int = 20
    compile: bool = False
    convergence_steps: int = 0
    convergence_csv: str = ""
    seed: int = 0
    out: str = ""


def make_model(config: BenchConfig, vocab_size: int, attn_implementation: str):
    """A Llama of the configured size, random init from the seed, bf16, on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=8192,
        use_cache=False,
    )
    torch.manual_seed(config.seed)
    with DEVICE:
        model = LlamaForCausalLM(model_config)
    model = model.to(torch.bfloat16)
    model.config._attn_implementation = attn_implementation
    model.train()
    return model


# ---- the steps of each mode ---------------------------------------------------------------


def to_device(batch: dict) -> Batch:
    return {k: v.to(DEVICE, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class Step:
    """One optimizer step's micro-batches, its real tokens and its trained (loss) tokens."""

    micro_batches: list[Batch]
    real_tokens: int
    loss_tokens: int


def packed_steps(source: str, config: BenchConfig, batch_rows: int, fixed_shape: bool) -> Iterator[Step]:
    """Modes 3 and 4: PackedIterableDataset batches of ``batch_rows`` rows, epoch after epoch."""
    dataset = PackedIterableDataset(source, batch_rows=batch_rows, shuffle=True, seed=config.seed, pad_to_fixed_shape=fixed_shape)
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        for batch in dataset:
            yield Step([to_device(batch)], real_tokens(batch), loss_tokens(batch))
        epoch += 1


def examples_of(batches: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The examples (tokens, unshifted labels) in loader batches, cut out by ``cu_seq_lens``."""
    tokens, labels = [], []
    for batch in batches:
        bounds = batch["cu_seq_lens_q"].tolist()
        ids, lab = batch["input_ids"][0].numpy(), batch["labels"][0].numpy()
        end_of_data = real_tokens(batch)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a < b <= end_of_data:
                tokens.append(ids[a:b])
                labels.append(lab[a:b])
    return tokens, labels


def padded_micro_batches(tokens: list[np.ndarray], labels: list[np.ndarray], cap: int) -> list[Batch]:
    """Right-padded batches with attention_mask; split in order so that none exceeds ``cap`` padded tokens."""
    batches, start = [], 0
    while start < len(tokens):
        end, longest = start, 0
        while end < len(tokens) and (end == start or max(longest, tokens[end].size) * (end - start + 1) <= cap):
            longest = max(longest, tokens[end].size)
            end += 1
        ids = np.zeros((end - start, longest), dtype=np.int64)
        lab = np.full((end - start, longest), -100, dtype=np.int64)
        att = np.zeros((end - start, longest), dtype=np.int64)
        for row, i in enumerate(range(start, end)):
            n = tokens[i].size
            ids[row, :n], lab[row, :n], att[row, :n] = tokens[i], labels[i], 1
        batches.append(to_device({"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab),
                                  "attention_mask": torch.from_numpy(att)}))
        start = end
    return batches


def baseline_step(mode: str, tokens: list[np.ndarray], labels: list[np.ndarray], collator, cap: int) -> Step:
    """One step of mode 1 (``padded``) or 2 (``flatten``: the collator gets lists, as from datasets)."""
    if mode == "padded":
        micro = padded_micro_batches(tokens, labels, cap)
    else:
        micro = [to_device(collator([{"input_ids": t.tolist(), "labels": l.tolist()} for t, l in zip(tokens, labels)]))]
    loss = sum(int((x[1:] != -100).sum()) for x in labels)
    return Step(micro, sum(t.size for t in tokens), loss)


def baseline_steps(mode: str, windows: list[list[dict]], config: BenchConfig) -> Iterator[Step]:
    """Modes 1 and 2 over exactly the examples of mode 3's windows (warm-up, timed): each
    window's examples shuffled and cut into as many steps of equal real tokens."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = np.random.default_rng([config.seed, 7])
    for window in windows:
        tokens, labels = examples_of(window)
        order = rng.permutation(len(tokens))
        ends = np.cumsum([tokens[i].size for i in order])
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, len(window)) / len(window)) + 1
        for step in np.split(order, cuts):
            yield baseline_step(mode, [tokens[i] for i in step], [labels[i] for i in step], collator, config.padded_token_cap)


# ---- training ----------------------------------------------------------------------------


def train_step(model, optimizer, scheduler, step: Step) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, then one optimizer step; the loss
    (per trained token, averaged over the whole step) stays on the GPU."""
    num_items = torch.tensor(step.loss_tokens, device=DEVICE, dtype=torch.float32)
    total = torch.zeros((), device=DEVICE)
    for batch in step.micro_batches:
        loss = model(**batch, num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def make_optimizer(model, config: BenchConfig):
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=True)
    return optimizer, linear_warmup(optimizer, config.warmup_lr_steps)


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def measure(name: str, steps: Iterator[Step], warmup: int, timed: int, config: BenchConfig, vocab_size: int,
            attn_implementation: str, compiled: bool) -> dict:
    """Train ``warmup`` then ``timed`` steps; real tokens/s over the timed ones, peak memory of all."""
    free_gpu()
    model = make_model(config, vocab_size, attn_implementation)
    if compiled:
        compile_layers(model)
    optimizer, scheduler = make_optimizer(model, config)
    start = time.perf_counter()
    for step in itertools.islice(steps, warmup):
        train_step(model, optimizer, scheduler, step)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    real = trained = 0
    losses = []
    start = time.perf_counter()
    for step in itertools.islice(steps, timed):
        losses.append(train_step(model, optimizer, scheduler, step))
        real += step.real_tokens
        trained += step.loss_tokens
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "mode": name,
        "attn_implementation": attn_implementation,
        "compiled": compiled,
        "tokens_per_s": real / elapsed,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "real_tokens_per_step": real / timed,
        "loss_tokens_per_step": trained / timed,
        "step_ms": 1000 * elapsed / timed,
        "warmup_s": warmup_s,
        "mean_loss_timed": float(torch.stack(losses).mean()),
    }
    print(json.dumps(result), flush=True)
    del model, optimizer, scheduler
    free_gpu()
    return result


def bench_dataset(source: str, config: BenchConfig) -> dict:
    """Modes 1-4 on one shard directory; ratios 3/1, 3/2 and 4/2."""
    manifest = read_manifest(source)
    if manifest.stats.examples_split:
        raise ValueError(f"{source}: {manifest.stats.examples_split} examples are split across rows; modes 1 and 2 "
                         "need whole examples: rebuild with a max_len of at least the longest example")
    if config.budget_rows % config.rows_per_step or (config.warmup_steps * config.rows_per_step) % config.budget_rows \
            or (config.timed_steps * config.rows_per_step) % config.budget_rows:
        raise ValueError("--budget-rows must divide the rows of the warm-up and timed windows and be a multiple of --rows-per-step")
    vocab_size = manifest.inputs.tokenizer.vocab_size
    w, t = config.warmup_steps, config.timed_steps
    first = list(itertools.islice(PackedIterableDataset(source, batch_rows=config.rows_per_step, shuffle=True, seed=config.seed), w + t))
    windows = [first[:w], first[w:]]
    fa2 = "flash_attention_2"
    ours = attn_implementation_for("flash_attn")
    rows = config.rows_per_step

    def run(name: str, steps: Iterator[Step], implementation: str, compiled: bool, scale: int = 1) -> dict:
        return measure(name, steps, w // scale, t // scale, config, vocab_size, implementation, compiled)

    results = {
        "padded": run("padded", baseline_steps("padded", windows, config), fa2, False),
        "flatten": run("flatten", baseline_steps("flatten", windows, config), fa2, False),
        "ours_fa2": run("ours_fa2", packed_steps(source, config, rows, False), fa2, False),
        "ours_eager": run("ours_eager", packed_steps(source, config, rows, False), ours, False),
    }
    if config.compile:
        try:
            results["ours_compiled"] = run("ours_compiled", packed_steps(source, config, rows, True), ours, True)
        except Exception as err:  # reported in the JSON; mode 3 is then the fastest eager run
            results["ours_compiled"] = {"mode": "ours_compiled", "error": repr(err)[:1000]}
            print(json.dumps(results["ours_compiled"]), flush=True)
            free_gpu()
    best = max((k for k in results if k.startswith("ours") and "tokens_per_s" in results[k]), key=lambda k: results[k]["tokens_per_s"])
    mode3 = results[best]
    scale = config.budget_rows // rows
    results["ours_budget"] = run("ours_budget", packed_steps(source, config, config.budget_rows, mode3["compiled"]),
                                 mode3["attn_implementation"], mode3["compiled"], scale)
    padded, flatten, budget = results["padded"], results["flatten"], results["ours_budget"]
    return {
        "dataset": manifest.inputs.dataset.id,
        "tokenizer": manifest.inputs.tokenizer.name,
        "capacity": manifest.capacity,
        "fill": manifest.stats.fill,
        "mode3": best,
        "modes": results,
        "ratio_3_1": mode3["tokens_per_s"] / padded["tokens_per_s"],
        "mem_ratio_3_1": mode3["peak_mem_gib"] / padded["peak_mem_gib"],
        "ratio_3_2": mode3["tokens_per_s"] / flatten["tokens_per_s"],
        "mem_ratio_3_2": mode3["peak_mem_gib"] / flatten["peak_mem_gib"],
        "ratio_4_2": budget["tokens_per_s"] / flatten["tokens_per_s"],
    }


def unpack_to_padded(step: Step, cap: int) -> Step:
    """Mode 1's version of a mode 3 step: the same examples, cut out by cu_seq_lens and padded."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in step.micro_batches[0].items()}
    tokens, labels = examples_of([cpu])
    return Step(padded_micro_batches(tokens, labels, cap), step.real_tokens, step.loss_tokens)


def convergence(source: str, config: BenchConfig) -> dict:
    """Modes 1 and 3 for ``convergence_steps`` on identical data per step; loss per step to CSV."""
    manifest = read_manifest(source)
    vocab_size = manifest.inputs.tokenizer.vocab_size
    rows: list[dict] = []
    summary = {}
    for mode in ("ours", "padded"):
        free_gpu()
        implementation = attn_implementation_for("flash_attn") if mode == "ours" else "flash_attention_2"
        compiled = config.compile and mode == "ours"
        model = make_model(config, vocab_size, implementation)
        if compiled:
            compile_layers(model)
        optimizer, scheduler = make_optimizer(model, config)
        steps = packed_steps(source, config, config.rows_per_step, compiled)
        losses, tokens = [], []
        start = time.perf_counter()
        for step in itertools.islice(steps, config.convergence_steps):
            if mode == "padded":
                step = unpack_to_padded(step, config.padded_token_cap)
            losses.append(train_step(model, optimizer, scheduler, step))
            tokens.append(step.real_tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        values = torch.stack(losses).float().cpu().tolist()
        rows += [{"mode": mode, "step": i + 1, "loss": v, "real_tokens": n} for i, (v, n) in enumerate(zip(values, tokens))]
        summary[mode] = {"attn_implementation": implementation, "compiled": compiled, "seconds": elapsed,
                         "mean_loss_last20": float(np.mean(values[-20:])),
                         "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        print(json.dumps({"convergence": mode, **summary[mode]}), flush=True)
        del model, optimizer, scheduler
    if config.convergence_csv:
        Path(config.convergence_csv).parent.mkdir(parents=True, exist_ok=True)
        with open(config.convergence_csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["mode", "step", "loss", "real_tokens"])
            writer.writeheader()
            writer.writerows(rows)
    diff = np.abs(np.array([r["loss"] for r in rows if r["mode"] == "ours"]) - np.array([r["loss"] for r in rows if r["mode"] == "padded"]))
    return {
        "dataset": manifest.inputs.dataset.id,
        "steps": config.convergence_steps,
        "real_tokens_per_step": float(np.mean([r["real_tokens"] for r in rows])),
        "max_abs_loss_diff": float(diff.max()),
        "mean_abs_loss_diff_last50": float(diff[-50:].mean()),
        "modes": summary,
    }


def parse_args(argv: list[str] | None) -> BenchConfig:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", action="append", required=True, help="name=directory (repeatable)")
    for name, value in asdict(defaults).items():
        if name == "shards":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return BenchConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    sources = dict(item.split("=", 1) for item in config.shards)
    import transformers

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "config": asdict(config)}
    if config.convergence_steps:
        result = {**meta, "convergence": convergence(next(iter(sources.values())), config)}
    else:
        result = {**meta, "datasets": {name: bench_dataset(src, config) for name, src in sources.items()}}
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
