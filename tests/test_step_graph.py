"""GraphedStep: a training step replayed as a CUDA graph trains as the same step run eagerly.

The GPU tests run on the GPU machine and are skipped without CUDA; the refusals run anywhere."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir
from tiny_model import tiny_llama

from loaders.train.loss_head import SEQUENCE_LOSSES, use_loss_position_head
from loaders.train.step_graph import GraphedStep

VOCAB = 512
CAPACITY = 512
STEPS = 14
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def test_refuses_what_a_captured_step_would_get_wrong():
    model = tiny_llama(VOCAB, CAPACITY)
    with pytest.raises(ValueError, match="needs the loss-position head"):
        GraphedStep(model, torch.optim.AdamW(model.parameters()))
    head = use_loss_position_head(model)
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(head, torch.optim.AdamW(head.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match="learning rate as a tensor on the GPU"):
        GraphedStep(head, torch.optim.AdamW(head.parameters(), lr=1e-3, capturable=True))


def bucketed_batches(tmp_path, count: int) -> list[dict]:
    """``count`` loader batches of two 512-token rows of FLAN-shaped examples, bucketed fixed shapes, on the GPU."""
    from loaders import PackedIterableDataset

    lengths = np.clip(np.random.default_rng(4).lognormal(4.5, 0.9, 400), 16, 600).astype(np.int64)
    shards = build_shard_dir(tmp_path, lengths, capacity=CAPACITY, vocab_size=VOCAB, seed=4)
    dataset = PackedIterableDataset(shards.path, batch_rows=2, seed=1, pad_to_fixed_shape=True, bucket_shapes=True)
    batches = []
    epoch = 0
    while len(batches) < count:
        dataset.set_epoch(epoch)
        batches += [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in dataset]
        epoch += 1
    return batches[:count]


def trainer(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(2e-3, device="cuda"), fused=True, capturable=True)
    # A warm-up: the captured steps must see the learning rate change.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 6))
    return optimizer, scheduler


def gpu_llama() -> torch.nn.Module:
    """A seeded random Llama of 2 layers, hidden size 256, in bf16 on the GPU, with the best varlen attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loaders.train.attention import attn_implementation_for, best_backend

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CAPACITY, use_cache=False,
                         attn_implementation=attn_implementation_for(best_backend()))
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("compiled", "prepared", "autocast", "per_sequence"),
                         [(False, False, False, False), (True, False, False, True), (True, True, False, True),
                          (True, True, True, True), (True, "ahead", True, True)])
def test_graphed_steps_train_like_eager_steps(tmp_path, compiled, prepared, autocast, per_sequence):
    """Also with fp32 weights under bf16 autocast, as scripts/train.py trains; and each sequence's loss
    (a mixture's loss per source), a second output of the graph, is the eager step's. ``prepared``:
    every shape captured after the first step, by ``prepare`` or by the constructor's ``shapes``
    ("ahead"), and none later."""
    from loaders.train.models import compile_layers, prewarm_buckets

    batches = bucketed_batches(tmp_path, STEPS)
    base = gpu_llama()
    if autocast:
        base = base.float()
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    eager, graphed = use_loss_position_head(copy.deepcopy(base)), use_loss_position_head(copy.deepcopy(base))
    if compiled:
        for model in (eager, graphed):
            compile_layers(model)
            with precision:
                prewarm_buckets(model, batches[0])

    asked = {SEQUENCE_LOSSES: True} if per_sequence else {}
    optimizer, scheduler = trainer(eager)
    want, want_sequences = [], []
    for batch in batches:
        count = torch.tensor(float(batch["num_loss_tokens"]), device="cuda")
        with precision:
            outputs = eager(**batch, **asked, num_items_in_batch=count)
        loss = outputs.loss
        loss.backward()
        want_sequences.append(outputs.sequence_losses)
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        want.append(loss.item())

    optimizer, scheduler = trainer(graphed)
    ahead = ({**b, **asked} for b in batches) if prepared == "ahead" else None  # read once, after the first step
    step = GraphedStep(graphed, optimizer, max_grad_norm=1.0, autocast_dtype=torch.bfloat16 if autocast else None,
                       shapes=ahead)
    got, got_sequences = [], []
    for i, batch in enumerate(batches):
        got.append(step({**batch, **asked}).item())
        got_sequences.append(step.sequence_losses)
        scheduler.step()
        if prepared is True and i == 0:
            captured = step.prepare([{**b, **asked} for b in batches])  # as the steps will ask
            assert captured == len(step.graphs) >= 1
        if prepared == "ahead" and i == 0:
            captured = len(step.graphs)
            assert captured >= 1

    assert step.replays == STEPS - 1 and len(step.graphs) < step.replays, "shapes should repeat across batches"
    if prepared:
        assert len(step.graphs) == captured, "every shape was captured ahead"
    np.testing.assert_allclose(got, want, rtol=2e-2)
    if per_sequence:
        for batch, got_sequence, want_sequence in zip(batches, got_sequences, want_sequences):
            # The padded labelled rows count for no sequence: the counts are the batch's, exactly.
            assert torch.equal(got_sequence[1], want_sequence[1]) and got_sequence[1].sum() == batch["num_loss_tokens"]
            torch.testing.assert_close(got_sequence[0], want_sequence[0], rtol=2e-2, atol=1e-2)
    else:
        assert got_sequences == want_sequences == [None] * STEPS
    for (name, p), q, start in zip(eager.named_parameters(), graphed.parameters(), base.parameters()):
        moved = ((p.float() - start.float()).norm() / start.float().norm()).item()
        err = ((p.float() - q.float()).norm() / p.float().norm()).item()
        assert err < max(2e-2, moved / 10), f"{name}: weights differ by {err:.3g}, moved by {moved:.3g}"
    moved = max(((q.float() - s.float()).norm() / s.float().norm()).item() for q, s in zip(graphed.parameters(), base.parameters()))
    assert moved > 1e-2, "the graphed steps should have changed the weights"


@pytest.mark.gpu
@needs_gpu
def test_no_capture_runs_a_forward_while_gradients_are_held(tmp_path):
    """A forward run while the previous capture's gradients are held has both the activations and a full copy of the
    gradients at its peak (6 GiB more on a 3B model): each capture drops them before its warm-up step."""
    batches = bucketed_batches(tmp_path, STEPS)
    model = use_loss_position_head(gpu_llama())
    held: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: held.append(any(p.grad is not None for p in module.parameters())))
    optimizer, scheduler = trainer(model)
    step = GraphedStep(model, optimizer, max_grad_norm=1.0, shapes=iter(batches))
    for batch in batches:
        step(batch)
        scheduler.step()
    assert len(step.graphs) >= 2, "the batches should need more than one graph"
    assert len(held) == 1 + 2 * len(step.graphs) and not any(held)


@pytest.mark.gpu
@needs_gpu
def test_train_script_captures_every_shape_before_the_second_step(tmp_path):
    """``train.py --compile --step-graph`` captures the graphs of every bucket shape of the run right after
    step 1 (the log's ``step_graphs`` holds from the first line on), so that no later step stops to capture."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    lengths = np.clip(np.random.default_rng(4).lognormal(4.5, 0.9, 400), 16, 600).astype(np.int64)
    shards = build_shard_dir(tmp_path / "shards", lengths, capacity=CAPACITY, vocab_size=VOCAB, seed=4)
    script = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
    model = "llama:hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=1"
    done = subprocess.run([sys.executable, str(script), "--shards", str(shards.path), "--random-init", model,
                           "--batch-rows", "2", "--max-steps", "30", "--log-every", "1", "--compile", "--step-graph",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    graphs = [record["step_graphs"] for record in logs]
    assert len(graphs) == 30 and graphs[0] > 1, graphs
    assert set(graphs) == {graphs[0]}, f"a shape was captured during training: {graphs}"
