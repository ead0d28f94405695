"""Two ranks with torch.distributed (gloo) train a tiny Llama with DDP on packed shards.

- Every rank takes the same number of steps, and the ranks together see every example at most
  once per epoch.
- Each rank divides its summed token loss by ``step_normalizer``, the global loss-token count over
  the world size that DDP's gradient averaging divides by again: two ranks then train exactly like
  one process on both ranks' batches at once, though their batches hold different numbers of loss
  tokens.
- Stopping every rank at step k and resuming from their checkpoints continues exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tiny_model
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.train.distributed import finish_distributed_run, step_normalizer, world_size

transformers = pytest.importorskip("transformers")

WORLD = 2
VOCAB = 300
CAPACITY = 64
STEPS = 6
STOP = 3


def tiny_llama() -> torch.nn.Module:
    return tiny_model.tiny_llama(VOCAB, 4 * CAPACITY)


def summed_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The cross-entropy summed over the batch's loss tokens (no attention across packed examples)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, :-1]
    return F.cross_entropy(logits.float(), batch["labels"][0, 1:], ignore_index=-100, reduction="sum")


def dataset(path: str, rank: int | None = None) -> PackedIterableDataset:
    ranks = {} if rank is None else {"rank": rank, "world_size": WORLD}
    return PackedIterableDataset(path, batch_rows=2, seed=0, **ranks)


def save(out: str, rank: int, step: int, model, optimizer, data: PackedIterableDataset, losses: list[float]) -> None:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": data.state_dict(), "losses": losses}
    torch.save(state, f"{out}/rank{rank}-step{step}.pt")


def ddp_worker(rank: int, path: str, init_file: str, out: str, start: int, stop: int) -> None:
    """Train steps [start, stop) on this rank, resuming from ``out`` when start > 0.

    Checkpoints go to ``out`` after step STOP and at ``stop``.
    """
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = dataset(path)
    if start:
        state = torch.load(f"{out}/rank{rank}-step{start}.pt", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.load_state_dict(state["data"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    losses = []
    for step, batch in zip(range(start, stop), data):
        loss = summed_loss(ddp, batch) / step_normalizer(batch["num_loss_tokens"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reported = loss.detach() / world_size()
        dist.all_reduce(reported)
        losses.append(reported.item())
        if step + 1 == STOP and stop > STOP:
            save(out, rank, STOP, model, optimizer, data, list(losses))
    save(out, rank, stop, model, optimizer, data, losses)
    # A whole epoch from a fresh loader: how many batches this rank gets and which examples.
    batches, seen = 0, []
    for batch in dataset(path):
        batches += 1
        cu, ids = batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0]
        seen += [tuple(ids[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:])]
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, {"batches": batches, "examples": seen})
    if rank == 0:
        torch.save(everyone, f"{out}/epoch.pt")
    finish_distributed_run()


def run_ranks(path: str, out, start: int, stop: int, name: str) -> None:
    mp.spawn(ddp_worker, args=(path, str(out / f"init-{name}"), str(out), start, stop), nprocs=WORLD, join=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(5).integers(4, 60, 160)
    return build_shard_dir(tmp_path_factory.mktemp("ddp-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """An uninterrupted run of STEPS steps (checkpointed at STOP), and fresh ranks resumed from that checkpoint."""
    whole = tmp_path_factory.mktemp("whole")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(str(shards.path), whole, 0, STEPS, "whole")
    resumed = tmp_path_factory.mktemp("resumed")
    for rank in range(WORLD):
        (resumed / f"rank{rank}-step{STOP}.pt").write_bytes((whole / f"rank{rank}-step{STOP}.pt").read_bytes())
    run_ranks(str(shards.path), resumed, STOP, STEPS, "resumed")
    return whole, resumed


def test_ranks_take_equal_steps_and_see_each_example_at_most_once(shards, runs):
    whole, _ = runs
    ranks = torch.load(whole / "epoch.pt", weights_only=False)
    assert ranks[0]["batches"] == ranks[1]["batches"] > STEPS
    examples = [e for rank in ranks for e in rank["examples"]]
    assert len(examples) == len(set(examples))  # random tokens: equal tuples would be the same example
    packed = {tuple(shards.example(i)[0].tolist()) for i in range(shards.lengths.size)}
    assert set(examples) <= packed and len(examples) > 0.8 * len(packed)


def test_two_ranks_train_like_one_process_on_both_batches(shards, runs):
    whole, _ = runs
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    per_rank = [iter(dataset(str(shards.path), rank)) for rank in range(WORLD)]
    losses, imbalance = [], []
    for _ in range(STEPS):
        batches = [next(it) for it in per_rank]
        counts = [b["num_loss_tokens"] for b in batches]
        imbalance.append(abs(counts[0] - counts[1]) / max(counts))
        loss = sum(summed_loss(model, b) for b in batches) / sum(counts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # With equal counts a per-rank mean would give the same gradients; here it would weigh tokens unequally.
    assert max(imbalance) > 0.1, "the ranks' batches must hold different loss-token counts"
    trained = [torch.load(whole / f"rank{r}-step{STEPS}.pt", weights_only=False) for r in range(WORLD)]
    np.testing.assert_allclose(trained[0]["losses"], losses, rtol=1e-5)
    for name, value in model.state_dict().items():
        for rank in trained:
            torch.testing.assert_close(rank["model"][name], value, rtol=1e-5, atol=1e-6)


def test_stopping_and_resuming_all_ranks_continues_exactly(runs):
    whole, resumed = runs
    for rank in range(WORLD):
        a = torch.load(whole / f"rank{rank}-step{STEPS}.pt", weights_only=False)
        first = torch.load(resumed / f"rank{rank}-step{STOP}.pt", weights_only=False)
        second = torch.load(resumed / f"rank{rank}-step{STEPS}.pt", weights_only=False)
        assert first["losses"] + second["losses"] == pytest.approx(a["losses"], rel=1e-6)
        for name, value in a["model"].items():
            torch.testing.assert_close(second["model"][name], value, rtol=1e-6, atol=1e-7)
