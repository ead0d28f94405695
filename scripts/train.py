"""Fine-tune a causal LM on varpack shards, with a plain PyTorch loop or the Hugging Face Trainer.

    # a Hub model (or a local directory), plain loop, on the best attention backend available
    python scripts/train.py --shards shards/ --model HuggingFaceTB/SmolLM2-135M --out runs/smol
    # the same with the Hugging Face Trainer
    python scripts/train.py --shards shards/ --model HuggingFaceTB/SmolLM2-135M --out runs/smol --trainer hf
    # random init from a config spec: a model type with overrides, or a Hub id / directory's config
    python scripts/train.py --shards shards/ --random-init llama:hidden_size=512,num_hidden_layers=8
    # resume from the latest checkpoint in --out, the loader included (no batch replayed or skipped)
    python scripts/train.py ... --resume

Batches come from ``PackedIterableDataset`` as FA2 varlen kwargs (``cu_seq_lens_q`` ...; no
attention mask) with their real-token and loss-token counts as Python ints, so a step never waits
on the GPU to count them. The loss is averaged per trained token over each optimizer step, in both
loops (the plain loop's step: ``loaders.train.step``), and computed by ``loaders.train.loss_head``
at labelled positions only (``--full-logits``: the model's own LM head over every token).
Logs (``loaders.train.run_log``, one JSON object a line, also in ``OUT/log.jsonl``): loss, real
tokens/s, peak memory (GPU memory allocated; on CPU the process's peak resident memory); on a
mixture, each source's tokens (plain loop) and mean token loss (``source_loss``, both loops).
Weights stay in fp32; ``--precision bf16`` (default) runs forward and backward under bf16 autocast.
``--precision bf16-weights`` keeps the weights, their gradients and AdamW's state in bf16, with no
autocast, as ``scripts/bench_train.py`` runs every method: less memory and a faster optimizer step,
at the cost of updates smaller than a bf16 weight's precision being lost.

On a preference build, ``--objective dpo|ipo|simpo|orpo --beta B`` trains on its pairs
(``loaders.train.preference``): the loss of a step is the mean over its pairs, the reference (DPO, IPO)
is the starting model, frozen, or ``--reference-log-probs FILE`` computed once beside the build, and the
logs carry TRL's ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` and ``rewards/margins``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset, PackedMixture, load_mixture_file  # noqa: E402
from loaders.loss_weights import LossReduction, batch_normalizer  # noqa: E402
from loaders.train import preference  # noqa: E402
from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.checkpoint import (checkpoint_to_resume, refuse_earlier_run, refuse_other_weights_dtype,  # noqa: E402
                                      resumable_checkpoint, resume_plain_run, save_training_state, training_state,
                                      writing_checkpoint)
from loaders.train.distributed import data_parallel, finish_distributed_run, init_distributed, world_size  # noqa: E402
from loaders.train.loss_head import SEQUENCE_LOSSES, frozen_copy, use_loss_position_head  # noqa: E402
from loaders.train.models import check_trained_tokens, for_packed_training, load_causal_lm, model_inputs  # noqa: E402
from loaders.train.optim import adamw_with_warmup  # noqa: E402
from loaders.train.random_init import ConfigSpecError, parse_config_spec, random_init_model  # noqa: E402
from loaders.train.run_log import Logger  # noqa: E402
from loaders.train.speed import SpeedOptions  # noqa: E402
from loaders.train.step import TrainStep  # noqa: E402
from loaders.train.step_graph import GraphedStep  # noqa: E402
from schemas import TokenizerInputs, VarpackError  # noqa: E402


def option(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    """A TrainConfig field: its default, what its option does (for --help) and the values it takes, if only some."""
    return field(default=default, metadata={"help": text, "choices": choices})


@dataclass
class TrainConfig:
    """One training run; the CLI maps onto it one to one."""

    shards: str = option("shards", "shard directory or manifest (local, or an fsspec URL such as s3://)")
    mixture: str = option("", "a JSON mixture file (sources, weights, unit, max_epochs; docs/mixtures.md) read instead of --shards")
    model: str = option("", "Hub id or local directory whose weights are fine-tuned")
    gguf_file: str = option("", "GGUF file in the --model directory to take the weights from (dequantized; checkpoints are saved as "
                                "plain safetensors)")
    random_init: str = option("", "random init from a config: a model type with overrides (llama:hidden_size=512,...) or a Hub id / "
                                  "directory whose config is used")
    trainer: str = option("plain", "training loop: plain (PyTorch) or hf (Hugging Face Trainer)", ("plain", "hf"))
    attn: str = option("auto", "attention backend: auto (the best here), flash_attn, torch_varlen, sdpa_segments (per example; the CPU "
                               "choice), sdpa, or a transformers implementation such as flash_attention_2")
    out: str = option("runs/train", "directory for log.jsonl and checkpoints")
    batch_rows: int = option(1, "packed rows per batch (ignored with --tokens-per-batch)")
    tokens_per_batch: int = option(0, "tokens per batch instead of a fixed row count; 0 uses --batch-rows")
    grad_accum: int = option(1, "batches per optimizer step")
    max_steps: int = option(100, "optimizer steps to train for")
    lr: float = option(2e-5, "learning rate (AdamW), constant after the warm-up")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(0, "linear warm-up steps")
    max_grad_norm: float = option(1.0, "gradient clipping norm")
    precision: str = option("bf16", "bf16 (autocast over fp32 weights), bf16-weights (weights, gradients and AdamW state in "
                                     "bf16, no autocast: the benchmarks' setting) or fp32", ("bf16", "bf16-weights", "fp32"))
    compile: bool = option(False, "fixed-shape batches and per-layer torch.compile")
    step_graph: bool = option(False, "with --compile: each optimizer step (forward, backward, clipping, AdamW) replayed as one CUDA "
                                     "graph per batch shape (with --trainer hf: its forward and backward); one GPU, --grad-accum 1")
    activation_memory_budget: float = option(1.0, "with --compile: the share of their activations the compiled layers keep for "
                                                  "backward, recomputing the rest (0.9 cut peak memory by a quarter at 32k tokens a "
                                                  "step for 1%% of the speed)")
    full_logits: bool = option(False, "use the model's own LM head and loss over every token, not only the labelled ones")
    loss_reduction: str = option("token", "token: every trained token weighs the same; sequence: every example weighs the same (the "
                                          "plain loop needs the loss-position head for it)", tuple(LossReduction))
    log_every: int = option(10, "log every N optimizer steps")
    save_every: int = option(0, "checkpoint every N steps; 0 saves only at the end")
    resume: bool = option(False, "resume from the latest checkpoint in --out (weights, optimizer, scheduler, loader position)")
    seed: int = option(0, "seed of the model init and the loader's shuffle")
    allow_tokenizer_mismatch: bool = option(False, "train although the tokenizer in the --model directory differs from the one the "
                                                   "shards were built with")
    objective: str = option("sft", "sft (next-token loss), or on a preference build's pairs dpo (sigmoid), ipo, simpo or orpo",
                            ("sft", *(objective.value for objective in preference.Objective)))
    beta: float = option(0.1, "the preference objective's beta (DPO, IPO, SimPO; ORPO's lambda)")
    simpo_gamma: float = option(0.5, "SimPO's target reward margin (TRL's simpo_gamma)")
    reference_log_probs: str = option("", "dpo, ipo: the reference model's log-probs stored beside the build "
                                          "(loaders.train.preference.write_reference_log_probs) instead of a frozen copy of the model")


# ---- model, data, logs, checkpoints: shared by both loops -----------------------------------


def load_model(config: TrainConfig, vocab_size: int, attn_implementation: str, checkpoint: Path | None = None):
    """The model to train, in the dtype of its weights (``weights_dtype``): a checkpoint's weights, a Hub id /
    directory's weights, or a random init."""
    dtype = weights_dtype(config)
    if checkpoint is not None or config.model:
        gguf_file = None if checkpoint is not None else config.gguf_file or None
        model = load_causal_lm(str(checkpoint or config.model), attn_implementation, dtype, gguf_file)
    elif config.random_init:
        try:
            model = random_init_model(config.random_init, vocab_size, attn_implementation, config.seed, dtype)
        except ConfigSpecError as err:
            raise ValueError(f"--random-init {err}") from None
    else:
        raise ValueError("give --model (Hub id or directory) or --random-init (config spec)")
    return for_packed_training(model, vocab_size)


def weights_dtype(config: TrainConfig) -> torch.dtype:
    """bf16 for ``--precision bf16-weights``; fp32 otherwise (``--precision bf16`` casts under autocast)."""
    return torch.bfloat16 if config.precision == "bf16-weights" else torch.float32


def refuse_other_precision(config: TrainConfig, checkpoint: Path | None) -> None:
    """Refuse to resume a checkpoint whose weights are of another dtype than ``--precision`` trains."""
    if checkpoint is not None:
        refuse_other_weights_dtype(checkpoint, weights_dtype(config), f"--precision {config.precision}")


def check_tokenizer(config: TrainConfig, recorded: TokenizerInputs) -> None:
    """Refuse a --model directory whose tokenizer is not, by content, the one the shards were built with."""
    if config.model and not config.allow_tokenizer_mismatch:
        from pipeline.encode.tokenizer import check_model_tokenizer

        check_model_tokenizer(str(Path(config.model) / config.gguf_file) if config.gguf_file else config.model, recorded)


def announce_mixture(dataset: PackedIterableDataset) -> None:
    """On a mixture, rank 0 prints its plan: each source's weight, size and epochs per mixture epoch (the repetition)."""
    if isinstance(dataset, PackedMixture) and dataset.rank == 0:
        print(json.dumps({"mixture_plan": [asdict(source) for source in dataset.plan()]}), flush=True)


def speed_options(config: TrainConfig) -> SpeedOptions:
    """--compile, --full-logits, --activation-memory-budget and --step-graph, as both loops take them."""
    return SpeedOptions(compile=config.compile, loss_head=not config.full_logits,
                        activation_memory_budget=config.activation_memory_budget, step_graph=config.step_graph)


def make_dataset(config: TrainConfig) -> PackedIterableDataset:
    budget = {"tokens_per_batch": config.tokens_per_batch} if config.tokens_per_batch else {"batch_rows": config.batch_rows}
    options = dict(shuffle=True, seed=config.seed, loss_reduction=config.loss_reduction,
                   **speed_options(config).dataset_options(), **budget)
    if config.mixture:
        return PackedMixture(**load_mixture_file(config.mixture), **options)
    return PackedIterableDataset(config.shards, **options)


def check_out(config: TrainConfig, out: Path) -> None:
    """Refuse a link planted as the log, and a new run (no --resume) into an --out holding another run's checkpoints."""
    Logger.check(out)
    refuse_earlier_run(out, config.resume)


def check_objective(config: TrainConfig, dataset: PackedIterableDataset) -> None:
    """Refuse --objective sft on a preference build (it would train on the rejected answers) and a preference
    objective on any other build."""
    preference_build = preference.is_preference_build(dataset)
    if config.objective == "sft" and preference_build:
        raise ValueError(f"--objective sft: {config.shards or config.mixture} {preference.NOT_SFT}; give --objective "
                         f"{', '.join(o.value for o in preference.Objective)}")
    if config.objective != "sft" and not preference_build:
        raise ValueError(f"--objective {config.objective} {preference.NOT_PREFERENCE}")


# ---- the plain PyTorch loop -----------------------------------------------------------------


def preference_setup(config: TrainConfig, dataset: PackedIterableDataset, vocab_size: int,
                     device: torch.device) -> preference.PairLoss | None:
    """None for --objective sft; else the objective, and for DPO and IPO the reference: the stored log-probs of
    --reference-log-probs, or the starting model (--model or the seeded --random-init, never a resumed checkpoint),
    frozen."""
    check_objective(config, dataset)
    if config.objective == "sft":
        return None
    objective = preference.PreferenceConfig(config.objective, beta=config.beta, simpo_gamma=config.simpo_gamma)
    reference = None
    if objective.objective in preference.NEEDS_REFERENCE:
        start = use_loss_position_head(load_model(config, vocab_size, attn_implementation_for(config.attn)))
        if config.reference_log_probs:  # computed by the starting model, on this build
            stored = preference.ReferenceLogProbs(config.reference_log_probs, dataset.manifest,
                                                  preference.reference_identity(start))
            reference = preference.Reference(stored=stored)
        else:
            reference = preference.Reference(frozen_copy(start).to(device))
    return preference.PairLoss(objective, reference, preference.RewardMetrics(device))


@dataclass
class PlainRun:
    """The plain loop's dataset, model, optimizer step and log, set up (and resumed) by ``start_plain_run``."""

    config: TrainConfig
    out: Path
    dataset: PackedIterableDataset
    model: torch.nn.Module
    step: TrainStep
    log: Logger
    pairs: preference.PairLoss | None
    first_step: int

    def normalizer(self, window: list[dict], step: int) -> float:
        """The window's pairs (a preference objective) or loss tokens (loss weight); a step training none is refused."""
        count = preference.pairs_in(window) if self.pairs is not None else sum(batch_normalizer(b) for b in window)
        if world_size() == 1:  # under torchrun, a rank's share may hold none while others' do
            check_trained_tokens(count, step, self.dataset.source)
        return count

    def log_and_save(self, step: int, losses: list[torch.Tensor]) -> None:
        """Log every --log-every steps (the global batch's loss, every rank's tokens); checkpoint every --save-every."""
        config, graphed = self.config, self.step.graphed
        if step % config.log_every == 0 or step == config.max_steps:
            graphs = {"step_graphs": len(graphed.graphs)} if graphed is not None else {}  # flat once all are captured
            rewards = self.pairs.metrics.pop(distributed=True) if self.pairs is not None else {}
            self.log.log_steps(step, losses, lr=float(self.step.scheduler.get_last_lr()[0]), **graphs, **rewards)
            losses.clear()
        if (config.save_every and step % config.save_every == 0) or step == config.max_steps:
            self.save(step)

    def save(self, step: int) -> None:
        """Weights, optimizer, scheduler and RNG from rank 0 (the same on every rank), and every rank's loader
        position, published as ``checkpoint-STEP`` once every rank has written its part."""
        with writing_checkpoint(self.out, step, self.dataset) as partial:
            if self.dataset.rank == 0:
                self.model.save_pretrained(partial)
                save_training_state(partial, training_state(self.step.optimizer, self.step.scheduler, step))


def start_plain_run(config: TrainConfig, rank: int, device: torch.device) -> PlainRun:
    """The dataset, the model (resumed from the newest checkpoint with --resume) with its speed options, prewarmed,
    and its optimizer step; a refused run leaves no --out behind."""
    out = Path(config.out)
    check_out(config, out)
    dataset = make_dataset(config)
    check_tokenizer(config, dataset.manifest.inputs.tokenizer)
    vocab_size = dataset.manifest.inputs.tokenizer.vocab_size
    pairs = preference_setup(config, dataset, vocab_size, device)
    out.mkdir(parents=True, exist_ok=True)
    announce_mixture(dataset)
    checkpoint = checkpoint_to_resume(out, rank, lambda line: print(json.dumps(line), flush=True)) if config.resume else None
    refuse_other_precision(config, checkpoint)
    model = load_model(config, vocab_size, attn_implementation_for(config.attn), checkpoint).to(device).train()
    speed = speed_options(config)
    speed.apply(model)
    optimizer, scheduler = adamw_with_warmup(model.parameters(), config.lr, config.weight_decay, config.warmup_steps,
                                             device, config.step_graph)
    first_step = resume_plain_run(checkpoint, optimizer, scheduler, dataset) if checkpoint is not None else 0
    if checkpoint is not None and rank == 0:
        print(json.dumps({"resumed_from": str(checkpoint), "step": first_step}), flush=True)
    autocast_dtype = torch.bfloat16 if config.precision == "bf16" else None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        speed.prewarm(model, model_inputs(next(iter(make_dataset(config))), device, config.full_logits))
    log = Logger(out, getattr(dataset, "names", None), device, writes=rank == 0)
    # On a mixture the loss-position head also gives each sequence's loss, for the loss per source.
    per_sequence = {SEQUENCE_LOSSES: True} if log.source_losses is not None and not config.full_logits else {}
    inputs = lambda batch: {**model_inputs(batch, device, config.full_logits), **per_sequence}  # noqa: E731
    graphed = None
    if config.step_graph:
        # Every shape of the run's first epoch is captured after step 1, so that no later step stops to capture.
        shapes = map(inputs, itertools.islice(make_dataset(config), config.max_steps - first_step))
        graphed = GraphedStep(model, optimizer, config.max_grad_norm, autocast_dtype, shapes=shapes)
    step = TrainStep(data_parallel(model, device), optimizer, scheduler, config.max_grad_norm, autocast_dtype=autocast_dtype,
                     graphed=graphed, inputs=inputs, source_losses=log.source_losses, loss=pairs)
    return PlainRun(config, out, dataset, model, step, log, pairs, first_step)


def train_plain(config: TrainConfig) -> None:
    """The plain loop; under ``torchrun --nproc_per_node N`` each rank reads its share and DDP averages gradients.

    The loss of a step is the mean over every loss token of the global batch (all micro-batches of
    all ranks), whatever each rank's share of them.
    """
    run = start_plain_run(config, *init_distributed())
    batches = iter(run.dataset)
    losses: list[torch.Tensor] = []
    for step in range(run.first_step + 1, config.max_steps + 1):
        window = []
        for _ in range(config.grad_accum):
            batch = next(batches, None)
            if batch is None:  # end of an epoch: the loader's state moves on to the next one
                batches = iter(run.dataset)
                batch = next(batches)
            window.append(batch)
        losses.append(run.step(window, run.normalizer(window, step)))
        for batch in window:
            run.log.add_batch(batch)
        run.log_and_save(step, losses)


# ---- the Hugging Face Trainer ---------------------------------------------------------------


def train_hf(config: TrainConfig) -> None:
    """The same run through ``loaders.train.hf_trainer.PackedTrainer`` (transformers' Trainer, accelerate)."""
    from transformers import TrainingArguments

    from loaders.train.hf_trainer import PackedTrainer

    out = Path(config.out)
    check_out(config, out)
    args = TrainingArguments(
        output_dir=str(out), max_steps=config.max_steps, seed=config.seed, report_to="none",
        per_device_train_batch_size=1,  # a micro-batch is one batch of the dataset (--batch-rows, --tokens-per-batch)
        gradient_accumulation_steps=config.grad_accum, learning_rate=config.lr, weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps, lr_scheduler_type="constant_with_warmup", max_grad_norm=config.max_grad_norm,
        bf16=config.precision == "bf16", logging_steps=config.log_every, save_steps=config.save_every or config.max_steps,
        use_cpu=not torch.cuda.is_available(),
        # The Trainer's filter reads every step's loss on the host, a sync that idles the GPU; a NaN is logged instead.
        logging_nan_inf_filter=False)
    dataset = make_dataset(config)  # after the arguments, which start torch.distributed under torchrun
    check_tokenizer(config, dataset.manifest.inputs.tokenizer)
    check_objective(config, dataset)
    announce_mixture(dataset)
    model = load_model(config, dataset.manifest.inputs.tokenizer.vocab_size, attn_implementation_for(config.attn))
    callbacks = [Logger(out, getattr(dataset, "names", None)).trainer_callback()]
    if config.objective == "sft":
        trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks, speed=speed_options(config))
    else:
        from loaders.train.hf_trainer import PackedDPOTrainer

        objective = preference.PreferenceConfig(config.objective, beta=config.beta, simpo_gamma=config.simpo_gamma)
        trainer = PackedDPOTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks,
                                   preference_config=objective, reference_log_probs=config.reference_log_probs or None)
    out.mkdir(parents=True, exist_ok=True)  # after the checks of a preference run, which leave no --out behind
    checkpoint = resumable_checkpoint(out, world_size()) if config.resume else None
    refuse_other_precision(config, checkpoint)
    trainer.train(resume_from_checkpoint=True if checkpoint is not None else None)


def make_parser() -> argparse.ArgumentParser:
    """The command line: one option per TrainConfig field, each described with its default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for option_field in fields(TrainConfig):
        name, value = option_field.name, option_field.default
        flag = "--" + name.replace("_", "-")
        shown = "off" if value is False else value if value != "" else "none"
        text = f"{option_field.metadata['help']} (default: {shown})"
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(value), default=value, choices=option_field.metadata["choices"], help=text)
    return parser


def counts_problem(config: TrainConfig) -> str | None:
    """A count below its least: --grad-accum 0, --max-steps -1, --log-every 0, ..."""
    for name, least in (("batch_rows", 1), ("grad_accum", 1), ("max_steps", 1), ("log_every", 1),
                        ("tokens_per_batch", 0), ("save_every", 0), ("warmup_steps", 0)):
        if getattr(config, name) < least:
            return (f"--{name.replace('_', '-')} is {getattr(config, name)}; give "
                    + ("a positive integer" if least else "0 or more"))
    return None


def random_init_problem(config: TrainConfig) -> str | None:
    """A --random-init spec with an item that is not key=value."""
    try:
        parse_config_spec(config.random_init)
    except ConfigSpecError as err:
        return f"--random-init {err}"
    return None


def needs(option: str, requirements: tuple[tuple[str, bool], ...]) -> str | None:
    """``OPTION needs ...``, naming every requirement that is not met (``(what, missing)``), or None."""
    missing = [what for what, broken in requirements if broken]
    return f"{option} needs {', '.join(missing)}" if missing else None


def step_graph_problem(config: TrainConfig) -> str | None:
    """--step-graph without what it needs, all of it named."""
    return needs("--step-graph", (
        ("--compile", not config.compile), ("the loss-position head (drop --full-logits)", config.full_logits),
        ("--grad-accum 1", config.grad_accum != 1),
        ("a CUDA GPU", not torch.cuda.is_available()),
        ("one process (not torchrun)", int(os.environ.get("WORLD_SIZE", "1")) > 1))) if config.step_graph else None


def speed_problem(config: TrainConfig) -> str | None:
    """An activation memory budget out of (0, 1] or without --compile; --full-logits with a loss weighted by the head."""
    if not 0 < config.activation_memory_budget <= 1:
        return f"--activation-memory-budget is {config.activation_memory_budget}; give a share in (0, 1]"
    if config.activation_memory_budget < 1 and not config.compile:
        return "--activation-memory-budget applies to compiled layers; add --compile"
    if config.full_logits and config.loss_reduction != "token" and config.trainer == "plain":
        return (f"--loss-reduction {config.loss_reduction} weighs tokens through the loss-position head in the "
                "plain loop; drop --full-logits (or use --trainer hf, which weighs the model's own logits)")
    return None


def objective_problem(config: TrainConfig) -> str | None:
    """A preference objective without what it needs, all of it named."""
    return needs(f"--objective {config.objective}", (
        ("the loss-position head (drop --full-logits)", config.full_logits),
        ("--shards (not --mixture)", bool(config.mixture)), ("--loss-reduction token", config.loss_reduction != "token"),
        ("no --step-graph", config.step_graph),
        ("a finite positive --beta", not (math.isfinite(config.beta) and config.beta > 0)))) if config.objective != "sft" else None


def reference_problem(config: TrainConfig) -> str | None:
    """--reference-log-probs with an objective that uses no reference, or naming no file."""
    if config.reference_log_probs and config.objective not in preference.NEEDS_REFERENCE:
        return (f"--reference-log-probs applies to --objective dpo or ipo, not {config.objective} "
                "(which uses no reference model)")
    if config.reference_log_probs and not Path(config.reference_log_probs).is_file():
        return f"--reference-log-probs {config.reference_log_probs}: no such file"
    return None


# Each returns the problem of options that cannot train together, or None; the first found is the error.
OPTION_CHECKS = (counts_problem, random_init_problem, step_graph_problem, speed_problem, objective_problem,
                 reference_problem)


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = make_parser()
    config = TrainConfig(**vars(parser.parse_args(argv)))
    for check in OPTION_CHECKS:
        if (problem := check(config)) is not None:
            parser.error(problem)
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    print(json.dumps({"config": asdict(config)}), flush=True)
    try:
        (train_hf if config.trainer == "hf" else train_plain)(config)
    except (VarpackError, OSError, ValueError) as err:
        raise SystemExit(f"train.py: error: {str(err).splitlines()[0]}") from None
    except KeyboardInterrupt:
        print(f"train.py: interrupted; --resume continues from the newest checkpoint in {config.out}",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
    if world_size() > 1:
        finish_distributed_run()  # under torchrun: every rank done, no process-group teardown
