"""Property tests of the loader's epoch order, batching and rank/worker split (no files)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.partition import max_rows_per_batch, max_segments_per_batch, plan_epoch
from loaders.resume import Position
from loaders.shuffle import epoch_row_order

CAPACITY = 32


@st.composite
def epochs(draw):
    """A build (rows per shard, tokens per row) and loader settings."""
    shard_rows = draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    row_tokens = rng.integers(1, CAPACITY + 1, sum(shard_rows))
    by_tokens = draw(st.booleans())
    return {
        "shard_rows": np.array(shard_rows),
        "row_tokens": row_tokens,
        "world_size": draw(st.integers(1, 4)),
        "num_workers": draw(st.integers(1, 3)),
        "batch_rows": 1 if by_tokens else draw(st.integers(1, 4)),
        "tokens_per_batch": draw(st.integers(CAPACITY, 4 * CAPACITY)) if by_tokens else None,
        "seed": draw(st.integers(0, 1000)),
        "epoch": draw(st.integers(0, 5)),
        "shuffle": draw(st.booleans()),
        "buffer_rows": draw(st.integers(1, 30)),
    }


def rank_plans(e):
    rows = epoch_row_order(e["shard_rows"], seed=e["seed"], epoch=e["epoch"], shuffle=e["shuffle"], buffer_rows=e["buffer_rows"])
    return [
        plan_epoch(rows, e["row_tokens"], rank=r, world_size=e["world_size"], batch_rows=e["batch_rows"],
                   tokens_per_batch=e["tokens_per_batch"])
        for r in range(e["world_size"])
    ]


@settings(max_examples=300, deadline=None)
@given(epochs())
def test_every_row_once_per_epoch_across_ranks_and_workers(e):
    plans = rank_plans(e)
    seen = []
    for plan in plans:
        for worker in range(e["num_workers"]):
            _, first = Position(epoch=e["epoch"]).first_batch(worker, e["num_workers"])
            for j in range(first, len(plan), e["num_workers"]):
                seen.extend(plan.batch_rows(j).tolist())
    dropped = plans[0].dropped_rows
    total = int(e["shard_rows"].sum())
    assert len(seen) == len(set(seen)), "a row was read twice"
    assert sorted(seen + dropped.tolist()) == list(range(total))
    assert len({len(plan) for plan in plans}) == 1, "ranks got different numbers of batches"
    if e["tokens_per_batch"] is None:
        assert dropped.size < e["world_size"] * e["batch_rows"]
        assert all(plan.batch_rows(j).size == e["batch_rows"] for plan in plans for j in range(len(plan)))
    else:
        num_batches = plans[0].bounds.size - 1
        assert num_batches - len(plans[0]) * e["world_size"] < e["world_size"]
        for plan in plans:
            for j in range(len(plan)):
                assert e["row_tokens"][plan.batch_rows(j)].sum() <= e["tokens_per_batch"]


@settings(max_examples=200, deadline=None)
@given(epochs())
def test_order_is_a_seeded_permutation_with_bounded_moves(e):
    args = {"seed": e["seed"], "epoch": e["epoch"], "shuffle": True, "buffer_rows": e["buffer_rows"]}
    order = epoch_row_order(e["shard_rows"], **args)
    assert np.array_equal(np.sort(order), np.arange(int(e["shard_rows"].sum())))
    assert np.array_equal(order, epoch_row_order(e["shard_rows"], **args))
    # Rows stay within a window of the shard-ordered stream (the same order with a buffer of one row).
    stream = epoch_row_order(e["shard_rows"], **{**args, "buffer_rows": 1})
    where_in_stream = np.empty_like(stream)
    where_in_stream[stream] = np.arange(stream.size)
    assert np.all(np.abs(where_in_stream[order] - np.arange(order.size)) < e["buffer_rows"])


def test_another_epoch_or_seed_reorders():
    shard_rows = np.full(10, 20)
    base = epoch_row_order(shard_rows, seed=0, epoch=0, shuffle=True, buffer_rows=40)
    assert not np.array_equal(base, epoch_row_order(shard_rows, seed=0, epoch=1, shuffle=True, buffer_rows=40))
    assert not np.array_equal(base, epoch_row_order(shard_rows, seed=1, epoch=0, shuffle=True, buffer_rows=40))
    assert np.array_equal(epoch_row_order(shard_rows, seed=0, epoch=0, shuffle=False, buffer_rows=40), np.arange(200))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(0, 45), st.integers(1, 5), st.integers(1, 5))
def test_resume_order_is_the_same_for_any_number_of_workers(num_batches, consumed, saved_workers, workers):
    """A DataLoader takes one batch from each worker in turn. A run with ``saved_workers`` stopped
    after ``consumed`` batches and resumed with ``workers`` sees every batch once, in order."""
    consumed = min(consumed, num_batches)

    def dataloader_order(next_batch: int, num_workers: int) -> list[int]:
        position = Position(epoch=0, pass_start=0, next_batch=next_batch)
        streams = [list(range(position.first_batch(w, num_workers)[1], num_batches, num_workers)) for w in range(num_workers)]
        return [s[i] for i in range(max(map(len, streams), default=0)) for s in streams if i < len(s)]

    before = dataloader_order(0, saved_workers)[:consumed]
    assert before + dataloader_order(consumed, workers) == list(range(num_batches))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, CAPACITY), min_size=1, max_size=60), st.integers(CAPACITY, 5 * CAPACITY), st.integers(0, 100))
def test_fixed_shape_bounds_hold_for_every_batch(row_tokens, budget, seed):
    row_tokens = np.array(row_tokens)
    row_segments = np.random.default_rng(seed).integers(1, 9, row_tokens.size)
    histogram = {str(k): int(v) for k, v in zip(*np.unique(row_segments, return_counts=True))}
    rows = np.random.default_rng(seed).permutation(row_tokens.size)
    plan = plan_epoch(rows, row_tokens, rank=0, world_size=1, batch_rows=1, tokens_per_batch=budget)
    most_rows = max_rows_per_batch(row_tokens, budget)
    for j in range(len(plan)):
        batch = plan.batch_rows(j)
        assert batch.size <= most_rows
        assert row_segments[batch].sum() <= max_segments_per_batch(histogram, most_rows)


@settings(max_examples=150, deadline=None)
@given(epochs(), epochs(), st.data())
def test_a_plan_cut_after_the_rows_all_ranks_read_reads_the_rest_once(e, after, data):
    """N ranks read ``j`` batches each; M ranks of another batch budget cut their plan from the rows after those
    (``EpochPlan.rows_read``): every row of the epoch once, but for the tail the new plan drops."""
    rows = epoch_row_order(e["shard_rows"], seed=e["seed"], epoch=e["epoch"], shuffle=e["shuffle"], buffer_rows=e["buffer_rows"])
    before = rank_plans(e)[0]
    steps = data.draw(st.integers(0, len(before)))
    read = rows[: before.rows_read(steps)]
    rest = rows[read.size :]
    plans = [plan_epoch(rest, e["row_tokens"], rank=r, world_size=after["world_size"], batch_rows=after["batch_rows"],
                        tokens_per_batch=after["tokens_per_batch"]) for r in range(after["world_size"])]
    seen = read.tolist() + [row for plan in plans for j in range(len(plan)) for row in plan.batch_rows(j).tolist()]
    assert len(seen) == len(set(seen)), "a row was read twice"
    assert sorted(seen) == sorted(rows[: len(seen)].tolist()), "a row inside the epoch was skipped"
    tail = plans[0].dropped_rows
    assert np.array_equal(np.sort(np.concatenate([np.array(seen, dtype=np.int64), tail])), np.sort(rows))
    if after["tokens_per_batch"] is None:
        assert tail.size < after["world_size"] * after["batch_rows"]
    else:
        assert e["row_tokens"][tail].sum() < after["world_size"] * after["tokens_per_batch"]
