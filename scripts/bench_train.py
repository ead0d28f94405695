"""Training throughput on one GPU: varpack shards against what users do today, in one run.

On the same model (Llama, random init, bf16 weights, FlashAttention-2 kernels) and the same
examples, at two step sizes (``--rows-per-step`` rows, about 8k real tokens, and
``--budget-rows`` rows, about 32k), every mode trains on the same examples per cell:

- ``padded``: batches padded to the longest example, with ``attention_mask`` (transformers'
  ``flash_attention_2``); small steps only (mode 1);
- ``flatten``: the reference, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
  eager (transformers' ``flash_attention_2``; mode 2, "eager reference");
- ``flatten_compiled_fa2`` / ``flatten_compiled_varpack``: the same batches with every decoder
  layer under ``torch.compile(dynamic=True)``, with transformers' ``flash_attention_2`` or
  varpack's registered ``varpack_fa2``; the faster is the "compiled reference" (mode 2c);
- ``ours_*``: ``PackedIterableDataset`` batches, eager on exact shapes (``ours_eager``) or with
  per-layer ``torch.compile`` on exact shapes (``ours_exact_*``, dynamic after the first change),
  on fixed shapes padded to the worst case (``ours_fixed*``) or to buckets (``ours_buckets*``:
  ``bucket_shapes=True``, prewarmed so no bucket compiles again); ``_head``: the loss-position
  LM head (``loaders.train.loss_head``); ``_graphs``: per-layer CUDA graphs (``mode="reduce-overhead"``)
  on the single worst-case shape; ``_stepgraph``: the whole step (forward, backward, clipping,
  optimizer) as one CUDA graph per bucketed shape (``loaders.train.step_graph``), every shape of the
  run captured during the warm-up. The fastest is varpack's best mode.

Same data: the loader's first warm-up and timed batches of each step size form the two windows;
the reference modes train on exactly the examples of each window (cut out of the batches by
``cu_seq_lens``), shuffled and cut into as many steps of equal real tokens. Throughput counts
real (non-pad) tokens over the timed window; peak memory is that of the whole mode, model and
optimizer included; warm-up time (compilation included) is that of the warm-up window, and
``graphs_compiled_timed`` counts compilations inside the timed window (0 when warm). MFU is
model FLOPs per real token (``FLOP_FORMULA``, the same for every mode of a cell) times
tokens/s over the dense bf16 peak. Every mode starts from the same initial weights.
``--profile`` adds one profiled step per mode: GPU time by kernel group and the GPU's idle time.

``--convergence-steps N`` instead trains modes 1 and ``--convergence-mode`` for N steps on
identical data per step (mode 1's batch is the packed batch cut back into its examples and
padded) and writes the loss per step (per trained token, the same average in both) to
``--convergence-csv``. The last line printed is one JSON object.

    python scripts/bench_train.py --shards flan=shards/flan --shards orcamath=shards/orcamath \
        --out benchmarks/bench_train_h200_flan.json
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset  # noqa: E402
from loaders.collate import NUM_LOSS_TOKENS, NUM_REAL_TOKENS  # noqa: E402
from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.loss_head import use_loss_position_head  # noqa: E402
from loaders.train.models import (  # noqa: E402
    compile_layers,
    count_on_device,
    linear_warmup,
    model_inputs,
    peak_memory_gib,
    prewarm_buckets,
)
from loaders.train.step_graph import GraphedStep  # noqa: E402
from schemas import read_manifest  # noqa: E402

Batch = dict[str, torch.Tensor | int]
DEVICE = torch.device("cuda")
MAX_GRAD_NORM = 1.0
# NVIDIA H200 SXM, dense bf16 tensor-core peak (datasheet).
PEAK_BF16_FLOPS = 989.4e12
FLOP_FORMULA = ("flops_per_token = 6 * N_matmul + 6 * L * d_attn * sum(n_i^2) / sum(n_i): N_matmul = the weights "
                "of every nn.Linear (decoder layers and LM head over all tokens; embeddings excluded), L layers, "
                "d_attn = query heads x head dim, n_i the length of each example (causal attention, forward and "
                "backward, half the square); the same model FLOPs for every mode, so the loss-position head's "
                "skipped logits are not credited")
FA2 = "flash_attention_2"
DEFAULT_MODES = ("padded,flatten,flatten_compiled_fa2,flatten_compiled_varpack,ours_eager,ours_fixed,"
                 "ours_buckets_head,ours_exact_head,ours_fixed_head_graphs,ours_buckets_head_stepgraph")
DEFAULT_BUDGET_MODES = ("flatten,flatten_compiled_fa2,flatten_compiled_varpack,ours_fixed,ours_buckets_head,"
                        "ours_exact_head,ours_fixed_head_graphs,ours_buckets_head_stepgraph")


@dataclass(frozen=True)
class Mode:
    """How one mode builds its batches and runs the model."""

    data: str  # padded | flatten | packed
    attn: str = "varpack"  # varpack (varpack_fa2) | fa2 (transformers' flash_attention_2)
    compiled: bool = False
    shapes: str = "exact"  # packed batches: exact | fixed (worst case) | buckets
    loss_head: bool = False
    cuda_graphs: bool = False
    step_graph: bool = False  # the whole step as one CUDA graph per shape (loaders.train.step_graph)

    @property
    def attn_implementation(self) -> str:
        return FA2 if self.attn == "fa2" else attn_implementation_for("flash_attn")


MODES = {
    "padded": Mode("padded", "fa2"),
    "flatten": Mode("flatten", "fa2"),
    "flatten_compiled_fa2": Mode("flatten", "fa2", compiled=True),
    "flatten_compiled_varpack": Mode("flatten", compiled=True),
    "ours_eager": Mode("packed"),
    "ours_fixed": Mode("packed", compiled=True, shapes="fixed"),
    "ours_buckets": Mode("packed", compiled=True, shapes="buckets"),
    "ours_fixed_head": Mode("packed", compiled=True, shapes="fixed", loss_head=True),
    "ours_buckets_head": Mode("packed", compiled=True, shapes="buckets", loss_head=True),
    "ours_exact_head": Mode("packed", compiled=True, shapes="exact", loss_head=True),
    "ours_fixed_head_graphs": Mode("packed", compiled=True, shapes="fixed", loss_head=True, cuda_graphs=True),
    "ours_buckets_head_stepgraph": Mode("packed", compiled=True, shapes="buckets", loss_head=True, step_graph=True),
}
# Kernel groups of a profiled step, matched on the lower-cased kernel name, first match wins.
KERNEL_GROUPS = (
    ("attention", ("flash", "fmha")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cross_entropy", ("softmax", "nll_loss", "logsumexp", "cross_entropy")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")),
    ("fused_elementwise", ("triton",)),
)


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
    budget_rows: int = 8  # 0: no large-step cell
    modes: str = DEFAULT_MODES
    budget_modes: str = DEFAULT_BUDGET_MODES
    # Mode 1 splits a step into micro-batches (gradient accumulation) above this many padded tokens.
    padded_token_cap: int = 49152
    warmup_steps: int = 8
    timed_steps: int = 40
    budget_warmup_steps: int = 6
    budget_timed_steps: int = 16
    lr: float = 3e-4
    warmup_lr_steps: int = 20
    profile: bool = False
    convergence_steps: int = 0
    convergence_mode: str = "ours_buckets_head"
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


def flops_per_token(model, config: BenchConfig, mean_square_length: float) -> float:
    """FLOP_FORMULA for ``model`` on examples whose sum(n^2) / sum(n) is ``mean_square_length``."""
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    d_attn = config.num_heads * (config.hidden_size // config.num_heads)
    return 6 * matmul_params + 6 * config.num_layers * d_attn * mean_square_length


# ---- the steps of each mode ---------------------------------------------------------------


def to_device(batch: dict, full_logits: bool = True) -> Batch:
    """``model_inputs`` on the GPU, tensors pinned and copied without waiting for it, as a DataLoader with
    pin_memory=True does."""
    pinned = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model_inputs(pinned, DEVICE, full_logits)


@dataclass
class Step:
    """One optimizer step's micro-batches, its real tokens and its trained (loss) tokens."""

    micro_batches: list[Batch]
    real_tokens: int
    loss_tokens: int


def packed_dataset(source: str, config: BenchConfig, batch_rows: int, shapes: str = "exact") -> PackedIterableDataset:
    return PackedIterableDataset(source, batch_rows=batch_rows, shuffle=True, seed=config.seed,
                                 pad_to_fixed_shape=shapes != "exact", bucket_shapes=shapes == "buckets")


def packed_steps(source: str, config: BenchConfig, batch_rows: int, mode: Mode) -> Iterator[Step]:
    """Our modes: PackedIterableDataset batches of ``batch_rows`` rows, epoch after epoch, as the model takes them."""
    dataset = packed_dataset(source, config, batch_rows, mode.shapes)
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        for batch in dataset:
            yield Step([to_device(batch, full_logits=not mode.loss_head)], batch[NUM_REAL_TOKENS], batch[NUM_LOSS_TOKENS])
        epoch += 1


def examples_of(batches: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The examples (tokens, unshifted labels) in loader batches, cut out by ``cu_seq_lens``."""
    tokens, labels = [], []
    for batch in batches:
        bounds = batch["cu_seq_lens_q"].tolist()
        ids, lab = batch["input_ids"][0].numpy(), batch["labels"][0].numpy()
        end_of_data = batch[NUM_REAL_TOKENS]
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


def baseline_step(data: str, tokens: list[np.ndarray], labels: list[np.ndarray], collator, cap: int) -> Step:
    """One step of mode 1 (``padded``) or 2 (``flatten``: the collator gets lists, as from datasets)."""
    if data == "padded":
        micro = padded_micro_batches(tokens, labels, cap)
    else:
        micro = [to_device(collator([{"input_ids": t.tolist(), "labels": y.tolist()} for t, y in zip(tokens, labels)]))]
    loss = sum(int((x[1:] != -100).sum()) for x in labels)
    return Step(micro, sum(t.size for t in tokens), loss)


def baseline_steps(data: str, windows: list[list[dict]], config: BenchConfig) -> Iterator[Step]:
    """The reference modes over exactly the examples of the loader's windows (warm-up, timed):
    each window's examples shuffled and cut into as many steps of equal real tokens."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = np.random.default_rng([config.seed, 7])
    for window in windows:
        tokens, labels = examples_of(window)
        order = rng.permutation(len(tokens))
        ends = np.cumsum([tokens[i].size for i in order])
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, len(window)) / len(window)) + 1
        for step in np.split(order, cuts):
            yield baseline_step(data, [tokens[i] for i in step], [labels[i] for i in step], collator, config.padded_token_cap)


# ---- training ----------------------------------------------------------------------------


def train_step(model, optimizer, scheduler, step: Step, mode: Mode, graphed: GraphedStep | None = None) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, then one optimizer step; the loss
    (per trained token, averaged over the whole step) stays on the GPU. With ``graphed``, the
    step (one micro-batch) is a CUDA graph replay."""
    if graphed is not None:
        (batch,) = step.micro_batches
        loss = graphed(batch, step.loss_tokens)
        scheduler.step()
        return loss
    if mode.cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    num_items = count_on_device(step.loss_tokens, DEVICE)
    total = torch.zeros((), device=DEVICE)
    for batch in step.micro_batches:
        loss = model(**batch, num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def make_optimizer(model, config: BenchConfig, mode: Mode):
    """Fused AdamW; captured steps need it capturable, with the learning rate a tensor the schedule fills."""
    if mode.step_graph:
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(config.lr, device=DEVICE), weight_decay=0.0,
                                      fused=True, capturable=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, fused=True)
    return optimizer, linear_warmup(optimizer, config.warmup_lr_steps)


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def prepare_model(mode: Mode, config: BenchConfig, vocab_size: int):
    """A fresh model from the shared initial weights, set up as ``mode`` runs it."""
    torch._dynamo.reset()  # each mode compiles afresh and starts with the whole recompile budget
    model = make_model(config, vocab_size, mode.attn_implementation)
    if mode.loss_head:
        use_loss_position_head(model)
    if mode.compiled:
        # The reference compiles with dynamic shapes, its batches differ in length; ours start static.
        compile_layers(model, dynamic=True if mode.data == "flatten" else None,
                       mode="reduce-overhead" if mode.cuda_graphs else None)
    return model


def kernel_group(name: str) -> str:
    lower = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in lower for k in keys)), "other")


def profile_step(model, optimizer, scheduler, step: Step, mode: Mode, graphed: GraphedStep | None = None) -> dict:
    """GPU milliseconds of one step by kernel group, and the GPU's idle time within the step's wall time."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        train_step(model, optimizer, scheduler, step, mode, graphed)
        torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - start)
    groups: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            groups[kernel_group(event.name)] += event.time_range.elapsed_us() / 1000
    busy = sum(groups.values())
    return {"wall_ms_profiled": wall_ms, "gpu_busy_ms": busy, "gpu_idle_ms": max(0.0, wall_ms - busy),
            "gpu_ms_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}


def graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def measure(name: str, steps: Iterator[Step], warmup: int, timed: int, config: BenchConfig, vocab_size: int,
            mean_square_length: float, shape_steps: Iterator[Step] | None = None) -> dict:
    """Train ``warmup`` then ``timed`` steps; real tokens/s over the timed ones, peak memory of all.
    ``shape_steps``: the same steps again, for a step-graph mode to capture their shapes during the warm-up."""
    mode = MODES[name]
    free_gpu()
    model = prepare_model(mode, config, vocab_size)
    optimizer, scheduler = make_optimizer(model, config, mode)
    graphed = GraphedStep(model, optimizer, MAX_GRAD_NORM) if mode.step_graph else None
    start = time.perf_counter()
    if mode.shapes == "buckets":
        first = next(steps)
        prewarm_buckets(model, first.micro_batches[0])
        steps = itertools.chain([first], steps)
    for i, step in enumerate(itertools.islice(steps, warmup)):
        train_step(model, optimizer, scheduler, step, mode, graphed)
        if graphed is not None and i == 0:
            # Every shape of the run captured ahead, as a run would capture an epoch's shapes at its start:
            # from a second pass over the same (seeded) batches, so the timed window still loads its own.
            graphed.prepare(s.micro_batches[0] for s in itertools.islice(shape_steps or (), warmup + timed))
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    compiled_before = graphs_compiled()
    captured_before = len(graphed.graphs) if graphed is not None else 0
    real = trained = 0
    losses = []
    start = time.perf_counter()
    timed_steps = list(itertools.islice(steps, timed + config.profile))
    for step in timed_steps[:timed]:
        losses.append(train_step(model, optimizer, scheduler, step, mode, graphed))
        real += step.real_tokens
        trained += step.loss_tokens
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = real / elapsed
    per_token = flops_per_token(model, config, mean_square_length)
    result = {
        "mode": name,
        **asdict(mode),
        "attn_implementation": mode.attn_implementation,
        "tokens_per_s": tokens_per_s,
        "peak_mem_gib": peak_memory_gib(),
        "real_tokens_per_step": real / timed,
        "loss_tokens_per_step": trained / timed,
        "step_ms": 1000 * elapsed / timed,
        "warmup_s": warmup_s,
        "graphs_compiled_timed": graphs_compiled() - compiled_before,
        "step_graphs": len(graphed.graphs) if graphed is not None else None,
        "step_graphs_captured_timed": len(graphed.graphs) - captured_before if graphed is not None else None,
        "flops_per_token": per_token,
        "mfu": per_token * tokens_per_s / PEAK_BF16_FLOPS,
        "mean_loss_timed": float(torch.stack(losses).mean()),
    }
    if config.profile:
        result["profile"] = profile_step(model, optimizer, scheduler, timed_steps[-1], mode, graphed)
    print(json.dumps(result), flush=True)
    del model, optimizer, scheduler, graphed
    free_gpu()
    return result


def measure_guarded(name: str, *args) -> dict:
    """``measure``, with a failure (a compile error, out of memory) reported in the JSON instead of ending the run."""
    try:
        return measure(name, *args)
    except Exception as err:  # reported in the JSON; the other modes still run
        result = {"mode": name, "error": repr(err)[:1000]}
        print(json.dumps(result), flush=True)
        free_gpu()
        return result


def bench_cell(source: str, config: BenchConfig, rows: int, warmup: int, timed: int, modes: list[str], vocab_size: int) -> dict:
    """Every mode at ``rows`` rows per step on the same examples; ratios against both references."""
    first = list(itertools.islice(packed_dataset(source, config, rows), warmup + timed))
    windows = [first[:warmup], first[warmup:]]
    tokens, _ = examples_of(windows[1])
    lengths = np.array([t.size for t in tokens], dtype=np.float64)
    mean_square_length = float((lengths**2).sum() / lengths.sum())
    results = {}
    for name in modes:
        mode = MODES[name]
        steps = packed_steps(source, config, rows, mode) if mode.data == "packed" else baseline_steps(mode.data, windows, config)
        shape_steps = packed_steps(source, config, rows, mode) if mode.step_graph else None
        results[name] = measure_guarded(name, steps, warmup, timed, config, vocab_size, mean_square_length, shape_steps)
    ok = {k: v for k, v in results.items() if "tokens_per_s" in v}
    fastest = lambda names: max(names, key=lambda k: ok[k]["tokens_per_s"]) if names else None  # noqa: E731
    reference_compiled = fastest([k for k in ok if MODES[k].data == "flatten" and MODES[k].compiled])
    best = fastest([k for k in ok if MODES[k].data == "packed"])
    cell = {"rows_per_step": rows, "mean_square_length": mean_square_length, "modes": results,
            "reference_eager": "flatten" if "flatten" in ok else None, "reference_compiled": reference_compiled,
            "best_ours": best}
    for key in ("reference_eager", "reference_compiled"):
        ref = cell[key]
        if ref is None:
            continue
        tag = key.removeprefix("reference_")
        for name, result in ok.items():
            result[f"speed_vs_{tag}_reference"] = result["tokens_per_s"] / ok[ref]["tokens_per_s"]
            result[f"mem_vs_{tag}_reference"] = result["peak_mem_gib"] / ok[ref]["peak_mem_gib"]
        if best is not None:
            cell[f"best_speed_vs_{tag}_reference"] = ok[best][f"speed_vs_{tag}_reference"]
            cell[f"best_mem_vs_{tag}_reference"] = ok[best][f"mem_vs_{tag}_reference"]
    return cell


def bench_dataset(source: str, config: BenchConfig) -> dict:
    """Both step sizes on one shard directory."""
    manifest = read_manifest(source)
    if manifest.stats.examples_split:
        raise ValueError(f"{source}: {manifest.stats.examples_split} examples are split across rows; the reference "
                         "modes need whole examples: rebuild with a max_len of at least the longest example")
    vocab_size = manifest.inputs.tokenizer.vocab_size
    cells = {"small": bench_cell(source, config, config.rows_per_step, config.warmup_steps, config.timed_steps,
                                 config.modes.split(","), vocab_size)}
    if config.budget_rows:
        cells["large"] = bench_cell(source, config, config.budget_rows, config.budget_warmup_steps,
                                    config.budget_timed_steps, config.budget_modes.split(","), vocab_size)
    return {
        "dataset": manifest.inputs.dataset.id,
        "tokenizer": manifest.inputs.tokenizer.name,
        "capacity": manifest.capacity,
        "fill": manifest.stats.fill,
        "cells": cells,
    }


def unpack_to_padded(step: Step, cap: int) -> Step:
    """Mode 1's version of a packed step: the same examples, cut out by cu_seq_lens and padded."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in step.micro_batches[0].items()}
    cpu[NUM_REAL_TOKENS] = step.real_tokens
    tokens, labels = examples_of([cpu])
    return Step(padded_micro_batches(tokens, labels, cap), step.real_tokens, step.loss_tokens)


def convergence(source: str, config: BenchConfig) -> dict:
    """Modes 1 and ``convergence_mode`` for ``convergence_steps`` on identical data per step; loss per step to CSV."""
    manifest = read_manifest(source)
    vocab_size = manifest.inputs.tokenizer.vocab_size
    rows: list[dict] = []
    summary = {}
    ours = MODES[config.convergence_mode]
    for label, mode in (("ours", ours), ("padded", MODES["padded"])):
        free_gpu()
        model = prepare_model(mode, config, vocab_size)
        optimizer, scheduler = make_optimizer(model, config, mode)
        graphed = GraphedStep(model, optimizer, MAX_GRAD_NORM) if mode.step_graph else None
        # Mode 1 trains on the examples of ours' batches; its model never sees the counts.
        steps = packed_steps(source, config, config.rows_per_step, ours)
        if mode.shapes == "buckets":
            first = next(steps)
            prewarm_buckets(model, first.micro_batches[0])
            steps = itertools.chain([first], steps)
        losses, tokens = [], []
        start = time.perf_counter()
        for step in itertools.islice(steps, config.convergence_steps):
            if label == "padded":
                step = unpack_to_padded(step, config.padded_token_cap)
            losses.append(train_step(model, optimizer, scheduler, step, mode, graphed))
            tokens.append(step.real_tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        values = torch.stack(losses).float().cpu().tolist()
        rows += [{"mode": label, "step": i + 1, "loss": v, "real_tokens": n} for i, (v, n) in enumerate(zip(values, tokens))]
        summary[label] = {**asdict(mode), "attn_implementation": mode.attn_implementation, "seconds": elapsed,
                          "mean_loss_last20": float(np.mean(values[-20:])),
                          "peak_mem_gib": peak_memory_gib()}
        print(json.dumps({"convergence": label, **summary[label]}), flush=True)
        del model, optimizer, scheduler, graphed
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
            "config": asdict(config), "peak_bf16_flops": PEAK_BF16_FLOPS, "flop_formula": FLOP_FORMULA}
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
