"""PackedTrainer with ``SpeedOptions(step_graph=True)``: each micro-batch's forward and backward replayed as a CUDA
graph trains as the Trainer's own step does, and what a graph cannot hold is refused in one line.

The GPU tests run on the GPU machine and are skipped without CUDA; the refusals run anywhere."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from shard_factory import build_shard_dir
from test_step_graph import CAPACITY, VOCAB, bucketed_batches, gpu_llama
from tiny_model import tiny_llama

from loaders import PackedIterableDataset
from loaders.train.speed import SpeedOptions

STEPS = 32
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
GRAPHED = SpeedOptions(compile=True, step_graph=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """FLAN-shaped examples packed into 512-token rows: about fifty batches of two rows an epoch."""
    lengths = np.clip(np.random.default_rng(4).lognormal(4.5, 0.9, 400), 16, 600).astype(np.int64)
    return str(build_shard_dir(tmp_path_factory.mktemp("shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB, seed=4).path)


class TwoProcesses(transformers.TrainingArguments):
    """TrainingArguments as under torchrun with two ranks, without starting them."""

    @property
    def world_size(self) -> int:
        return 2


@pytest.mark.parametrize(("arguments", "settings", "message"), [
    (transformers.TrainingArguments, {"gradient_accumulation_steps": 2},
     "PackedTrainer: step_graph needs gradient_accumulation_steps=1, not 2: a graph holds one micro-batch's gradients"),
    (TwoProcesses, {}, "PackedTrainer: step_graph runs on one process, not 2"),
    (transformers.TrainingArguments, {"fp16": True}, "step_graph does not scale the loss for fp16's gradient scaler"),
    (transformers.TrainingArguments, {"gradient_checkpointing": True}, "step_graph cannot capture gradient checkpointing"),
    (transformers.TrainingArguments, {"torch_compile": True}, "set torch_compile=False in TrainingArguments"),
    (transformers.TrainingArguments, {"optim": "adalomo"}, "cannot run optim='adalomo', which updates the weights inside"),
    (transformers.TrainingArguments, {"model_checkpointing": True}, "cannot capture the model's gradient checkpointing"),
    (transformers.TrainingArguments, {}, "PackedTrainer: step_graph replays CUDA graphs and needs a CUDA GPU"),
])
def test_the_trainer_refuses_what_a_graph_cannot_hold(shards, tmp_path, arguments, settings, message):
    from loaders.train.hf_trainer import PackedTrainer

    out = tmp_path / "out"
    model = tiny_llama(VOCAB, CAPACITY)
    if settings.pop("model_checkpointing", False):  # turned on on the model, as PEFT's prepare_model_for_kbit_training does
        model.gradient_checkpointing_enable()
    args = arguments(output_dir=str(out), max_steps=2, report_to="none", use_cpu=True, **settings)
    dataset = PackedIterableDataset(shards, batch_rows=2, seed=1, **GRAPHED.dataset_options())
    with pytest.raises(ValueError, match=message) as refused:
        PackedTrainer(model=model, args=args, train_dataset=dataset, speed=GRAPHED)
    assert "\n" not in str(refused.value)
    assert not out.exists(), "nothing is written before the refusal"


@pytest.mark.gpu
@needs_gpu
def test_each_replay_leaves_the_eager_backwards_gradients(tmp_path):
    """GraphedForwardBackward on batches of several shapes, ``zero_grad()`` between them as the Trainer does: after
    each replay every reached parameter's ``.grad`` is the eager backward's on that batch, and the loss its loss; a
    parameter the forward does not reach keeps ``.grad`` None."""
    from loaders.train.loss_head import use_loss_position_head
    from loaders.train.models import compile_layers, prewarm_buckets
    from loaders.train.step_graph import GraphedForwardBackward

    batches = bucketed_batches(tmp_path, 12)
    model = use_loss_position_head(gpu_llama())
    model.register_parameter("unreached", torch.nn.Parameter(torch.ones(8, device="cuda", dtype=torch.bfloat16)))
    compile_layers(model)
    prewarm_buckets(model, batches[0])
    graphed = GraphedForwardBackward(model)
    for batch in batches:
        count = torch.tensor(float(batch["num_loss_tokens"]), device="cuda")
        want_loss = model(**batch, num_items_in_batch=count).loss
        want_loss.backward()
        # Held with its autograd graph, the eager loss would keep the AccumulateGrad nodes of the default stream
        # alive into the capture, which then fails (a capture may not wait on the legacy stream).
        want_loss = want_loss.detach()
        want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        loss = graphed(batch, count)
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-2, atol=1e-3)
        assert model.unreached.grad is None and "unreached" not in want
        for name, p in model.named_parameters():
            if name != "unreached":
                # bf16 weights: the padded labelled rows change some matmuls' shapes, and so their rounding.
                err = ((p.grad.float() - want[name].float()).norm() / want[name].float().norm()).item()
                assert err < 2e-2, f"{name}: the replay's gradient differs from the eager one by {err:.3g}"
        model.zero_grad()
    assert graphed.replays == len(batches) and len(graphed.graphs) < len(batches)


class Record(transformers.TrainerCallback):
    """Each step's logged loss and grad_norm, the graphs captured by the end of step 2, and whether the parameter
    the forward never reaches had a gradient at any optimizer step."""

    trainer: Any = None

    def __init__(self, start: dict[str, torch.Tensor]) -> None:
        self.start = start  # the weights before the first step
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.source_losses: list[dict[str, float]] = []  # a mixture's train_NAME_loss
        self.graphs_after_step_2: int | None = None
        self.unreached_got_a_grad = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.grad_norms.append(logs["grad_norm"])
            self.source_losses.append({k: v for k, v in logs.items() if k.startswith("train_") and k.endswith("_loss")})

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        unreached = getattr(model, "unreached", None)
        self.unreached_got_a_grad |= unreached is not None and unreached.grad is not None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.graphs_after_step_2 = len(self.trainer.graphed.graphs) if self.trainer.graphed is not None else 0


def gpu_model(lora: bool) -> torch.nn.Module:
    """``gpu_llama`` (seeded) with a parameter its forward never reaches, or with LoRA adapters on its attention."""
    model = gpu_llama()
    if not lora:
        model.register_parameter("unreached", torch.nn.Parameter(torch.ones(8, device="cuda", dtype=torch.bfloat16)))
        return model
    import peft

    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, lora_config)


def train(shards: str | dict[str, str], out, step_graph: bool, lora: bool = False, resume: str | None = None,
          **options: Any):
    """A PackedTrainer run of STEPS steps on bucketed batches of ``shards`` (a dict: a PackedMixture of those builds,
    weighted 2:1) with compiled layers, logged every step, checkpointed at STEPS // 2; returns the trainer and its
    record."""
    from loaders import PackedMixture
    from loaders.train.hf_trainer import PackedTrainer

    speed = SpeedOptions(compile=True, step_graph=step_graph)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, logging_steps=1, save_steps=STEPS // 2, report_to="none", seed=0,
        learning_rate=2e-3, lr_scheduler_type="constant_with_warmup", warmup_steps=4, max_grad_norm=1.0,
        logging_nan_inf_filter=False)
    options = {"batch_rows": 2, "seed": 1, **speed.dataset_options(), **options}
    if isinstance(shards, dict):
        dataset = PackedMixture(shards, weights=dict(zip(shards, (2, 1))), **options)
    else:
        dataset = PackedIterableDataset(shards, **options)
    model = gpu_model(lora)
    record = Record({name: p.detach().clone() for name, p in model.named_parameters()})
    trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, speed=speed, callbacks=[record])
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


def assert_same_training(got, want, trainer, eager_trainer) -> None:
    """Losses and grad norms per step and final weights agree within bf16's rounding (the tolerances of
    test_step_graph.py): the graph runs the eager step's kernels, but its head gathers the labelled rows padded to
    LOSS_ROWS_BUCKET, so some matmuls take other shapes and round otherwise, and the differences carry through the
    steps; a grad norm sums every such difference, hence its wider tolerance."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=2e-2)
    assert len(got.grad_norms) == STEPS and all(math.isfinite(norm) for norm in got.grad_norms)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=5e-2)
    want_weights = dict(eager_trainer.model.named_parameters())
    moved_most = 0.0
    for name, q in trainer.model.named_parameters():
        p, start = want_weights[name].float(), want.start[name].float()
        moved = ((p - start).norm() / p.norm()).item()
        err = ((p - q.float()).norm() / p.norm()).item()
        assert err < max(2e-2, moved / 10), f"{name}: weights differ by {err:.3g}, moved by {moved:.3g}"
        moved_most = max(moved_most, moved)
    assert moved_most > 1e-2, "the runs should have changed the weights"


@pytest.mark.gpu
@needs_gpu
def test_graphed_trainer_trains_like_the_trainer(shards, tmp_path):
    """Same seed, with and without the graph: the same losses, grad norms and weights; every shape of the epoch
    ahead captured before step 2, none later, and replayed; the unreached parameter never got a gradient."""
    graphed, got = train(shards, tmp_path / "graphed", step_graph=True)
    eager, want = train(shards, tmp_path / "eager", step_graph=False)
    assert len(got.losses) == len(want.losses) == STEPS
    assert graphed.graphed is not None and graphed.graphed.replays == STEPS - 1
    assert 2 * len(graphed.graphed.graphs) <= STEPS, "shapes should repeat, so most steps are replays of a graph"
    assert got.graphs_after_step_2 == len(graphed.graphed.graphs) >= 1, "every shape was captured before step 2"
    assert not got.unreached_got_a_grad and not want.unreached_got_a_grad
    assert torch.equal(graphed.model.unreached, torch.ones_like(graphed.model.unreached))
    assert_same_training(got, want, graphed, eager)


@pytest.mark.gpu
@needs_gpu
def test_graphed_trainer_reports_a_mixtures_sources_and_weighs_sequences_like_the_trainer(tmp_path_factory, tmp_path):
    """On a mixture, weighting every example the same (``loss_reduction="sequence"``: the graph's head reads
    ``loss_weights``), each source's logged loss (the graph's per-sequence output) is the Trainer's."""
    rng = np.random.default_rng(5)
    root = tmp_path_factory.mktemp("mixture")
    builds = {name: str(build_shard_dir(root / name, np.clip(rng.lognormal(mean, 0.8, 200), 16, 600).astype(np.int64),
                                        capacity=CAPACITY, vocab_size=VOCAB, seed=seed).path)
              for name, mean, seed in (("flan", 4.5, 1), ("chat", 5.2, 2))}
    graphed, got = train(builds, tmp_path / "graphed", step_graph=True, loss_reduction="sequence")
    eager, want = train(builds, tmp_path / "eager", step_graph=False, loss_reduction="sequence")
    assert graphed.graphed is not None and graphed.graphed.replays == STEPS - 1
    # A step's log names the sources its batch held.
    assert [set(logged) for logged in got.source_losses] == [set(logged) for logged in want.source_losses]
    assert set().union(*want.source_losses) == {"train_flan_loss", "train_chat_loss"}
    np.testing.assert_allclose([logged[name] for logged in got.source_losses for name in sorted(logged)],
                               [logged[name] for logged in want.source_losses for name in sorted(logged)], rtol=2e-2)
    assert_same_training(got, want, graphed, eager)


@pytest.mark.gpu
@needs_gpu
def test_graphed_trainer_resumes_with_the_losses_of_an_uninterrupted_run(shards, tmp_path):
    """A run saved at STEPS // 2 and resumed from there, with the graph, logs the uninterrupted run's losses."""
    _, whole = train(shards, tmp_path / "run", step_graph=True)
    resumed, again = train(shards, tmp_path / "run", step_graph=True, resume=str(tmp_path / "run" / f"checkpoint-{STEPS // 2}"))
    assert len(again.losses) == STEPS - STEPS // 2
    np.testing.assert_allclose(again.losses, whole.losses[STEPS // 2:], rtol=2e-2)
    assert resumed.graphed is not None and resumed.graphed.replays == STEPS - STEPS // 2 - 1


@pytest.mark.gpu
@needs_gpu
def test_graphed_trainer_trains_lora_adapters_like_the_trainer(shards, tmp_path):
    """LoRA: only the adapters are trained and get gradients; the frozen base weights get none and stay as they were."""
    pytest.importorskip("peft")
    graphed, got = train(shards, tmp_path / "graphed", step_graph=True, lora=True)
    eager, want = train(shards, tmp_path / "eager", step_graph=False, lora=True)
    assert graphed.graphed is not None and graphed.graphed.replays == STEPS - 1
    trained = graphed.graphed.params
    assert trained and all("lora_" in name for name, p in graphed.model.named_parameters() if any(p is q for q in trained))
    assert all(p.grad is None for p in graphed.model.parameters() if not p.requires_grad)
    assert_same_training(got, want, graphed, eager)


def test_train_script_takes_the_step_graph_with_the_trainer(capsys):
    """``train.py --trainer hf --compile --step-graph`` passes the step graph to PackedTrainer; without a GPU it
    names only that."""
    from test_train import load_script

    argv = ["--trainer", "hf", "--compile", "--step-graph"]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            load_script().parse_args(argv)
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: --step-graph needs a CUDA GPU")
        return
    script = load_script()
    assert script.speed_options(script.parse_args(argv)) == GRAPHED


@pytest.mark.gpu
@needs_gpu
def test_train_script_trainer_with_the_step_graph_logs_the_losses_without_it(shards, tmp_path):
    """``train.py --trainer hf --compile --step-graph``, fp32 weights under accelerate's bf16 autocast (train.py's
    default precision), logs every step's loss as ``--trainer hf --compile`` does, within bf16's rounding."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
    model = "llama:hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=1"
    losses = {}
    for name, flags in (("graphed", ["--step-graph"]), ("eager", [])):
        done = subprocess.run([sys.executable, str(script), "--shards", shards, "--random-init", model, "--trainer", "hf",
                               "--batch-rows", "2", "--max-steps", str(STEPS), "--log-every", "1", "--lr", "1e-3",
                               "--compile", *flags, "--out", str(tmp_path / name)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        logs = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        losses[name] = [record["loss"] for record in logs]
    assert len(losses["graphed"]) == STEPS and all(math.isfinite(loss) for loss in losses["graphed"])
    np.testing.assert_allclose(losses["graphed"], losses["eager"], rtol=2e-2)
