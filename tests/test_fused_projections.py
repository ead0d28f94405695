"""Fused q/k/v and gate/up projections compute the same loss and gradients as the separate ones (CPU, fp32).

``fuse_projections`` only regroups weights: on a packed loader batch (examples must still not see
each other, so ``varpack_segments`` attention) the fused model's loss equals the original's, and
the gradient of each fused weight is the original projections' gradients stacked.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir
from tiny_model import tiny_llama

from loaders import PackedIterableDataset
from loaders.train.attention import attn_implementation_for
from loaders.train.fused_projections import fuse_projections
from loaders.train.models import model_inputs

pytest.importorskip("transformers")
VOCAB = 300


def test_fused_projections_give_the_same_loss_and_gradients(tmp_path) -> None:
    lengths = np.random.default_rng(3).integers(4, 60, 60)
    shards = build_shard_dir(tmp_path, lengths, capacity=128, vocab_size=VOCAB, seed=3)
    batch = model_inputs(next(iter(PackedIterableDataset(shards.path, batch_rows=2, shuffle=False))), torch.device("cpu"),
                         full_logits=True)
    model = tiny_llama(VOCAB, 256, attn_implementation_for("sdpa_segments"))
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2

    losses, grads = [], []
    for m in (model, fused):
        loss = m(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in m.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    separate, together = grads
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        stacked_qkv = torch.cat([separate[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        torch.testing.assert_close(together[f"{attn}.qkv_proj.weight"], stacked_qkv, rtol=1e-5, atol=1e-6)
        stacked_gate_up = torch.cat([separate[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")])
        torch.testing.assert_close(together[f"{mlp}.gate_up_proj.weight"], stacked_gate_up, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(together[f"{attn}.o_proj.weight"], separate[f"{attn}.o_proj.weight"], rtol=1e-5, atol=1e-6)


def test_a_model_without_llama_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no Llama-style decoder layer"):
        fuse_projections(torch.nn.Sequential(torch.nn.Linear(4, 4)))
