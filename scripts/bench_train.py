"""Training throughput on one GPU: varpack shards against what users do today, in one run.

On the same model (Llama, random init, bf16 weights, FlashAttention-2 kernels) and the same
examples, at two step sizes (``--rows-per-step`` rows, about 8k real tokens, and
``--budget-rows`` rows, about 32k), every mode trains on the same examples per cell. The
references are what a user of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` runs:

- ``padded``: batches padded to the longest example, with ``attention_mask`` (transformers'
  ``flash_attention_2``);
- ``flatten``: the collator, eager (transformers' ``flash_attention_2``);
- ``flatten_compiled_fa2`` / ``flatten_compiled_varpack``: every decoder layer under
  ``torch.compile(dynamic=True)``, with transformers' ``flash_attention_2`` or varpack's
  registered ``varpack_fa2``;
- ``flatten_liger``: eager, with Liger's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy
  (``liger_kernel.transformers.apply_liger_kernel_to_llama``; ``pip install 'varpack[liger]'``);
- ``flatten_liger_ce_compiled``: Liger's fused linear cross-entropy alone, layers compiled (its
  other kernels do not trace under ``torch.compile``).

varpack's modes (``ours_*``) take ``PackedIterableDataset`` batches: eager on exact shapes
(``ours_eager``) or with per-layer ``torch.compile`` on exact shapes (``ours_exact_*``, dynamic
after the first change), on fixed shapes padded to the worst case (``ours_fixed*``) or to buckets
(``ours_buckets*``: ``bucket_shapes=True``, prewarmed so no bucket compiles again); ``_head``: the
loss-position LM head (``loaders.train.loss_head``); ``_graphs``: per-layer CUDA graphs
(``mode="reduce-overhead"``) on the worst-case shape; ``_stepgraph``: the whole step (forward,
backward, clipping, optimizer) as one CUDA graph per bucketed shape (``loaders.train.step_graph``), every
shape of the run captured during the first warm-up; ``_memNN``: compiled layers
save at most NN% of their activations for backward and recompute the rest; ``_liger``: Liger's RoPE, RMSNorm and SwiGLU
in eager layers.

The harness: every mode gets its batches through a ``torch.utils.data.DataLoader``
(``--num-workers`` worker processes, ``pin_memory``, prefetch): the references with the collator
in the workers, varpack's with ``PackedIterableDataset`` in the workers. Each mode lives in its own
process (Liger patches transformers' module globals) and keeps only its compiled code between
repetitions: each repetition builds the model, optimizer and step graphs from the shared initial
weights and frees them at its end (``mem_left_gib``: what was still allocated after), so one mode
at a time holds the card. The modes take turns, ``--repeats`` times. A repetition builds the mode
and trains the warm-up steps (compiling the first time, prewarming and capturing every time), then
times the timed steps as the loop runs, loading included. Throughput counts real (non-pad) tokens;
the summary gives the median and range over the repetitions; peak memory is the largest of the
repetitions', model and optimizer included, and each repetition gives the peak of each of its phases
(``peak_mem_gib_by_phase``: build, prewarm, first step, capture, the rest of the warm-up, timed
steps); ``graphs_compiled_timed`` counts compilations inside the timed window (0 when warm).

Same data: the loader's first warm-up and timed batches of each step size form the two windows;
the reference modes train on exactly the examples of each window (cut out of the batches by
``cu_seq_lens``), shuffled and cut into as many steps of equal real tokens. MFU is model FLOPs per
real token (``FLOP_FORMULA``, the same for every mode of a cell) times tokens/s over the dense
bf16 peak. Every mode starts from the same initial weights. Each cell compares varpack's best mode
with the best reference of any kind, by median. ``--profile MODES`` (or ``all``) adds one profiled
step of each of those modes: GPU time by kernel group and the GPU's idle time.

``--convergence-steps N`` instead trains ``padded`` and ``--convergence-mode`` for N steps on
identical data per step (``padded``'s batch is the packed batch cut back into its examples) and
writes the loss per step (per trained token, the same average in both) to ``--convergence-csv``.
``--model DIR`` (with ``--gguf-file NAME`` for a GGUF file in it) trains that pretrained model
instead of the random-init Llama.
``--lora-rank R`` trains LoRA adapters of rank R on every linear layer but the LM head (peft,
``target_modules="all-linear"``) in every mode, the base weights frozen; the FLOP formula counts
the frozen weights' forward and input gradient only. ``--gradient-checkpointing`` recomputes each
decoder layer in backward in every mode (the recomputation is not counted in the model FLOPs).

Without CUDA it runs on the CPU (float32; references on ``sdpa``, varpack's modes on
``varpack_segments``), for a smoke test at tiny sizes. The last line printed is one JSON object.

    python scripts/bench_train.py --shards flan=shards/flan --shards orcamath=shards/orcamath \
        --out benchmarks/bench_train_h200.json
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset  # noqa: E402
from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.collate import NUM_LOSS_TOKENS, NUM_REAL_TOKENS  # noqa: E402
from loaders.train.loss_head import use_loss_position_head  # noqa: E402
from loaders.train.optim import adamw_with_warmup  # noqa: E402
from loaders.train.step import TrainStep  # noqa: E402
from loaders.train.step_graph import GraphedStep  # noqa: E402
from schemas import read_manifest  # noqa: E402
from loaders.train.models import (  # noqa: E402
    compile_layers,
    load_causal_lm,
    model_inputs,
    peak_memory_gib,
    prewarm_buckets,
)

Batch = dict[str, torch.Tensor | int]
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
MAX_GRAD_NORM = 1.0
# NVIDIA H200 SXM, dense bf16 tensor-core peak (datasheet).
PEAK_BF16_FLOPS = 989.4e12
FLOP_FORMULA = ("flops_per_token = 6 * N_matmul + 4 * N_frozen + 6 * L * d_attn * sum(n_i^2) / sum(n_i): N_matmul = the "
                "trained weights of every nn.Linear (decoder layers and LM head over all tokens; embeddings excluded), "
                "N_frozen = the frozen ones (LoRA's base weights: forward and input gradient, no weight gradient), L layers, "
                "d_attn = query heads x head dim, n_i the length of each example (causal attention, forward and "
                "backward, half the square); the same model FLOPs for every mode, so the loss-position head's "
                "skipped logits are not credited")
FA2 = "flash_attention_2"
DEFAULT_MODES = ("flatten,flatten_compiled_fa2,flatten_compiled_varpack,flatten_liger,flatten_liger_ce_compiled,"
                 "ours_exact_head,ours_buckets_head,ours_buckets_head_stepgraph,ours_eager_head_liger")
DEFAULT_BUDGET_MODES = DEFAULT_MODES + ",ours_exact_head_mem90"
# apply_liger_kernel_to_llama's parts for each Mode.liger.
LIGER_PARTS = {
    "all": {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True},
    "ce": {"rope": False, "rms_norm": False, "swiglu": False, "fused_linear_cross_entropy": True},
    "kernels": {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": False},
}


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
    liger: str = ""  # Liger kernels: "" none | all | ce (fused linear cross-entropy) | kernels (RoPE, RMSNorm, SwiGLU)
    # Compiled layers keep at most this share of the activations they would save for backward, recomputing the rest
    # (torch._functorch.config.activation_memory_budget); 1.0 keeps them all.
    memory_budget: float = 1.0

    @property
    def attn_implementation(self) -> str:
        if not CUDA:  # the CPU smoke run: the same split between transformers' kernels and varpack's
            return "sdpa" if self.attn == "fa2" else attn_implementation_for("sdpa_segments")
        return FA2 if self.attn == "fa2" else attn_implementation_for("flash_attn")

    @property
    def reference(self) -> bool:
        return self.data != "packed"


MODES = {
    "padded": Mode("padded", "fa2"),
    "flatten": Mode("flatten", "fa2"),
    "flatten_compiled_fa2": Mode("flatten", "fa2", compiled=True),
    "flatten_compiled_varpack": Mode("flatten", compiled=True),
    "flatten_liger": Mode("flatten", "fa2", liger="all"),
    "flatten_liger_ce_compiled": Mode("flatten", "fa2", compiled=True, liger="ce"),
    "ours_eager": Mode("packed"),
    "ours_eager_head_liger": Mode("packed", loss_head=True, liger="kernels"),
    "ours_fixed": Mode("packed", compiled=True, shapes="fixed"),
    "ours_buckets": Mode("packed", compiled=True, shapes="buckets"),
    "ours_fixed_head": Mode("packed", compiled=True, shapes="fixed", loss_head=True),
    "ours_buckets_head": Mode("packed", compiled=True, shapes="buckets", loss_head=True),
    "ours_exact_head": Mode("packed", compiled=True, shapes="exact", loss_head=True),
    "ours_fixed_head_graphs": Mode("packed", compiled=True, shapes="fixed", loss_head=True, cuda_graphs=True),
    "ours_buckets_head_stepgraph": Mode("packed", compiled=True, shapes="buckets", loss_head=True, step_graph=True),
    "ours_exact_head_mem90": Mode("packed", compiled=True, shapes="exact", loss_head=True, memory_budget=0.9),
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
    tie_word_embeddings: bool = False  # the LM head shares the embedding matrix (Llama 3.2 1B and 3B)
    # The model's vocabulary is the tokenizer's rounded up to a multiple of this, as released models pad theirs
    # (Llama 3's 128,256 is 64 x 2,004): an odd vocabulary leaves the LM head's matrix products to slow kernels
    # for every mode. 1 keeps the tokenizer's.
    vocab_multiple: int = 64
    lora_rank: int = 0  # > 0: every mode trains LoRA adapters of this rank on every linear layer but the LM head (peft)
    # Every mode recomputes each decoder layer's activations in backward (transformers' gradient checkpointing,
    # non-reentrant): what an 8B model needs to fit 32k tokens a step on one card.
    gradient_checkpointing: bool = False
    rows_per_step: int = 2  # 0: no small-step cell
    budget_rows: int = 8  # 0: no large-step cell
    modes: str = DEFAULT_MODES
    budget_modes: str = DEFAULT_BUDGET_MODES
    # Mode padded splits a step into micro-batches (gradient accumulation) above this many padded tokens.
    padded_token_cap: int = 49152
    warmup_steps: int = 8
    timed_steps: int = 40
    budget_warmup_steps: int = 6
    budget_timed_steps: int = 16
    repeats: int = 3
    num_workers: int = 2  # DataLoader worker processes of every mode
    prefetch_factor: int = 4
    lr: float = 3e-4
    warmup_lr_steps: int = 20
    profile: str = ""  # modes to profile one step of, comma-separated, or "all"
    convergence_steps: int = 0
    convergence_mode: str = "ours_buckets_head"
    convergence_csv: str = ""
    # A pretrained model instead of the random-init Llama: a directory (or Hub id) and, optionally, a GGUF file in it.
    model: str = ""
    gguf_file: str = ""
    seed: int = 0
    out: str = ""


@dataclass(frozen=True)
class Cell:
    """One step size on one shard directory: what every mode of it trains on."""

    source: str
    rows: int
    warmup: int
    timed: int
    vocab_size: int
    mean_square_length: float


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The model's vocabulary for a tokenizer's ``vocab_size``: rounded up to a multiple of ``multiple``."""
    return -(-vocab_size // multiple) * multiple


def make_model(config: BenchConfig, vocab_size: int, attn_implementation: str):
    """A Llama of the configured size, random init from the seed (or ``--model``'s pretrained weights), on the
    device: bf16 on a GPU, float32 on the CPU (whose bf16 matrix products are far slower)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if CUDA else torch.float32
    if config.model:
        model = load_causal_lm(config.model, attn_implementation, dtype, config.gguf_file or None).to(DEVICE)
        model.config.use_cache = False
        model.train()
        return model

    model_config = LlamaConfig(
        vocab_size=padded_vocab_size(vocab_size, config.vocab_multiple),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=False,
    )
    torch.manual_seed(config.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its training dtype: an 8B model in float32 would be 32 GB more at its peak
    try:
        with DEVICE:
            model = LlamaForCausalLM(model_config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.config._attn_implementation = attn_implementation
    model.train()
    return model


def flops_per_token(model, config: BenchConfig, mean_square_length: float) -> float:
    """FLOP_FORMULA for ``model`` on examples whose sum(n^2) / sum(n) is ``mean_square_length``."""
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    trained = sum(w.numel() for w in linears if w.requires_grad)
    frozen = sum(w.numel() for w in linears if not w.requires_grad)
    d_attn = config.num_heads * (config.hidden_size // config.num_heads)
    return 6 * trained + 4 * frozen + 6 * config.num_layers * d_attn * mean_square_length


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


# ---- the batches of each mode, through a DataLoader ------------------------------------------


@dataclass
class Step:
    """One optimizer step's micro-batches, its real tokens and its trained (loss) tokens."""

    micro_batches: list[Batch]
    real_tokens: int
    loss_tokens: int


def data_loader(dataset, config: BenchConfig, persistent: bool = False, **kwargs) -> DataLoader:
    """A DataLoader as a user's training loop has one: worker processes, pinned memory, prefetch."""
    workers = config.num_workers
    return DataLoader(dataset, num_workers=workers, pin_memory=CUDA, prefetch_factor=config.prefetch_factor if workers else None,
                      persistent_workers=persistent and workers > 0, **kwargs)


def packed_dataset(source: str, config: BenchConfig, batch_rows: int, shapes: str = "exact") -> PackedIterableDataset:
    return PackedIterableDataset(source, batch_rows=batch_rows, shuffle=True, seed=config.seed,
                                 pad_to_fixed_shape=shapes != "exact", bucket_shapes=shapes == "buckets")


def packed_batches(source: str, config: BenchConfig, batch_rows: int, shapes: str) -> Iterator[dict]:
    """Our modes: PackedIterableDataset batches of ``batch_rows`` rows through a DataLoader, epoch after epoch."""
    dataset = packed_dataset(source, config, batch_rows, shapes)
    loader = data_loader(dataset, config, batch_size=None)
    for epoch in itertools.count():
        dataset.set_epoch(epoch)  # read by the workers each epoch starts
        yield from loader


def packed_step(batch: dict, mode: Mode) -> Step:
    """A loader batch (pinned) on the device as the mode's model takes it."""
    return Step([model_inputs(batch, DEVICE, full_logits=not mode.loss_head)], batch[NUM_REAL_TOKENS], batch[NUM_LOSS_TOKENS])


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


def padded_micro_batches(tokens: list[np.ndarray], labels: list[np.ndarray], cap: int) -> list[dict]:
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
        batches.append({"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab),
                        "attention_mask": torch.from_numpy(att)})
        start = end
    return batches


def loss_tokens_of(micro_batches: list[dict]) -> int:
    """Labels the model's shifted loss counts: every label but each row's first that is not -100."""
    return sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in micro_batches)


class StepCollator:
    """The references' ``collate_fn``, run in the DataLoader's workers: a step's examples (lists, as
    from ``datasets``) to ``(micro_batches, real_tokens, loss_tokens)``."""

    def __init__(self, data: str, padded_token_cap: int):
        from transformers import DataCollatorWithFlattening

        self.data = data
        self.padded_token_cap = padded_token_cap
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def __call__(self, examples: list[dict]) -> tuple[list[dict], int, int]:
        if self.data == "padded":
            micro = padded_micro_batches([np.asarray(e["input_ids"]) for e in examples],
                                         [np.asarray(e["labels"]) for e in examples], self.padded_token_cap)
        else:
            micro = [self.flatten(examples)]
        return micro, sum(len(e["input_ids"]) for e in examples), loss_tokens_of(micro)


def reference_plan(windows: list[list[dict]], seed: int) -> tuple[list[dict], list[list[int]]]:
    """The examples of the loader's windows (warm-up, timed) as the collator takes them, and the
    steps: each window's examples shuffled and cut into as many steps of equal real tokens."""
    rng = np.random.default_rng([seed, 7])
    examples: list[dict] = []
    steps: list[list[int]] = []
    for window in windows:
        tokens, labels = examples_of(window)
        order = rng.permutation(len(tokens))
        ends = np.cumsum([tokens[i].size for i in order])
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, len(window)) / len(window)) + 1
        steps += [(len(examples) + step).tolist() for step in np.split(order, cuts)]
        examples += [{"input_ids": t.tolist(), "labels": y.tolist()} for t, y in zip(tokens, labels)]
    return examples, steps


def reference_loader(mode: Mode, cell: Cell, config: BenchConfig) -> DataLoader:
    """A reference mode's steps over the cell's windows, collated in the DataLoader's (persistent) workers;
    each pass over it starts again at the first step."""
    examples, steps = reference_plan(cell_windows(cell.source, config, cell.rows, cell.warmup, cell.timed), config.seed)
    return data_loader(examples, config, persistent=True, batch_sampler=steps,
                       collate_fn=StepCollator(mode.data, config.padded_token_cap))


def cell_windows(source: str, config: BenchConfig, rows: int, warmup: int, timed: int) -> list[list[dict]]:
    """The loader's first ``warmup`` and next ``timed`` batches of ``rows`` rows: the windows every mode trains on."""
    first = list(itertools.islice(packed_dataset(source, config, rows), warmup + timed))
    return [first[:warmup], first[warmup:]]


def mode_steps(mode: Mode, cell: Cell, config: BenchConfig, references: DataLoader | None) -> Iterator[Step]:
    """One pass of the mode's steps over the cell's windows, as its DataLoader delivers them
    (``references``: a reference mode's loader)."""
    if references is not None:
        return (Step([model_inputs(batch, DEVICE, full_logits=True) for batch in micro], real, loss)
                for micro, real, loss in references)
    batches = packed_batches(cell.source, config, cell.rows, mode.shapes)
    return (packed_step(batch, mode) for batch in itertools.islice(batches, cell.warmup + cell.timed))


# ---- training ----------------------------------------------------------------------------


def make_train_step(model, config: BenchConfig, mode: Mode) -> TrainStep:
    """train.py's optimizer step (``loaders.train.step``): its AdamW and warm-up over the trained weights, capturable
    and replayed as CUDA graphs for a step-graph mode."""
    optimizer, scheduler = adamw_with_warmup(model.parameters(), config.lr, 0.0, config.warmup_lr_steps, DEVICE,
                                             mode.step_graph)
    graphed = GraphedStep(model, optimizer, MAX_GRAD_NORM) if mode.step_graph else None
    return TrainStep(model, optimizer, scheduler, MAX_GRAD_NORM, graphed=graphed)


def prewarmed(model, steps: Iterator[Step]) -> Iterator[Step]:
    """Compile every bucket shape on the first step's batch, as train.py's prewarm does (``SpeedOptions.prewarm``:
    ``prewarm_buckets``), before any step trains; the steps, the first included."""
    first = next(steps)
    prewarm_buckets(model, first.micro_batches[0])
    return itertools.chain([first], steps)


def train_step(train: TrainStep, step: Step, mode: Mode) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, then one optimizer step (a CUDA graph replay for a
    step-graph mode); the loss (per trained token, averaged over the whole step) stays on the device."""
    if mode.cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    return train(step.micro_batches, step.loss_tokens)


def free_gpu() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def prepare_model(mode: Mode, config: BenchConfig, vocab_size: int):
    """A fresh model from the shared initial weights, set up as ``mode`` runs it."""
    model = make_model(config, vocab_size, mode.attn_implementation)
    if mode.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model, **LIGER_PARTS[mode.liger])
    if mode.loss_head:
        use_loss_position_head(model)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_rank:
        import peft

        lora = peft.LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, lora_dropout=0.0,
                               target_modules="all-linear")
        model = peft.get_peft_model(model, lora)
    if mode.compiled:
        # The reference compiles with dynamic shapes, its batches differ in length; ours start static.
        compile_layers(model, dynamic=True if mode.reference else None,
                       mode="reduce-overhead" if mode.cuda_graphs else None, activation_memory_budget=mode.memory_budget)
    return model


# The profile lists this many kernels by GPU time besides the groups.
TOP_KERNELS = 15


def kernel_group(name: str) -> str:
    lower = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in lower for k in keys)), "other")


def graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class ModeRun:
    """One mode on one cell. Each repetition builds its model, optimizer and step graphs from the shared initial
    weights and frees them at its end, so that a mode holds no GPU memory while the others take their turns;
    the process keeps only what costs no GPU memory: its compiled code and the references' DataLoader."""

    def __init__(self, name: str, cell: Cell, config: BenchConfig):
        self.name, self.mode, self.cell, self.config = name, MODES[name], cell, config
        self.references = reference_loader(self.mode, cell, config) if self.mode.reference else None
        self.repetitions = 0
        self.model: torch.nn.Module | None = None
        self.step: TrainStep | None = None
        self.shapes_ahead: Iterator[Batch] | None = None
        self.phase_peaks: dict[str, float] = {}

    def _phase(self, name: str) -> None:
        """The peak GiB allocated since the last phase ended, under ``name``; the next phase's peak starts from here."""
        if CUDA:
            synchronize()
            self.phase_peaks[name] = peak_memory_gib()
            torch.cuda.reset_peak_memory_stats()

    def _build(self) -> None:
        """A fresh model from the shared initial weights, its optimizer and, for a step-graph mode, its GraphedStep."""
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        self.model = prepare_model(self.mode, self.config, self.cell.vocab_size)
        self.step = make_train_step(self.model, self.config, self.mode)
        if self.mode.step_graph:
            # Every shape of the run captured after the first step, as train.py captures an epoch's shapes at its
            # start: from a pass over the same (seeded) batches in this process.
            batches = itertools.islice(packed_dataset(self.cell.source, self.config, self.cell.rows, self.mode.shapes),
                                       self.cell.warmup + self.cell.timed)
            self.shapes_ahead = (packed_step(batch, self.mode).micro_batches[0] for batch in batches)

    def _free(self) -> float:
        """Drop the model, optimizer and graphs and return their memory to the card; the GiB still allocated after."""
        self.model = self.step = self.shapes_ahead = None
        free_gpu()
        return torch.cuda.memory_allocated() / 2**30 if CUDA else 0.0

    def _warm_up(self, steps: Iterator[Step]) -> float:
        """Build the mode and train the warm-up steps: compile (and prewarm, capture) what the run needs."""
        start = time.perf_counter()
        self.phase_peaks = {}
        self._build()
        assert self.model is not None
        self._phase("build")
        if self.mode.shapes == "buckets":
            steps = prewarmed(self.model, steps)
            self._phase("prewarm")
        for index, step in enumerate(itertools.islice(steps, self.cell.warmup)):
            self.train(step)
            if index == 0:
                self._phase("first_step")
                if self.graphed is not None and self.shapes_ahead is not None:
                    # Every shape of the run captured after the first step, which creates the optimizer's state.
                    self.graphed.prepare(self.shapes_ahead)
                    self.shapes_ahead = None
                    self._phase("capture")
        synchronize()
        self._phase("warmup")
        return time.perf_counter() - start

    def train(self, step: Step) -> torch.Tensor:
        assert self.step is not None
        return train_step(self.step, step, self.mode)

    @property
    def graphed(self) -> GraphedStep | None:
        return self.step.graphed if self.step is not None else None

    def repetition(self) -> dict:
        """One repetition: the warm-up steps, then the timed steps as the DataLoader delivers them."""
        steps = mode_steps(self.mode, self.cell, self.config, self.references)
        warmup_s = self._warm_up(steps)
        compiled_before = graphs_compiled()
        captured_before = len(self.graphed.graphs) if self.graphed is not None else 0
        real = trained = 0
        losses = []
        start = time.perf_counter()
        for step in itertools.islice(steps, self.cell.timed):
            losses.append(self.train(step))
            real += step.real_tokens
            trained += step.loss_tokens
        synchronize()
        elapsed = time.perf_counter() - start
        del steps  # a packed loader's workers end here, after the timed window (the references' persist)
        self._phase("timed")
        tokens_per_s = real / elapsed
        per_token = flops_per_token(self.model, self.config, self.cell.mean_square_length)
        result = {
            "mode": self.name,
            "repetition": self.repetitions,
            "tokens_per_s": tokens_per_s,
            "peak_mem_gib": max(self.phase_peaks.values()) if CUDA else peak_memory_gib(),
            "peak_mem_gib_by_phase": self.phase_peaks,
            "real_tokens_per_step": real / self.cell.timed,
            "loss_tokens_per_step": trained / self.cell.timed,
            "step_ms": 1000 * elapsed / self.cell.timed,
            "warmup_s": warmup_s,
            "graphs_compiled_timed": graphs_compiled() - compiled_before,
            "step_graphs": len(self.graphed.graphs) if self.graphed is not None else None,
            "step_graphs_captured_timed": len(self.graphed.graphs) - captured_before if self.graphed is not None else None,
            "flops_per_token": per_token,
            "trained_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "mfu": per_token * tokens_per_s / PEAK_BF16_FLOPS,
            "mean_loss_timed": float(torch.stack(losses).float().mean()),
        }
        self.repetitions += 1
        del losses
        result["mem_left_gib"] = self._free()  # the other modes' turns need the card
        return result

    def profile(self) -> dict:
        """GPU milliseconds of one step (the timed window's first) by kernel group, and the GPU's idle
        time within the step's wall time."""
        steps = mode_steps(self.mode, self.cell, self.config, self.references)
        self._warm_up(steps)
        step = next(steps)
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            self.train(step)
            synchronize()
        wall_ms = 1000 * (time.perf_counter() - start)
        del steps
        groups: dict[str, float] = defaultdict(float)
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                ms = event.time_range.elapsed_us() / 1000
                groups[kernel_group(event.name)] += ms
                kernels[event.name][0] += ms
                kernels[event.name][1] += 1
        busy = sum(groups.values())
        self._free()
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
        return {"wall_ms_profiled": wall_ms, "gpu_busy_ms": busy, "gpu_idle_ms": max(0.0, wall_ms - busy),
                "gpu_ms_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
                "top_kernels": [{"kernel": name[:160], "ms": ms, "calls": calls} for name, (ms, calls) in top]}


def serve_mode(conn, name: str, cell: Cell, config: BenchConfig) -> None:
    """A mode's own process: sets the mode up, then answers ``repetition`` and ``profile`` until ``stop``.
    A failure (a compile error, out of memory) is answered as ``{"error": ...}`` and ends the mode."""
    run = None
    while (command := conn.recv()) != "stop":
        try:
            if run is None:
                run = ModeRun(name, cell, config)
            conn.send(getattr(run, command)())
        except Exception as err:  # reported in the JSON; the other modes still run
            conn.send({"error": repr(err)[:1000]})
            break
    conn.close()


class ModeProcess:
    """The main process's handle on a mode's process (spawned: each has its own CUDA context,
    compile caches and transformers module globals, which Liger patches)."""

    def __init__(self, name: str, cell: Cell, config: BenchConfig):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        # Not a daemon: its DataLoader starts worker processes of its own.
        self.process = context.Process(target=serve_mode, args=(child, name, cell, config), daemon=False)
        self.process.start()
        child.close()
        self.failed = False

    def ask(self, command: str) -> dict:
        if self.failed:
            return {"error": "failed earlier"}
        try:
            self.conn.send(command)
            answer = self.conn.recv()
        except (EOFError, OSError) as err:  # the process died (a crash in a kernel, killed for memory)
            answer = {"error": f"mode process ended: {err!r}"}
        self.failed = "error" in answer
        return answer

    def close(self) -> None:
        if not self.failed:
            self.conn.send("stop")
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def summarize(runs: list[dict]) -> dict:
    """A mode's repetitions: median and range of throughput, step time and MFU; its peak memory."""
    ok = [r for r in runs if "tokens_per_s" in r]
    if not ok:
        return {"error": next((r["error"] for r in runs if "error" in r), "no repetition ran")}
    summary: dict = {}
    for key in ("tokens_per_s", "step_ms", "mfu"):
        values = [r[key] for r in ok]
        summary[key] = statistics.median(values)
        summary[f"{key}_range"] = [min(values), max(values)]
    summary["peak_mem_gib"] = max(r["peak_mem_gib"] for r in ok)
    summary["warmup_s_first"] = ok[0]["warmup_s"]
    summary["graphs_compiled_timed"] = sum(r["graphs_compiled_timed"] for r in ok)
    summary["repetitions"] = len(ok)
    if len(ok) < len(runs):
        summary["error"] = next(r["error"] for r in runs if "error" in r)
    return summary


def bench_cell(cell: Cell, config: BenchConfig, modes: list[str]) -> dict:
    """Every mode on the cell's examples, taking turns ``repeats`` times; varpack's best against the best reference."""
    processes = {name: ModeProcess(name, cell, config) for name in modes}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    profiles = {}
    try:
        for _ in range(config.repeats):
            for name in modes:
                result = processes[name].ask("repetition")
                print(json.dumps({"cell_rows": cell.rows, "mode": name, **result}), flush=True)
                runs[name].append(result)
        profiled = modes if config.profile == "all" else [name for name in config.profile.split(",") if name in modes]
        profiles = {name: processes[name].ask("profile") for name in profiled}
    finally:
        for process in processes.values():
            process.close()
    summaries = {name: {**asdict(MODES[name]), "attn_implementation": MODES[name].attn_implementation,
                        **summarize(runs[name]), "runs": runs[name], **({"profile": profiles[name]} if name in profiles else {})}
                 for name in modes}
    comparison = compare_modes(summaries)
    return {"rows_per_step": cell.rows, "mean_square_length": cell.mean_square_length, "repeats": config.repeats,
            "best_reference": comparison.pop("best_reference"), "best_ours": comparison.pop("best_ours"),
            "modes": summaries, **comparison}


def compare_modes(summaries: dict[str, dict]) -> dict:
    """The best reference and varpack's best mode by median throughput; each mode's speed and memory against that
    reference (added to its summary), and the best mode's, with the range over the repetitions."""
    ok = {k: v for k, v in summaries.items() if "tokens_per_s" in v}
    fastest = lambda names: max(names, key=lambda k: ok[k]["tokens_per_s"]) if names else None  # noqa: E731
    reference = fastest([k for k in ok if MODES[k].reference])
    best = fastest([k for k in ok if not MODES[k].reference])
    comparison: dict = {"best_reference": reference, "best_ours": best}
    if reference is None:
        return comparison
    ref = ok[reference]
    for result in ok.values():
        result["speed_vs_best_reference"] = result["tokens_per_s"] / ref["tokens_per_s"]
        result["mem_vs_best_reference"] = result["peak_mem_gib"] / ref["peak_mem_gib"] if ref["peak_mem_gib"] else None
    if best is not None:
        ours = ok[best]
        comparison["best_speed_vs_best_reference"] = ours["speed_vs_best_reference"]
        # The worst and best case over the repetitions: slowest of ours against fastest reference and back.
        comparison["best_speed_vs_best_reference_range"] = [ours["tokens_per_s_range"][0] / ref["tokens_per_s_range"][1],
                                                            ours["tokens_per_s_range"][1] / ref["tokens_per_s_range"][0]]
        comparison["best_mem_vs_best_reference"] = ours["mem_vs_best_reference"]
        comparison["best_mfu"] = ours["mfu"]
        comparison["best_reference_mfu"] = ref["mfu"]
    return comparison


def make_cell(source: str, config: BenchConfig, rows: int, warmup: int, timed: int) -> Cell:
    manifest = read_manifest(source)
    if manifest.stats.examples_split:
        raise ValueError(f"{source}: {manifest.stats.examples_split} examples are split across rows; the reference "
                         "modes need whole examples: rebuild with a max_len of at least the longest example")
    tokens, _ = examples_of(cell_windows(source, config, rows, warmup, timed)[1])
    lengths = np.array([t.size for t in tokens], dtype=np.float64)
    return Cell(source, rows, warmup, timed, manifest.inputs.tokenizer.vocab_size, float((lengths**2).sum() / lengths.sum()))


def dataset_cells(source: str, config: BenchConfig) -> dict[str, tuple[int, int, int, list[str]]]:
    """The cells of one shard directory: rows, warm-up and timed steps, and modes of each step size."""
    cells = {}
    if config.rows_per_step:
        cells["small"] = (config.rows_per_step, config.warmup_steps, config.timed_steps, config.modes.split(","))
    if config.budget_rows:
        cells["large"] = (config.budget_rows, config.budget_warmup_steps, config.budget_timed_steps, config.budget_modes.split(","))
    return cells


def unpack_to_padded(step: Step, cap: int) -> Step:
    """Mode padded's version of a packed step: the same examples, cut out by cu_seq_lens and padded."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in step.micro_batches[0].items()}
    cpu[NUM_REAL_TOKENS] = step.real_tokens
    tokens, labels = examples_of([cpu])
    micro = [model_inputs(batch, DEVICE, full_logits=True) for batch in padded_micro_batches(tokens, labels, cap)]
    return Step(micro, step.real_tokens, step.loss_tokens)


def convergence(source: str, config: BenchConfig) -> dict:
    """``padded`` and ``convergence_mode`` for ``convergence_steps`` on identical data per step; loss per step to CSV."""
    manifest = read_manifest(source)
    vocab_size = manifest.inputs.tokenizer.vocab_size
    rows: list[dict] = []
    summary = {}
    ours = MODES[config.convergence_mode]
    for label, mode in (("ours", ours), ("padded", MODES["padded"])):
        free_gpu()
        model = prepare_model(mode, config, vocab_size)
        train = make_train_step(model, config, mode)
        # Mode padded trains on the examples of ours' batches; its model never sees the counts.
        steps = (packed_step(batch, ours) for batch in packed_batches(source, config, config.rows_per_step, ours.shapes))
        if mode.shapes == "buckets":
            steps = prewarmed(model, steps)
        losses, tokens = [], []
        start = time.perf_counter()
        for step in itertools.islice(steps, config.convergence_steps):
            if label == "padded":
                step = unpack_to_padded(step, config.padded_token_cap)
            losses.append(train_step(train, step, mode))
            tokens.append(step.real_tokens)
        synchronize()
        elapsed = time.perf_counter() - start
        values = torch.stack(losses).float().cpu().tolist()
        rows += [{"mode": label, "step": i + 1, "loss": v, "real_tokens": n} for i, (v, n) in enumerate(zip(values, tokens))]
        summary[label] = {**asdict(mode), "attn_implementation": mode.attn_implementation, "seconds": elapsed,
                          "mean_loss_last20": float(np.mean(values[-20:])),
                          "peak_mem_gib": peak_memory_gib()}
        print(json.dumps({"convergence": label, **summary[label]}), flush=True)
        del model, train, steps
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


def headline(result: dict) -> dict:
    """Per dataset and cell: varpack's best mode against the best reference (medians), memory and MFU."""
    keys = ("best_reference", "best_ours", "best_speed_vs_best_reference", "best_speed_vs_best_reference_range",
            "best_mem_vs_best_reference", "best_mfu", "best_reference_mfu")
    return {f"{name}/{size}": {k: cell.get(k) for k in keys}
            for name, dataset in result.get("datasets", {}).items() for size, cell in dataset["cells"].items()}


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
    config = BenchConfig(**vars(parser.parse_args(argv)))
    if config.vocab_multiple < 1:
        parser.error(f"--vocab-multiple {config.vocab_multiple}: give a whole number of at least 1 (1 keeps the tokenizer's)")
    for modes in (config.modes, config.budget_modes):
        unknown = sorted(set(modes.split(",")) - set(MODES))
        if unknown:
            parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    sources = dict(item.split("=", 1) for item in config.shards)
    import transformers

    meta = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "config": asdict(config), "peak_bf16_flops": PEAK_BF16_FLOPS,
            "flop_formula": FLOP_FORMULA}
    if config.convergence_steps:
        result = {**meta, "convergence": convergence(next(iter(sources.values())), config)}
    else:
        result = {**meta, "datasets": {}}
        for name, source in sources.items():
            manifest = read_manifest(source)
            dataset = result["datasets"][name] = {
                "dataset": manifest.inputs.dataset.id, "tokenizer": manifest.inputs.tokenizer.name,
                "capacity": manifest.capacity, "fill": manifest.stats.fill, "cells": {}}
            for size, (rows, warmup, timed, modes) in dataset_cells(source, config).items():
                dataset["cells"][size] = bench_cell(make_cell(source, config, rows, warmup, timed), config, modes)
                write_out(config, result)  # what has run so far survives a later failure
        result["headline"] = headline(result)
    write_out(config, result)
    print(json.dumps(result))


def write_out(config: BenchConfig, result: dict) -> None:
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
