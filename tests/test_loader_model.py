"""A loader batch through a causal LM equals each example run alone: no attention across examples.

CPU, fp32, a tiny random LlamaForCausalLM on sdpa, where transformers turns the restarting
``position_ids`` into a block-diagonal causal mask, and on varpack's per-example sdpa
(``varpack_segments``), which reads ``cu_seq_lens``. transformers' sdpa keeps examples apart only
with no attention mask and no cache, so the test also checks that an all-ones mask or the default
cache breaks the equality there: a test that cannot fail proves nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.train.attention import attn_implementation_for

transformers = pytest.importorskip("transformers")

CAPACITY = 64
VOCAB = 500
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(3).integers(2, 70, 120)
    return build_shard_dir(tmp_path_factory.mktemp("model"), lengths, capacity=CAPACITY, vocab_size=VOCAB)


def make_model(backend: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * CAPACITY, attn_implementation=attn_implementation_for(backend),
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.config.use_cache = False  # with a cache, transformers ignores the packed position_ids
    return model


@pytest.fixture(scope="module", params=["sdpa", "sdpa_segments"])
def model(request):
    return make_model(request.param)


def segments(batch):
    cu = batch["cu_seq_lens_q"].tolist()
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def largest_logit_gap(model, batch, **extra):
    """Max |packed - alone| over every token's logits."""
    with torch.no_grad():
        packed = model(**batch, **extra).logits[0]
        return max(
            (packed[a:b] - model(input_ids=batch["input_ids"][:, a:b]).logits[0]).abs().max().item()
            for a, b in segments(batch)
        )


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "fixed-shape"])
def test_packed_batch_equals_examples_alone(shards, model, fixed):
    dataset = PackedIterableDataset(shards.path, batch_rows=3, pad_to_fixed_shape=fixed)
    batch = next(iter(dataset))
    assert len(segments(batch)) >= 4
    assert largest_logit_gap(model, batch) < TOLERANCE

    with torch.no_grad():
        output = model(**batch)
        logits, labels = output.logits[0], batch["labels"][0]
        weighted, targets = 0.0, 0
        for a, b in segments(batch):
            seg_labels = labels[a:b]
            count = int((seg_labels[1:] != -100).sum())
            if count == 0:
                continue
            alone = model(input_ids=batch["input_ids"][:, a:b], labels=seg_labels[None]).loss
            in_batch = F.cross_entropy(logits[a : b - 1], seg_labels[1:], ignore_index=-100)
            assert abs(alone.item() - in_batch.item()) < TOLERANCE
            weighted += alone.item() * count
            targets += count
    assert abs(output.loss.item() - weighted / targets) < TOLERANCE


def test_the_check_fails_when_examples_can_see_each_other(shards):
    model = make_model("sdpa")
    batch = next(iter(PackedIterableDataset(shards.path, batch_rows=3)))
    assert largest_logit_gap(model, batch, attention_mask=torch.ones_like(batch["input_ids"])) > 100 * TOLERANCE
    model.config.use_cache = True
    try:
        assert largest_logit_gap(model, batch) > 100 * TOLERANCE
    finally:
        model.config.use_cache = False
