"""Loss reductions over a global batch equal the per-example computation on unpacked examples.

Two simulated ranks take two micro-batches each; every micro-batch divides its weighted loss by
the global normaliser (the sum of ``loss_weight_sum`` over all four) and each rank's loss is
multiplied by the world size, as DDP's gradient average expects. The loss and the gradients
averaged over ranks must equal those of the examples run one by one: under ``"sequence"`` the
mean over examples of each example's mean token loss, and with ``example_weights`` each
example's terms scaled by its weight. fp32 on CPU, with the model's logits and with the
loss-position head.
"""

from __future__ import annotations

import numpy as np
import pytest
import tiny_model
import torch
import torch.nn.functional as F
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.loss_weights import LOSS_WEIGHTS, batch_normalizer
from loaders.train.loss import weighted_causal_lm_loss
from loaders.train.loss_head import use_loss_position_head

transformers = pytest.importorskip("transformers")

VOCAB = 200
CAPACITY = 64
WORLD = 2
MICRO_BATCHES = 2
NUM_EXAMPLES = 60


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(11).integers(3, 50, NUM_EXAMPLES)
    return build_shard_dir(tmp_path_factory.mktemp("loss"), lengths, capacity=CAPACITY, vocab_size=VOCAB)


def tiny_llama() -> torch.nn.Module:
    return tiny_model.tiny_llama(VOCAB, 2 * CAPACITY)


def rank_batches(path, **kwargs) -> list[list[dict]]:
    """Each rank's first MICRO_BATCHES batches."""
    out = []
    for rank in range(WORLD):
        data = PackedIterableDataset(path, batch_rows=2, seed=3, rank=rank, world_size=WORLD, **kwargs)
        batches = iter(data)
        out.append([next(batches) for _ in range(MICRO_BATCHES)])
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def packed_loss_and_grads(model, per_rank: list[list[dict]], head: bool, global_normalizer: bool = True):
    """The global loss and the rank-averaged gradients, every micro-batch divided by the global normaliser."""
    normalizer = sum(batch_normalizer(b) for batches in per_rank for b in batches)
    total, rank_grads = 0.0, []
    for batches in per_rank:
        model.zero_grad()
        for b in batches:
            divisor = normalizer if global_normalizer else batch_normalizer(b) * WORLD * MICRO_BATCHES
            if head:
                loss = model(**b, num_items_in_batch=divisor).loss
            else:
                logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
                loss = weighted_causal_lm_loss(logits, b["labels"], b.get(LOSS_WEIGHTS), divisor)
            (loss * WORLD).backward()  # DDP divides the summed gradients by the world size
            total += loss.item()
        rank_grads.append(grads(model))
    return total, {n: sum(g[n] for g in rank_grads) / WORLD for n in rank_grads[0]}


def unpacked_loss_and_grads(model, shards, per_rank, reduction: str, example_weights: np.ndarray | None):
    """Each example alone; the loss the reduction means, over the examples of all micro-batches of all ranks."""
    terms, weights = [], []
    for batches in per_rank:
        for b in batches:
            cu = b["cu_seq_lens_q"].tolist()
            for (a, z), example in zip(zip(cu[:-1], cu[1:]), segment_examples(shards, b)):
                labels = b["labels"][:, a:z]
                if int((labels[0, 1:] != -100).sum()) == 0:
                    continue
                logits = model(input_ids=b["input_ids"][:, a:z]).logits[0, :-1]
                ce = F.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
                count = int((labels[0, 1:] != -100).sum())
                weight = 1.0 if example_weights is None else float(example_weights[example])
                if reduction == "sequence":
                    terms.append(weight * ce / count)
                    weights.append(weight)
                else:
                    terms.append(weight * ce)
                    weights.append(weight * count)
    model.zero_grad()
    loss = sum(terms) / sum(weights)
    loss.backward()
    return loss.item(), grads(model)


def segment_examples(shards, batch) -> list[int]:
    """The source example of each packed sequence, found from its tokens (random tokens identify an example)."""
    cu = batch["cu_seq_lens_q"].tolist()
    found = []
    for a, z in zip(cu[:-1], cu[1:]):
        tokens = batch["input_ids"][0, a:z].numpy()
        match = [i for i in range(shards.lengths.size) if shards.lengths[i] == z - a
                 and np.array_equal(shards.example(i)[0], tokens)]
        found.append(match[0])
    return found


CASES = {
    "sequence": ("sequence", False),
    "sequence-weighted": ("sequence", True),
    "token-weighted": ("token", True),
}


@pytest.mark.parametrize("head", [False, True], ids=["logits", "loss-head"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_reduction_equals_unpacked_examples(shards, case, head):
    reduction, weighted = CASES[case]
    example_weights = np.random.default_rng(2).uniform(0.2, 3.0, NUM_EXAMPLES) if weighted else None
    per_rank = rank_batches(shards.path, loss_reduction=reduction, example_weights=example_weights)
    model = tiny_llama()
    expected_loss, expected = unpacked_loss_and_grads(model, shards, per_rank, reduction, example_weights)
    if head:
        use_loss_position_head(model)
    loss, actual = packed_loss_and_grads(model, per_rank, head)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_per_micro_batch_means_would_differ(shards):
    """The control: normalising each micro-batch by its own weights does not give the global reduction."""
    per_rank = rank_batches(shards.path, loss_reduction="sequence")
    model = tiny_llama()
    expected_loss, expected = unpacked_loss_and_grads(model, shards, per_rank, "sequence", None)
    loss, actual = packed_loss_and_grads(model, per_rank, head=False, global_normalizer=False)
    assert loss != pytest.approx(expected_loss, rel=1e-5)  # the tolerance the equality test uses
    assert not all(torch.allclose(actual[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected)


def test_plain_token_batches_carry_no_weights_and_keep_the_model_loss(shards):
    batch = next(iter(PackedIterableDataset(shards.path, batch_rows=2)))
    assert LOSS_WEIGHTS not in batch
    model = tiny_llama()
    with torch.no_grad():
        ours = weighted_causal_lm_loss(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
                                       batch["labels"])
        theirs = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_a_split_example_weighs_one_example(tmp_path):
    """Examples longer than a row are split into chunks; under "sequence" each still sums to weight 1."""
    lengths = np.random.default_rng(12).integers(3, 3 * CAPACITY, 40)
    split = build_shard_dir(tmp_path, lengths, capacity=CAPACITY, vocab_size=VOCAB, overflow="split")
    assert (lengths > CAPACITY).sum() >= 5
    data = PackedIterableDataset(split.path, batch_rows=1, shuffle=False, loss_reduction="sequence")
    total = sum(batch["loss_weight_sum"] for batch in data)
    trained = sum(int(split.example(i)[1][1:].any()) for i in range(lengths.size))
    assert total == pytest.approx(trained, rel=1e-5)


def test_bad_reduction_or_weights_are_refused(shards):
    with pytest.raises(ValueError, match="loss_reduction must be one of token, sequence"):
        PackedIterableDataset(shards.path, loss_reduction="mean")
    with pytest.raises(ValueError, match=f"example_weights holds 3 values, the build has {NUM_EXAMPLES} example ids"):
        PackedIterableDataset(shards.path, example_weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"example_weights\[4\] is -1.0"):
        PackedIterableDataset(shards.path, example_weights=np.r_[np.ones(4), -1.0, np.ones(NUM_EXAMPLES - 5)])
