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
loops, and computed by ``loaders.train.loss_head`` at labelled positions only (``--full-logits``: the
model's own LM head over every token).
Logs (one JSON object a line, also in ``OUT/log.jsonl``): loss, real tokens/s, peak memory
(GPU memory allocated; on CPU the process's peak resident memory); on a mixture, each source's
tokens (plain loop) and mean token loss (``source_loss``, both loops) since the last line.
Weights stay in fp32; ``--precision bf16`` (default) runs forward and backward under bf16 autocast.

On a preference build, ``--objective dpo|ipo|simpo|orpo --beta B`` trains on its pairs
(``loaders.train.preference``): the loss of a step is the mean over its pairs, the reference (DPO, IPO)
is the starting model, frozen, or ``--reference-log-probs FILE`` computed once beside the build, and the
logs carry TRL's ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` and ``rewards/margins``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders import PackedIterableDataset, PackedMixture, load_mixture_file  # noqa: E402
from loaders.collate import NUM_REAL_TOKENS, SOURCE_IDS  # noqa: E402
from loaders.loss_weights import LossReduction, batch_normalizer  # noqa: E402
from loaders.mixture import source_counts  # noqa: E402
from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.distributed import finish_distributed_run, step_normalizer, world_size  # noqa: E402
from loaders.train.checkpoint import (  # noqa: E402
    TRAINING_STATE,
    CheckpointError,
    checkpoints,
    incomplete_checkpoints,
    latest_checkpoint,
    load_loader_state,
    load_training_state,
    loader_state_name,
    partial_checkpoint,
    publish_checkpoint,
    remove_partial_checkpoints,
    save_loader_state,
    save_training_state,
    start_checkpoint,
)
from loaders.train.loss_head import SEQUENCE_LOSSES, frozen_copy, use_loss_position_head  # noqa: E402
from loaders.train import preference  # noqa: E402
from loaders.train.models import (  # noqa: E402
    check_trained_tokens,
    count_on_device,
    linear_warmup,
    load_causal_lm,
    model_inputs,
    peak_memory_gib,
)
from loaders.train.optim import make_adamw, optimizer_step  # noqa: E402
from loaders.train.source_loss import SourceLosses  # noqa: E402
from loaders.train.speed import SpeedOptions  # noqa: E402
from loaders.train.step_graph import GraphedStep  # noqa: E402
from schemas import TokenizerInputs, VarpackError  # noqa: E402


@dataclass
class TrainConfig:
    """One training run; the CLI maps onto it one to one."""

    shards: str = "shards"
    mixture: str = ""  # a JSON mixture file (sources, weights, unit, max_epochs): read instead of --shards
    model: str = ""  # Hub id or local directory: fine-tune its weights
    gguf_file: str = ""  # a GGUF file in --model to load the weights from
    random_init: str = ""  # "llama", "llama:key=value,...", or a Hub id / directory whose config is used
    trainer: str = "plain"  # plain | hf
    attn: str = "auto"  # auto | flash_attn | torch_varlen | sdpa_segments | sdpa | a transformers implementation
    out: str = "runs/train"
    batch_rows: int = 1
    tokens_per_batch: int = 0  # 0: batch_rows rows per batch
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    precision: str = "bf16"  # bf16 | fp32
    compile: bool = False  # per-layer torch.compile on fixed-shape batches (pad_to_fixed_shape, bucket_shapes)
    step_graph: bool = False  # with --compile: each step one CUDA graph replay (loaders.train.step_graph); one GPU
    activation_memory_budget: float = 1.0  # with --compile: share of the activations compiled layers keep for backward
    full_logits: bool = False  # the model's own LM head and loss over every token, not only labelled ones
    loss_reduction: str = "token"  # token | sequence (loaders/loss_weights.py)
    log_every: int = 10
    save_every: int = 0  # 0: save only at the end
    resume: bool = False
    seed: int = 0
    allow_tokenizer_mismatch: bool = False  # train although --model's tokenizer differs from the shards'
    objective: str = "sft"  # sft | dpo | ipo | simpo | orpo (a preference build's pairs)
    beta: float = 0.1  # the preference objective's beta (ORPO's lambda)
    simpo_gamma: float = 0.5  # SimPO's target margin
    reference_log_probs: str = ""  # DPO/IPO: the reference's log-probs stored beside the build, not a frozen copy


# ---- model, data, logs, checkpoints: shared by both loops -----------------------------------


def parse_random_init(spec: str) -> tuple[str, dict[str, Any]]:
    """``"llama:hidden_size=512,num_hidden_layers=4"`` -> ("llama", {...}); values parsed as JSON when they can be."""
    name, _, overrides = spec.partition(":")
    values: dict[str, Any] = {}
    for item in filter(None, overrides.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--random-init {spec!r}: {item!r} is not key=value")
        try:
            values[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.strip()] = raw
    return name, values


def check_config_overrides(spec: str, defaults: Any, overrides: dict[str, Any]) -> None:
    """Refuse an override the config does not know (``num_hiden_layers``), whose value is not of the kind of the
    config's default (``hidden_size=abc``), or a size or count below 1 (``hidden_size=-16``)."""
    from transformers import PretrainedConfig

    known = sorted(defaults.to_dict())
    own = [key for key in known if key not in PretrainedConfig().to_dict()] or known  # listed without the generic ones
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--random-init {spec}: {key} is not a setting of the {defaults.model_type} "
                             f"config{hint}; its settings: {', '.join(own)}")
    kinds = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"))
    for key, value in overrides.items():
        default = getattr(defaults, key, None)
        sized = key.startswith("num_") or key.endswith("_size")
        if sized and isinstance(default, int) and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"--random-init {spec}: {key}={value} must be a positive integer")
        default = getattr(defaults, key, None)
        for kind, described in kinds:
            if isinstance(default, kind):
                accepted = (int, float) if kind is float else kind
                if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                    raise ValueError(f"--random-init {spec}: {key}={value!r} must be {described} "
                                     f"(the config's default is {default!r})")
                break


def load_model(config: TrainConfig, vocab_size: int, attn_implementation: str, checkpoint: Path | None = None):
    """The model to train: a checkpoint's weights, a Hub id / directory's weights, or a random init."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    if checkpoint is not None or config.model:
        gguf_file = None if checkpoint is not None else config.gguf_file or None
        source = str(checkpoint or config.model)
        model = load_causal_lm(source, attn_implementation, torch.float32, gguf_file)
    elif config.random_init:
        name, overrides = parse_random_init(config.random_init)
        defaults = CONFIG_MAPPING[name]() if name in CONFIG_MAPPING else AutoConfig.from_pretrained(name)
        check_config_overrides(config.random_init, defaults, overrides)
        torch.manual_seed(config.seed)
        try:
            if name in CONFIG_MAPPING:
                model_config = AutoConfig.for_model(name, **{"vocab_size": vocab_size, **overrides})
            else:
                model_config = AutoConfig.from_pretrained(name, **overrides)
            model = AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation,
                                                     dtype=torch.float32)
        except (StrictDataclassError, RuntimeError) as err:  # the config's own checks, or a size torch refuses
            reason = [line.strip() for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
            raise ValueError(f"--random-init {config.random_init}: no model can be built from it ({reason[0]})") from None
    else:
        raise ValueError("give --model (Hub id or directory) or --random-init (config spec)")
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the shards' tokenizer's "
                         f"({vocab_size}): these shards were tokenized for another model")
    # A cache makes transformers' sdpa path ignore packed boundaries; training never needs one.
    model.config.use_cache = False
    return model


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


LOG = "log.jsonl"


class Logger:
    """Real tokens/s, loss and peak memory since the last line, as JSON to stdout and OUT/log.jsonl.

    On a mixture, also the real and loss tokens of each source since the last line (``source_tokens``)
    and each source's mean token loss over them (``source_loss``, summed on ``device``: see
    ``loaders.train.source_loss``; the plain mean, whatever ``--loss-reduction``).
    """

    def __init__(self, out: Path, sources: list[str] | None = None, device: torch.device | str = "cpu",
                 writes: bool = True) -> None:
        self.path = out / LOG
        self.writes = writes  # under torchrun, rank 0 writes; every rank counts and starts again at each line
        self.tokens = 0
        self.sources = sources or []
        self.source_tokens = np.zeros((2, len(self.sources)), dtype=np.int64)
        self.source_losses = SourceLosses(self.sources, device) if self.sources else None
        self.start = time.perf_counter()

    def add_batch(self, batch: dict) -> None:
        self.tokens += batch[NUM_REAL_TOKENS]
        if SOURCE_IDS in batch:
            counts = source_counts(batch, len(self.sources))
            self.source_tokens += np.stack((counts["tokens"], counts["loss_tokens"]))

    def log(self, step: int, **values: Any) -> dict:
        now = time.perf_counter()
        record = {"step": step, **values, "tokens_per_s": self.tokens / max(now - self.start, 1e-9), "peak_mem_gib": peak_memory_gib()}
        if self.sources:
            record["source_tokens"] = {name: {"tokens": int(tokens), "loss_tokens": int(loss)}
                                       for name, tokens, loss in zip(self.sources, *self.source_tokens)}
            self.source_tokens[:] = 0
        if self.source_losses is not None:
            record["source_loss"] = self.source_losses.pop(distributed=True)
        self.tokens, self.start = 0, now
        if self.writes:
            self.write(record)
        return record

    def write(self, record: dict) -> None:
        print(json.dumps(record), flush=True)
        with open_log(self.path) as f:
            f.write(json.dumps(record) + "\n")


def open_log(path: Path):
    """``path`` opened to append, never through a link planted there (O_NOFOLLOW): an OSError naming it instead."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if not path.is_symlink():
            raise
        raise OSError(f"{path}: is a link, and the log is never written through one; remove it") from err
    return os.fdopen(fd, "a")


# ---- the plain PyTorch loop -----------------------------------------------------------------


def init_distributed() -> tuple[int, torch.device]:
    """Join the process group ``torchrun`` describes (NCCL on GPUs, gloo on CPUs): ``(rank, device)``.

    A plain ``python scripts/train.py`` is rank 0 of one.
    """
    import os

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def rng_state() -> dict[str, Any]:
    """torch's, numpy's and Python's RNG states as tensors and plain values (what ``weights_only`` loads)."""
    numpy_state = np.random.get_state(legacy=False)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {**numpy_state, "state": {"key": numpy_state["state"]["key"].tolist(),
                                               "pos": numpy_state["state"]["pos"]}}}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {"key": np.array(numpy_state["state"]["key"], dtype=np.uint32),
                                                  "pos": numpy_state["state"]["pos"]}})


def save_plain_checkpoint(out: Path, step: int, model, optimizer, scheduler, dataset: PackedIterableDataset) -> Path:
    """Weights, optimizer, scheduler and RNG from rank 0 (the same on every rank), and every rank's loader position.

    Written into a temporary directory that is renamed ``checkpoint-STEP`` once every rank has written its part.
    """
    distributed = world_size() > 1
    if dataset.rank == 0:
        start_checkpoint(out, step)
    if distributed:
        torch.distributed.barrier()  # the temporary directory exists
    partial = partial_checkpoint(out, step)
    try:
        if dataset.rank == 0:
            model.save_pretrained(partial)
            save_training_state(partial, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                          "step": step, "rng": rng_state()})
        save_loader_state(partial, dataset.rank, dataset.state_dict())
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk: safetensors and torch.save raise their own
        if dataset.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise OSError(f"{out / f'checkpoint-{step}'}: cannot be written ({str(err).splitlines()[0]}); nothing of it "
                      "is kept: free space (or fix --out) and --resume from the previous checkpoint") from None
    if distributed:
        torch.distributed.barrier()  # every rank has written its part
    path = publish_checkpoint(out, step) if dataset.rank == 0 else out / f"checkpoint-{step}"
    if distributed:
        torch.distributed.barrier()  # published before any rank goes on
    return path


def check_out(config: TrainConfig, out: Path) -> None:
    """Refuse a new run (no --resume) into an --out that holds another run's checkpoints: a later --resume would
    continue from whichever is newest, of either run."""
    if (out / LOG).is_symlink():
        raise OSError(f"{out / LOG}: is a link, and the log is never written through one; remove it")
    found = checkpoints(out) if out.is_dir() else []
    if found and not config.resume:
        names = found[0].name if len(found) == 1 else f"{found[0].name} ... {found[-1].name}"
        raise CheckpointError(f"--out {out} holds the checkpoints of an earlier run ({names}); pass --resume to "
                              "continue it, give another --out, or remove them")


def resumable_checkpoint(out: Path, ranks: int) -> Path | None:
    """The newest complete checkpoint in ``out``, or None when it holds none at all; a CheckpointError when it holds
    checkpoints but none complete, so that --resume never trains from step 0 over them."""
    latest = latest_checkpoint(out, ranks)
    found = checkpoints(out) if out.is_dir() else []
    if latest is None and found:
        raise CheckpointError(f"--out {out}: --resume found no complete checkpoint among {len(found)} "
                              f"({', '.join(path.name for path in found)}): each lacks a rank's loader state; remove "
                              "them to start again, or give another --out")
    return latest


def check_optimizer_shapes(optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless each parameter's optimizer state tensors (AdamW's moments) have the parameter's shape."""
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"the optimizer's {key} of parameter {index} has shape {tuple(value.shape)}, the "
                                 f"parameter {tuple(param.shape)}")


def find_checkpoint(out: Path, rank: int) -> Path | None:
    """The newest complete checkpoint in ``out``; rank 0 says which incomplete ones it passes over and removes
    the temporary directories of saves that were killed."""
    ranks = world_size()
    if rank == 0:
        for path in remove_partial_checkpoints(out):
            print(json.dumps({"removed_unfinished_checkpoint": str(path)}), flush=True)
        for path in incomplete_checkpoints(out, ranks):
            print(json.dumps({"skipped_incomplete_checkpoint": str(path)}), flush=True)
    if ranks > 1:
        torch.distributed.barrier()  # nothing is removed while another rank looks
    return resumable_checkpoint(out, ranks)


@dataclass
class PreferenceTraining:
    """A preference objective's settings, reference and reward metrics for the plain loop."""

    config: preference.PreferenceConfig
    reference: preference.Reference | None
    metrics: preference.RewardMetrics


def preference_setup(config: TrainConfig, dataset: PackedIterableDataset, vocab_size: int,
                     device: torch.device) -> PreferenceTraining | None:
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
    return PreferenceTraining(objective, reference, preference.RewardMetrics(device))


def check_objective(config: TrainConfig, dataset: PackedIterableDataset) -> None:
    """Refuse --objective sft on a preference build (it would train on the rejected answers) and a preference
    objective on any other build."""
    manifests = dataset.manifests().values() if isinstance(dataset, PackedMixture) else [dataset.manifest]
    preference_build = any(manifest.preference_layout is not None for manifest in manifests)
    if config.objective == "sft" and preference_build:
        raise ValueError(f"--objective sft: {config.shards or config.mixture} {preference.NOT_SFT}; give --objective "
                         f"{', '.join(o.value for o in preference.Objective)}")
    if config.objective != "sft" and not preference_build:
        raise ValueError(f"--objective {config.objective} {preference.NOT_PREFERENCE}")


def train_plain(config: TrainConfig) -> None:
    """The plain loop; under ``torchrun --nproc_per_node N`` each rank reads its share and DDP averages gradients.

    The loss of a step is the mean over every loss token of the global batch (all micro-batches of
    all ranks), whatever each rank's share of them.
    """
    rank, device = init_distributed()
    out = Path(config.out)
    check_out(config, out)
    dataset = make_dataset(config)
    check_tokenizer(config, dataset.manifest.inputs.tokenizer)
    vocab_size = dataset.manifest.inputs.tokenizer.vocab_size
    pairs = preference_setup(config, dataset, vocab_size, device)  # a refused run leaves no --out behind
    out.mkdir(parents=True, exist_ok=True)
    announce_mixture(dataset)
    checkpoint = find_checkpoint(out, rank) if config.resume else None
    model = load_model(config, vocab_size, attn_implementation_for(config.attn), checkpoint).to(device)
    model.train()
    speed = speed_options(config)
    speed.apply(model)
    optimizer = make_adamw(model.parameters(), config.lr, config.weight_decay, device, config.step_graph)
    scheduler = linear_warmup(optimizer, config.warmup_steps)
    step = 0
    if checkpoint is not None:
        loader_state = load_loader_state(checkpoint, rank)
        state = load_training_state(checkpoint)
        try:
            optimizer.load_state_dict(state["optimizer"])
            check_optimizer_shapes(optimizer)
            scheduler.load_state_dict(state["scheduler"])
            step = state["step"]
            saved_step = int(checkpoint.name.removeprefix("checkpoint-"))
            if type(step) is not int or step != saved_step:
                raise ValueError(f"its step {step!r} is not the checkpoint's, {saved_step}")
            set_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"{checkpoint / TRAINING_STATE}: not a training state of this model and optimizer "
                                  f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); resume from "
                                  "another checkpoint, or start a new --out") from None
        try:
            dataset.load_state_dict(loader_state)
        except ValueError as err:
            raise CheckpointError(f"{checkpoint / loader_state_name(rank)}: {err}") from None
        if rank == 0:
            print(json.dumps({"resumed_from": str(checkpoint), "step": step}), flush=True)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    with autocast:
        speed.prewarm(model, model_inputs(next(iter(make_dataset(config))), device, config.full_logits))
    ranks = world_size()
    trained = model
    if ranks > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    logger = Logger(out, getattr(dataset, "names", None), device, writes=rank == 0)
    source_losses = logger.source_losses
    # On a mixture the loss-position head also gives each sequence's loss, for the loss per source.
    per_sequence = {SEQUENCE_LOSSES: True} if source_losses is not None and not config.full_logits else {}
    losses: list[torch.Tensor] = []

    def micro_batch_loss(batch: dict, num_items: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch, to call backward on; on a mixture its loss per source is added up
        first, so that a model's full logits are not kept through the backward pass."""
        if pairs is not None:  # a preference objective: the batch's per-pair losses over the window's pairs
            inputs = preference.model_inputs(model_inputs(batch, device, config.full_logits))
            terms = preference.preference_terms(trained, batch, pairs.config, pairs.reference, inputs)
            pairs.metrics.add(terms)
            return terms.losses.sum() / num_items
        outputs = trained(**model_inputs(batch, device, config.full_logits), num_items_in_batch=num_items, **per_sequence)
        if source_losses is not None:
            source_losses.add_outputs(outputs, batch)
        return outputs.loss

    def log_and_save(step: int) -> None:
        """Log every --log-every steps (the global batch's loss, every rank's tokens); checkpoint every --save-every."""
        if step % config.log_every == 0 or step == config.max_steps:
            mean_loss = torch.stack(losses).mean()
            if ranks > 1:
                totals = torch.stack([mean_loss, count_on_device(logger.tokens, device)])
                torch.distributed.all_reduce(totals)
                mean_loss, logger.tokens = totals[0] / ranks, int(totals[1].item())
                if logger.sources:
                    sources = torch.from_numpy(logger.source_tokens).to(device)
                    torch.distributed.all_reduce(sources)
                    logger.source_tokens = sources.cpu().numpy()
            graphs = {"step_graphs": len(graphed.graphs)} if graphed is not None else {}  # flat once all are captured
            rewards = pairs.metrics.pop(distributed=True) if pairs is not None else {}
            logger.log(step, loss=mean_loss.item(), lr=float(scheduler.get_last_lr()[0]), **graphs, **rewards)
            losses.clear()
        if (config.save_every and step % config.save_every == 0) or step == config.max_steps:
            save_plain_checkpoint(out, step, model, optimizer, scheduler, dataset)

    graphed = None
    if config.step_graph:
        # Every shape of the run's first epoch is captured after step 1, so that no later step stops to capture.
        shapes = ({**model_inputs(batch, device, False), **per_sequence}
                  for batch in itertools.islice(make_dataset(config), config.max_steps - step))
        graphed = GraphedStep(model, optimizer, config.max_grad_norm, torch.bfloat16 if config.precision == "bf16" else None,
                              shapes=shapes)
    batches = iter(dataset)
    while step < config.max_steps:
        window = []
        for _ in range(config.grad_accum):
            batch = next(batches, None)
            if batch is None:  # end of an epoch: the loader's state moves on to the next one
                batches = iter(dataset)
                batch = next(batches)
            window.append(batch)
        local_items = preference.pairs_in(window) if pairs is not None else sum(batch_normalizer(b) for b in window)
        if ranks == 1:  # under torchrun, a rank's share may hold none while others' do
            check_trained_tokens(local_items, step + 1, dataset.source)
        if graphed is not None:  # one GPU, one micro-batch: the whole step is a graph replay
            (batch,) = window
            losses.append(graphed({**model_inputs(batch, device, False), **per_sequence}, local_items))
            if source_losses is not None:
                assert graphed.sequence_losses is not None  # the batch asked for them
                source_losses.add(graphed.sequence_losses, batch[SOURCE_IDS])
            logger.add_batch(batch)
            scheduler.step()
            step += 1
            log_and_save(step)
            continue
        # DDP averages gradients over ranks: dividing by the global count / ranks makes them the global mean.
        num_items = step_normalizer(local_items, device) if ranks > 1 else count_on_device(local_items, device)
        step_loss = torch.zeros((), device=device)
        for i, batch in enumerate(window):
            sync = contextlib.nullcontext() if ranks == 1 or i == len(window) - 1 else trained.no_sync()
            with sync:
                with autocast:
                    loss = micro_batch_loss(batch, num_items)
                loss.backward()
            step_loss += loss.detach()
            logger.add_batch(batch)
        optimizer_step(model.parameters(), optimizer, scheduler, config.max_grad_norm)
        step += 1
        losses.append(step_loss)
        log_and_save(step)


# ---- the Hugging Face Trainer ---------------------------------------------------------------


def train_hf(config: TrainConfig) -> None:
    """The same run through ``loaders.train.hf_trainer.PackedTrainer`` (transformers' Trainer, accelerate)."""
    from transformers import TrainerCallback, TrainingArguments

    from loaders.train.hf_trainer import PackedTrainer

    out = Path(config.out)
    check_out(config, out)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=config.max_steps,
        per_device_train_batch_size=1,  # a micro-batch is one batch of the dataset (--batch-rows, --tokens-per-batch)
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        max_grad_norm=config.max_grad_norm,
        bf16=config.precision == "bf16",
        logging_steps=config.log_every,
        save_steps=config.save_every or config.max_steps,
        seed=config.seed,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    dataset = make_dataset(config)  # after the arguments, which start torch.distributed under torchrun
    check_tokenizer(config, dataset.manifest.inputs.tokenizer)
    check_objective(config, dataset)
    announce_mixture(dataset)
    vocab_size = dataset.manifest.inputs.tokenizer.vocab_size
    model = load_model(config, vocab_size, attn_implementation_for(config.attn))
    logger = Logger(out)
    sources = getattr(dataset, "names", [])

    class LogToFile(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                record = {"step": state.global_step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                          "tokens_per_s": logs["real_tokens_per_s"], "peak_mem_gib": peak_memory_gib()}
                record.update({name: logs[name] for name in preference.REWARD_METRICS if name in logs})
                if sources:  # PackedTrainer's train_NAME_loss
                    record["source_loss"] = {name: logs.get(f"train_{name}_loss") for name in sources}
                logger.write(record)

    if config.objective == "sft":
        trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, callbacks=[LogToFile()], speed=speed_options(config))
    else:
        from loaders.train.hf_trainer import PackedDPOTrainer

        objective = preference.PreferenceConfig(config.objective, beta=config.beta, simpo_gamma=config.simpo_gamma)
        trainer = PackedDPOTrainer(model=model, args=args, train_dataset=dataset, callbacks=[LogToFile()],
                                   preference_config=objective, reference_log_probs=config.reference_log_probs or None)
    out.mkdir(parents=True, exist_ok=True)  # after the checks of a preference run, which leave no --out behind
    trainer.train(resume_from_checkpoint=True if config.resume and resumable_checkpoint(out, world_size()) else None)


# What each option of TrainConfig does, for --help.
OPTION_HELP = {
    "shards": "shard directory or manifest (local, or an fsspec URL such as s3://)",
    "mixture": "a JSON mixture file (sources, weights, unit, max_epochs; docs/mixtures.md) read instead of --shards",
    "model": "Hub id or local directory whose weights are fine-tuned",
    "gguf_file": "GGUF file in the --model directory to take the weights from (dequantized; checkpoints are saved as "
                 "plain safetensors)",
    "random_init": "random init from a config: a model type with overrides (llama:hidden_size=512,...) "
                   "or a Hub id / directory whose config is used",
    "trainer": "training loop: plain (PyTorch) or hf (Hugging Face Trainer)",
    "attn": "attention backend: auto (the best here), flash_attn, torch_varlen, sdpa_segments (per example; "
            "the CPU choice), sdpa, or a transformers implementation such as flash_attention_2",
    "out": "directory for log.jsonl and checkpoints",
    "batch_rows": "packed rows per batch (ignored with --tokens-per-batch)",
    "tokens_per_batch": "tokens per batch instead of a fixed row count; 0 uses --batch-rows",
    "grad_accum": "batches per optimizer step",
    "max_steps": "optimizer steps to train for",
    "lr": "learning rate (AdamW), constant after the warm-up",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps",
    "max_grad_norm": "gradient clipping norm",
    "precision": "bf16 (autocast, fp32 weights) or fp32",
    "compile": "fixed-shape batches and per-layer torch.compile",
    "step_graph": "with --compile: each optimizer step (forward, backward, clipping, AdamW) replayed as one CUDA graph "
                  "per batch shape; one GPU, --grad-accum 1, the plain loop",
    "activation_memory_budget": "with --compile: the share of their activations the compiled layers keep for backward, "
                                "recomputing the rest (0.9 cut peak memory by a quarter at 32k tokens a step for 1%% "
                                "of the speed)",
    "full_logits": "use the model's own LM head and loss over every token, not only the labelled ones",
    "loss_reduction": "token: every trained token weighs the same; sequence: every example weighs the same "
                      "(the plain loop needs the loss-position head for it)",
    "log_every": "log every N optimizer steps",
    "save_every": "checkpoint every N steps; 0 saves only at the end",
    "resume": "resume from the latest checkpoint in --out (weights, optimizer, scheduler, loader position)",
    "seed": "seed of the model init and the loader's shuffle",
    "allow_tokenizer_mismatch": "train although the tokenizer in the --model directory differs from the one the shards "
                                "were built with",
    "objective": "sft (next-token loss), or on a preference build's pairs dpo (sigmoid), ipo, simpo or orpo",
    "beta": "the preference objective's beta (DPO, IPO, SimPO; ORPO's lambda)",
    "simpo_gamma": "SimPO's target reward margin (TRL's simpo_gamma)",
    "reference_log_probs": "dpo, ipo: the reference model's log-probs stored beside the build "
                           "(loaders.train.preference.write_reference_log_probs) instead of a frozen copy of the model",
}
CHOICES = {"trainer": ("plain", "hf"), "precision": ("bf16", "fp32"), "loss_reduction": tuple(LossReduction),
           "objective": ("sft", *(objective.value for objective in preference.Objective))}


def make_parser() -> argparse.ArgumentParser:
    """The command line: one option per TrainConfig field, each described with its default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(TrainConfig()).items():
        flag = "--" + name.replace("_", "-")
        shown = "off" if value is False else value if value != "" else "none"
        text = f"{OPTION_HELP[name]} (default: {shown})"
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(value), default=value, choices=CHOICES.get(name), help=text)
    return parser


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = make_parser()
    config = TrainConfig(**vars(parser.parse_args(argv)))
    for name, least in (("batch_rows", 1), ("grad_accum", 1), ("max_steps", 1), ("log_every", 1),
                        ("tokens_per_batch", 0), ("save_every", 0), ("warmup_steps", 0)):
        if getattr(config, name) < least:
            parser.error(f"--{name.replace('_', '-')} is {getattr(config, name)}; give "
                         + ("a positive integer" if least else "0 or more"))
    if config.random_init:
        try:
            parse_random_init(config.random_init)
        except ValueError as err:
            parser.error(str(err))
    if config.step_graph:
        needs = [why for why, broken in (
            ("--compile", not config.compile), ("the loss-position head (drop --full-logits)", config.full_logits),
            ("--grad-accum 1", config.grad_accum != 1), ("--trainer plain", config.trainer != "plain"),
            ("a CUDA GPU", not torch.cuda.is_available()),
            ("one process (not torchrun)", int(os.environ.get("WORLD_SIZE", "1")) > 1)) if broken]
        if needs:
            parser.error(f"--step-graph needs {', '.join(needs)}")
    if not 0 < config.activation_memory_budget <= 1:
        parser.error(f"--activation-memory-budget is {config.activation_memory_budget}; give a share in (0, 1]")
    if config.activation_memory_budget < 1 and not config.compile:
        parser.error("--activation-memory-budget applies to compiled layers; add --compile")
    if config.full_logits and config.loss_reduction != "token" and config.trainer == "plain":
        parser.error(f"--loss-reduction {config.loss_reduction} weighs tokens through the loss-position head in the "
                     "plain loop; drop --full-logits (or use --trainer hf, which weighs the model's own logits)")
    if config.objective != "sft":
        needs = [why for why, broken in (
            ("the loss-position head (drop --full-logits)", config.full_logits),
            ("--shards (not --mixture)", bool(config.mixture)), ("--loss-reduction token", config.loss_reduction != "token"),
            ("no --step-graph", config.step_graph),
            ("a finite positive --beta", not (math.isfinite(config.beta) and config.beta > 0))) if broken]
        if needs:
            parser.error(f"--objective {config.objective} needs {', '.join(needs)}")
    if config.reference_log_probs:
        if config.objective not in preference.NEEDS_REFERENCE:
            parser.error(f"--reference-log-probs applies to --objective dpo or ipo, not {config.objective} "
                         "(which uses no reference model)")
        if not Path(config.reference_log_probs).is_file():
            parser.error(f"--reference-log-probs {config.reference_log_probs}: no such file")
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
