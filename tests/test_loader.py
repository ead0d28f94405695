"""PackedIterableDataset over real shards: batch format, exactly-once, determinism, resume, fixed shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir
from torch.utils.data import DataLoader

import loaders.collate
from loaders import PackedIterableDataset, open_shard

CAPACITY = 64
BATCH_KEYS = {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
              "num_real_tokens", "num_loss_tokens"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(7).integers(4, 90, 400)
    return build_shard_dir(tmp_path_factory.mktemp("shards"), lengths, capacity=CAPACITY, rows_per_shard=24, vocab_size=30000)


@pytest.fixture(scope="module")
def row_index(shards):
    """Global row id of every row, keyed by the tokens of its first segment (unique: random ids)."""
    index = {}
    row = 0
    for info in shards.manifest.shards:
        shard = open_shard(shards.path / info.path, CAPACITY)
        for i in range(shard.num_rows):
            r = shard.row(i)
            index[tuple(r["input_ids"][: r["cu_seqlens"][1]].tolist())] = (row, r["cu_seqlens"].size - 1)
            row += 1
    return index


def batch_row_ids(batch, row_index) -> list[int]:
    """The global rows a batch holds, recovered from its tokens and cu_seqlens."""
    ids, cu = batch["input_ids"][0].numpy(), batch["cu_seq_lens_q"].numpy()
    rows, segment = [], 0
    while segment < cu.size - 1 and cu[segment] < cu[segment + 1]:
        key = tuple(ids[cu[segment] : cu[segment + 1]].tolist())
        if key not in row_index:
            break  # the pad of a fixed-shape batch
        row, segments = row_index[key]
        rows.append(row)
        segment += segments
    return rows


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]) if torch.is_tensor(x[key]) else x[key] == y[key], key


def test_batch_is_fa2_varlen_kwargs(shards):
    dataset = PackedIterableDataset(shards.path, batch_rows=3, seed=1)
    for batch in itertools.islice(dataset, 5):
        assert set(batch) == BATCH_KEYS
        ids, labels, positions, cu = batch["input_ids"], batch["labels"], batch["position_ids"], batch["cu_seq_lens_q"]
        assert ids.dtype == labels.dtype == positions.dtype == torch.int64 and cu.dtype == torch.int32
        assert ids.shape == labels.shape == positions.shape == (1, int(cu[-1]))
        assert batch["cu_seq_lens_k"] is cu and cu[0] == 0 and bool((cu.diff() > 0).all())
        lengths = cu.diff()
        assert batch["max_length_q"] == batch["max_length_k"] == int(lengths.max())
        expected_positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        assert torch.equal(positions[0], expected_positions)
        assert bool((labels[0, cu[:-1].long()] == -100).all()), "the first token of a segment must not be a target"
        assert type(batch["num_real_tokens"]) is int and batch["num_real_tokens"] == ids.shape[1]
        assert type(batch["num_loss_tokens"]) is int and batch["num_loss_tokens"] == int((labels[0, 1:] != -100).sum())


def test_labels_follow_the_loss_mask(shards, row_index):
    dataset = PackedIterableDataset(shards.path, batch_rows=2, shuffle=False)
    batch = next(iter(dataset))
    first_shard = open_shard(shards.path / shards.manifest.shards[0].path, CAPACITY)
    rows = [first_shard.row(i) for i in batch_row_ids(batch, row_index)]
    ids = np.concatenate([r["input_ids"] for r in rows])
    mask = np.concatenate([r["loss_mask"] for r in rows])
    expected = np.where(mask == 1, ids, -100)
    cu = batch["cu_seq_lens_q"].numpy()
    expected[cu[:-1]] = -100
    assert np.array_equal(batch["input_ids"][0].numpy(), ids)
    assert np.array_equal(batch["labels"][0].numpy(), expected)


def test_every_row_once_across_ranks_and_dataloader_workers(shards, row_index):
    world_size, batch_rows = 2, 3
    for epoch in (0, 1):
        seen = []
        for rank in range(world_size):
            dataset = PackedIterableDataset(shards.path, batch_rows=batch_rows, rank=rank, world_size=world_size)
            dataset.set_epoch(epoch)
            batches = list(DataLoader(dataset, batch_size=None, num_workers=2))
            assert len(batches) == len(dataset)
            dataset.set_epoch(epoch)  # the same epoch again (a full pass moves on), read in the training process
            in_process = list(dataset)
            assert_same_batches(batches, in_process)  # workers do not change the order
            seen += [row for batch in batches for row in batch_row_ids(batch, row_index)]
        num_rows = shards.manifest.num_rows
        assert len(seen) == len(set(seen)), "a row was read twice"
        assert num_rows - world_size * batch_rows < len(seen) <= num_rows


def test_ranks_get_equal_batch_counts_and_token_budget_holds(shards, row_index):
    counts = set()
    for rank in range(3):
        dataset = PackedIterableDataset(shards.path, tokens_per_batch=150, rank=rank, world_size=3)
        batches = list(dataset)
        counts.add(len(batches))
        assert all(int(b["cu_seq_lens_q"][-1]) <= 150 for b in batches)
    assert len(counts) == 1


def test_same_seed_same_batches_other_epoch_or_seed_other_order(shards):
    def first_batches(seed, epoch):
        dataset = PackedIterableDataset(shards.path, batch_rows=2, seed=seed)
        dataset.set_epoch(epoch)
        return list(itertools.islice(dataset, 6))

    assert_same_batches(first_batches(3, 0), first_batches(3, 0))
    assert not torch.equal(first_batches(3, 0)[0]["input_ids"], first_batches(3, 1)[0]["input_ids"])
    assert not torch.equal(first_batches(3, 0)[0]["input_ids"], first_batches(4, 0)[0]["input_ids"])


def test_epochs_advance_by_set_epoch_or_after_a_full_pass(shards):
    dataset = PackedIterableDataset(shards.path, batch_rows=4)
    epoch0 = list(dataset)
    epoch1 = list(dataset)  # a finished pass moves on by itself
    other = PackedIterableDataset(shards.path, batch_rows=4)
    other.set_epoch(1)
    assert_same_batches(epoch1, list(other))
    assert not torch.equal(epoch0[0]["input_ids"], epoch1[0]["input_ids"])


def test_persistent_workers_walk_the_epochs(shards):
    dataset = PackedIterableDataset(shards.path, batch_rows=3)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        dataset.set_epoch(epoch)  # the running workers take it at their next pass
        reference = PackedIterableDataset(shards.path, batch_rows=3)
        reference.set_epoch(epoch)
        assert_same_batches(list(loader), list(reference))


def test_rank_and_world_size_come_from_torch_distributed(shards, monkeypatch):
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 1)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: 3)
    dataset = PackedIterableDataset(shards.path, batch_rows=2)
    assert (dataset.rank, dataset.world_size) == (1, 3)
    explicit = PackedIterableDataset(shards.path, batch_rows=2, rank=0, world_size=2)  # e.g. a data-parallel group
    assert (explicit.rank, explicit.world_size) == (0, 2)


def test_resume_in_process_seeks_without_rereading(shards, monkeypatch):
    full = PackedIterableDataset(shards.path, batch_rows=3, seed=5)
    full.set_epoch(2)
    expected = list(full)

    dataset = PackedIterableDataset(shards.path, batch_rows=3, seed=5)
    dataset.set_epoch(2)
    head = list(itertools.islice(dataset, 7))
    state = dataset.state_dict()
    assert state["epoch"] == 2 and state["next_batch"] == 7

    calls = []
    original = loaders.collate.collate_rows
    monkeypatch.setattr("loaders.dataset.collate_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
    resumed = PackedIterableDataset(shards.path, batch_rows=3, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a resumed training loop calls it again; the position stays
    rest = list(resumed)
    assert_same_batches(head + rest, expected)
    assert len(calls) == len(expected) - 7, "a resume must seek, not collate the batches it skips"


def test_resume_after_an_epoch_ends(shards):
    dataset = PackedIterableDataset(shards.path, batch_rows=3)
    list(dataset)
    state = dataset.state_dict()
    resumed = PackedIterableDataset(shards.path, batch_rows=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    reference = PackedIterableDataset(shards.path, batch_rows=3)
    reference.set_epoch(1)
    assert_same_batches(list(resumed), list(reference))


def test_a_state_saved_after_the_epoch_loop_resumes_at_the_next_epoch(shards):
    dataset = PackedIterableDataset(shards.path, batch_rows=3)
    dataset.set_epoch(0)
    list(dataset)
    state = dataset.state_dict()  # saved after the loop of epoch 0 ended
    resumed = PackedIterableDataset(shards.path, batch_rows=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the resumed loop names the epoch its checkpoint was taken in
    assert list(resumed) == [], "epoch 0 is over"
    resumed.set_epoch(1)
    reference = PackedIterableDataset(shards.path, batch_rows=3)
    reference.set_epoch(1)
    assert_same_batches(list(resumed), list(reference))


def test_resume_refuses_a_state_of_other_settings(shards):
    state = PackedIterableDataset(shards.path, batch_rows=3, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed 1 -> 2"):
        PackedIterableDataset(shards.path, batch_rows=3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle True -> False"):  # another batch_rows resumes (test_elastic.py)
        PackedIterableDataset(shards.path, batch_rows=4, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="not a PackedIterableDataset"):
        PackedIterableDataset(shards.path, batch_rows=3, seed=1).load_state_dict({"epoch": 0})


def test_resume_with_stateful_dataloader_and_another_num_workers(shards):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    settings = {"batch_rows": 2, "seed": 9, "rank": 1, "world_size": 2}
    expected = list(PackedIterableDataset(shards.path, **settings))

    loader = stateful.StatefulDataLoader(PackedIterableDataset(shards.path, **settings), batch_size=None, num_workers=2)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    state = loader.state_dict()
    del iterator

    # The same number of workers: the loader restores each worker's own state.
    same = stateful.StatefulDataLoader(PackedIterableDataset(shards.path, **settings), batch_size=None, num_workers=2)
    same.load_state_dict(state)
    assert_same_batches(head + list(same), expected)

    # Another number of workers (or none): the dataset turns the loader's state into the rank's position.
    for workers in (3, 0):
        dataset = PackedIterableDataset(shards.path, **settings)
        dataset.load_state_dict(state)
        rest = list(stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=workers))
        assert_same_batches(head + rest, expected)


@pytest.mark.parametrize("buckets", [False, True], ids=["worst-case", "buckets"])
def test_fixed_shape_batches_have_one_shape(shards, row_index, buckets):
    for settings in ({"batch_rows": 3}, {"tokens_per_batch": 150}):
        fixed = PackedIterableDataset(shards.path, pad_to_fixed_shape=True, bucket_shapes=buckets, pad_token_id=7, **settings)
        plain = list(PackedIterableDataset(shards.path, **settings))
        batches = list(fixed)
        shape = fixed.fixed_shape
        assert len(batches) == len(plain)
        for batch, unpadded in zip(batches, plain):
            assert batch["input_ids"].shape == (1, shape.tokens)
            longest = unpadded["max_length_q"]
            if buckets:
                # max_length: the longest sequence rounded up to a power of two (>= 128, <= capacity);
                # sequences: a multiple of 64.
                assert batch["max_length_q"] == min(CAPACITY, max(128, 1 << (longest - 1).bit_length()))
                assert (batch["cu_seq_lens_q"].numel() - 1) % 64 == 0
            else:
                assert batch["cu_seq_lens_q"].shape == (shape.cu_seqlens,) and batch["max_length_q"] == CAPACITY
            assert batch["max_length_k"] == batch["max_length_q"] >= longest
            real = int(unpadded["cu_seq_lens_q"][-1])
            assert batch["num_real_tokens"] == real and batch["num_loss_tokens"] == unpadded["num_loss_tokens"]
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(batch[key][0, :real], unpadded[key][0])
            assert bool((batch["input_ids"][0, real:] == 7).all()) and bool((batch["labels"][0, real:] == -100).all())
            cu = batch["cu_seq_lens_q"]
            lengths = cu.diff()
            assert int(cu[-1]) == shape.tokens and bool((lengths >= 0).all()) and int(lengths.max()) <= batch["max_length_q"]
            real_segments = unpadded["cu_seq_lens_q"].numel()
            assert torch.equal(cu[:real_segments], unpadded["cu_seq_lens_q"])
            # Pad position ids restart per pad chunk, so the whole batch reads as sequences of cu_seqlens.
            nonempty = lengths[lengths > 0].tolist()
            assert torch.equal(batch["position_ids"][0], torch.cat([torch.arange(n) for n in nonempty]))


def test_bucketed_shapes_are_few_and_tight(tmp_path):
    """Short examples in long rows: max_length follows the longest example, not the capacity."""
    from loaders.collate import bucket_length

    lengths = np.random.default_rng(4).integers(20, 300, 400)
    build = build_shard_dir(tmp_path, lengths, capacity=1024, vocab_size=100, seed=4)
    dataset = PackedIterableDataset(build.path, batch_rows=2, pad_to_fixed_shape=True, bucket_shapes=True)
    plain = list(PackedIterableDataset(build.path, batch_rows=2))
    shapes = set()
    for batch, unpadded in zip(dataset, plain):
        assert batch["max_length_q"] == bucket_length(unpadded["max_length_q"], 1024) < 1024
        assert batch["input_ids"].shape == (1, 2048) and int(batch["cu_seq_lens_q"].diff().max()) <= batch["max_length_q"]
        shapes.add((batch["cu_seq_lens_q"].numel(), batch["max_length_q"]))
    assert 1 < len(shapes) <= 4
    assert [bucket_length(n, 4096) for n in (1, 128, 129, 4000)] == [128, 128, 256, 4096]
