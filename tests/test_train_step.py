"""The plain loop's optimizer step (``loaders.train.step.TrainStep``), the one ``scripts/train.py`` runs and
``scripts/bench_train.py`` times, and the random init of ``train.py --random-init``, on CPU."""

from __future__ import annotations

import copy
import doctest
import itertools

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir

import loaders.train.random_init
from loaders import PackedIterableDataset
from loaders.collate import NUM_LOSS_TOKENS
from loaders.train.models import linear_warmup, model_inputs
from loaders.train.optim import adamw_with_warmup
from loaders.train.step import TrainStep

pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from loaders.train.attention import attn_implementation_for

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, use_cache=False)
    config._attn_implementation = attn_implementation_for("sdpa_segments")
    return LlamaForCausalLM(config).train()


def examples(batch: dict) -> list[dict]:
    """Each packed example of ``batch`` alone, as a batch of one row."""
    bounds = batch["cu_seq_lens_q"].tolist()
    return [{"input_ids": batch["input_ids"][:, a:b], "labels": batch["labels"][:, a:b]}
            for a, b in zip(bounds[:-1], bounds[1:]) if a < b]


def test_a_window_of_micro_batches_steps_like_its_examples_one_by_one(tmp_path):
    """Three packed micro-batches, one optimizer step (SGD, so that the weights show the gradient): the loss and the
    weights after it equal those of every example of the window run alone, its token losses summed and divided by the
    window's loss tokens (the mean over every trained token of the step, however the tokens fall into micro-batches
    or rows)."""
    lengths = np.random.default_rng(1).integers(8, 60, 40)
    shards = build_shard_dir(tmp_path / "shards", lengths, capacity=128, vocab_size=128, seed=1).path
    window = list(itertools.islice(PackedIterableDataset(shards, batch_rows=1, shuffle=False), 3))
    loss_tokens = sum(batch[NUM_LOSS_TOKENS] for batch in window)
    packed, alone = tiny_llama(), tiny_llama()
    optimizer = torch.optim.SGD(packed.parameters(), lr=1.0)
    step = TrainStep(packed, optimizer, linear_warmup(optimizer, 0), max_grad_norm=1e9,
                     inputs=lambda batch: model_inputs(batch, torch.device("cpu"), full_logits=True))
    loss = step(window, loss_tokens)

    reference = torch.optim.SGD(alone.parameters(), lr=1.0)
    total = torch.zeros(())
    for example in (example for batch in window for example in examples(batch)):
        total = total + alone(**example, num_items_in_batch=torch.tensor(1.0)).loss  # the example's summed token loss
    (total / loss_tokens).backward()
    reference.step()

    assert loss.item() == pytest.approx((total / loss_tokens).item(), rel=1e-5)
    for (name, trained), expected in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_the_step_leaves_no_gradient_and_follows_the_warm_up(tmp_path):
    """After each step the gradients are dropped (the next window starts from none) and the learning rate has taken
    one step of the linear warm-up."""
    lengths = np.random.default_rng(2).integers(8, 60, 20)
    shards = build_shard_dir(tmp_path / "shards", lengths, capacity=128, vocab_size=128, seed=2).path
    model = tiny_llama()
    optimizer, scheduler = adamw_with_warmup(model.parameters(), 1e-2, 0.0, 4, torch.device("cpu"))
    step = TrainStep(model, optimizer, scheduler, 1.0, inputs=lambda batch: model_inputs(batch, torch.device("cpu"), True))
    before = copy.deepcopy(model.state_dict())
    for batch in itertools.islice(PackedIterableDataset(shards, batch_rows=2, shuffle=False), 2):
        step([batch], batch[NUM_LOSS_TOKENS])
    assert all(p.grad is None for p in model.parameters())
    assert scheduler.get_last_lr() == [pytest.approx(1e-2 * 3 / 4)]
    assert any(not torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_the_random_init_examples_run():
    assert doctest.testmod(loaders.train.random_init).failed == 0
