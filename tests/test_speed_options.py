"""The speed options (``loaders.train.speed``) that ``scripts/train.py`` and ``PackedTrainer`` share, on CPU.

- ``PackedTrainer(..., speed=SpeedOptions(compile=True, ...))`` trains with the loss-position head and compiled
  layers under the memory budget, compiling within its first step, and ends with the weights of the trainer
  without them.
- Options the trainer cannot honour are refused in one line naming what to change.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tiny_model
import torch
from shard_factory import build_shard_dir

import loaders.train.speed
from loaders import PackedIterableDataset
from loaders.train.attention import attn_implementation_for
from loaders.train.speed import SpeedOptions

transformers = pytest.importorskip("transformers")

VOCAB = 128
CAPACITY = 64
STEPS = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(3).integers(4, 40, 40)
    return build_shard_dir(tmp_path_factory.mktemp("speed-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB).path


def packed_trainer(shards, out, speed: SpeedOptions | None, callbacks=()):
    from loaders.train.hf_trainer import PackedTrainer

    model = tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, attn_implementation_for("sdpa_segments"))
    options = (speed or SpeedOptions()).dataset_options()
    dataset = PackedIterableDataset(shards, batch_rows=2, seed=0, **options)
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=STEPS, learning_rate=0.5, optim="sgd",
                                          lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                                          save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
    return PackedTrainer(model=model, args=args, train_dataset=dataset, speed=speed, callbacks=list(callbacks))


def test_the_trainer_takes_the_speed_options_and_trains_as_without_them(shards, tmp_path):
    compiled_at_step: list[int] = []

    class CountCompiles(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            compiled_at_step.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))

    budget = torch._functorch.config.activation_memory_budget
    try:
        fast = packed_trainer(shards, tmp_path / "fast", SpeedOptions(compile=True, activation_memory_budget=0.9),
                              [CountCompiles()])
        fast.train()
        assert torch._functorch.config.activation_memory_budget == 0.9
    finally:
        torch._functorch.config.activation_memory_budget = budget
    model = fast.accelerator.unwrap_model(fast.model)
    assert model.varpack_loss_head
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    # The layers compiled within the first step. (The CPU's per-example attention, sdpa_segments, guards on each
    # example's bounds, so later steps compile here too; flash-attn on a GPU is one op and they do not.)
    assert len(compiled_at_step) == STEPS and compiled_at_step[0] > 0

    plain = packed_trainer(shards, tmp_path / "plain", None)
    plain.train()
    want = plain.model.state_dict()
    for name, value in fast.model.state_dict().items():
        torch.testing.assert_close(value, want[name.replace("_orig_mod.", "")], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("speed", "bucketed", "message"), [
    (SpeedOptions(compile=True, step_graph=True), True, "step_graph replays CUDA graphs and needs a CUDA GPU"),
    (SpeedOptions(compile=True), False, "bucket_shapes=True"),
])
def test_the_trainer_refuses_what_it_cannot_honour(shards, tmp_path, speed, bucketed, message):
    from loaders.train.hf_trainer import PackedTrainer

    options = SpeedOptions(compile=bucketed).dataset_options()
    dataset = PackedIterableDataset(shards, batch_rows=2, seed=0, **options)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=message):
        PackedTrainer(model=tiny_model.tiny_llama(VOCAB, 2 * CAPACITY), args=args, train_dataset=dataset, speed=speed)


@pytest.mark.parametrize(("options", "message"), [
    ({"activation_memory_budget": 0.9}, "set compile=True"),
    ({"compile": True, "activation_memory_budget": 0.0}, r"give a share in \(0, 1\]"),
    ({"compile": True, "loss_head": False, "step_graph": True}, "loss_head=True"),
])
def test_speed_options_refuse_combinations_that_do_nothing_or_break(options, message):
    with pytest.raises(ValueError, match=message):
        SpeedOptions(**options)


def test_the_worked_examples_run():
    assert doctest.testmod(loaders.train.speed).failed == 0


def test_prewarming_never_runs_a_forward_while_gradients_are_held(shards):
    """A forward run while an earlier backward's gradients are held has both the activations and a full copy of the
    gradients at its peak (6 GiB more on a 3B model): the prewarm drops the gradients after each of its passes."""
    from loaders.train.loss_head import use_loss_position_head
    from loaders.train.models import model_inputs, prewarm_buckets

    model = use_loss_position_head(tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, attn_implementation_for("sdpa_segments")))
    held: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: held.append(any(p.grad is not None for p in module.parameters())))
    batch = next(iter(PackedIterableDataset(shards, batch_rows=2, seed=0, **SpeedOptions(compile=True).dataset_options())))
    prewarm_buckets(model, model_inputs(batch, torch.device("cpu"), full_logits=False))
    assert held == [False, False]
    assert all(p.grad is None for p in model.parameters())
