"""Resume at any point, epoch ends included: the resumed run reads what the uninterrupted run reads.

Two training-loop styles, as the README shows them: a plain loop over the dataset that saves
``dataset.state_dict()``, and torchdata's ``StatefulDataLoader`` with workers, whose
``loader.state_dict()`` is saved. Either resumes a loop ``for epoch in range(start, epochs):
dataset.set_epoch(epoch)``, where ``start`` is the epoch the checkpoint was taken in, or the
next one when it was taken after that epoch's loop ended.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

CAPACITY = 32
EPOCHS = 3


@pytest.fixture(scope="module")
def build(resume_build):
    """Whole examples only (none longer than a row), of random tokens: a segment's tokens name its example; built once
    for this module and test_resume_epoch_end.py (conftest.py)."""
    assert resume_build.manifest.capacity == CAPACITY
    return resume_build


@pytest.fixture(scope="module")
def example_of(resume_example_of):
    """Example id by the tuple of its tokens."""
    return resume_example_of


def read(batch, example_of) -> tuple[int, ...]:
    """The example ids of a batch, in order."""
    tokens, cu = batch["input_ids"][0].tolist(), batch["cu_seq_lens_q"].tolist()
    return tuple(example_of[tuple(tokens[a:b])] for a, b in zip(cu[:-1], cu[1:]))


def uninterrupted(build, example_of, settings_, epochs=EPOCHS) -> list[tuple[int, tuple[int, ...]]]:
    """(epoch, example ids) of every batch of an uninterrupted run of ``epochs`` epochs."""
    dataset = PackedIterableDataset(build.path, **settings_)
    reads = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        reads += [(epoch, read(batch, example_of)) for batch in dataset]
    return reads


def epochs_read(build, example_of, settings_, epochs) -> list[list[tuple[int, ...]]]:
    """The example ids of each batch of each of the first ``epochs`` epochs, epoch by epoch, read without a stop."""
    reads = uninterrupted(build, example_of, settings_, epochs)
    return [[batch for read_epoch, batch in reads if read_epoch == epoch] for epoch in range(epochs)]

def plain_loop(dataset, example_of, start, stop=None, save_after_loop=False):
    """The README's loop from ``start``: its reads, and the state saved after ``stop`` batches (or None).

    The state is saved inside the epoch's loop right after that batch, or, with
    ``save_after_loop``, after the epoch's loop ended (``stop`` is then an epoch's last batch).
    """
    reads = []
    for epoch in range(start, EPOCHS):
        dataset.set_epoch(epoch)
        for batch in dataset:
            reads.append((dataset.epoch, read(batch, example_of)))
            if len(reads) == stop and not save_after_loop:
                return reads, dataset.state_dict(), epoch
        if len(reads) == stop:
            return reads, dataset.state_dict(), epoch
    return reads, None, None


def loader_loop(dataset, loader, example_of, start, stop=None, save_after_loop=False):
    """``plain_loop`` through a StatefulDataLoader, saving ``loader.state_dict()``."""
    reads = []
    for epoch in range(start, EPOCHS):
        dataset.set_epoch(epoch)
        for batch in loader:
            reads.append((epoch, read(batch, example_of)))
            if len(reads) == stop and not save_after_loop:
                return reads, loader.state_dict(), epoch
        if len(reads) == stop:
            return reads, loader.state_dict(), epoch
    return reads, None, None


def data_epochs(reads):
    """Example ids read in each epoch, with repeats."""
    by_epoch: dict[int, list[int]] = {}
    for epoch, examples in reads:
        by_epoch.setdefault(epoch, []).extend(examples)
    return by_epoch


def test_a_loop_resumed_at_the_finished_epochs_number_reads_every_epoch_once(build, example_of):
    expected = uninterrupted(build, example_of, {"batch_rows": 2, "seed": 3})
    per_epoch = len(PackedIterableDataset(build.path, batch_rows=2, seed=3))
    head, state, epoch = plain_loop(PackedIterableDataset(build.path, batch_rows=2, seed=3), example_of, 0,
                                    stop=per_epoch, save_after_loop=True)
    resumed = PackedIterableDataset(build.path, batch_rows=2, seed=3)
    resumed.load_state_dict(state)
    rest, _, _ = plain_loop(resumed, example_of, start=epoch)  # the epoch the checkpoint was taken in
    assert head + rest == expected


def test_a_stateful_dataloader_state_saved_after_the_epoch_loop_resumes_at_the_next_epoch(build, example_of):
    settings_ = {"batch_rows": 2, "seed": 4}
    expected = uninterrupted(build, example_of, settings_)
    per_epoch = len(PackedIterableDataset(build.path, **settings_))
    dataset = PackedIterableDataset(build.path, **settings_)
    head, state, epoch = loader_loop(dataset, StatefulDataLoader(dataset, batch_size=None, num_workers=2), example_of,
                                     0, stop=per_epoch, save_after_loop=True)
    assert state["_iterator_finished"]
    for start in (epoch, epoch + 1):
        resumed = PackedIterableDataset(build.path, **settings_)
        resumed.load_state_dict(state)
        loader = StatefulDataLoader(resumed, batch_size=None, num_workers=2)
        loader.load_state_dict(state)
        rest, _, _ = loader_loop(resumed, loader, example_of, start)
        assert head + rest == expected, f"resumed from epoch {start}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("next_batch", -5), ("next_batch", 10**6), ("pass_start", -1), ("epoch", -1), ("worker_id", 2),
     ("num_workers", 0), ("next_batch", "3"), ("finished", "no")],
)
def test_a_position_out_of_range_is_refused(build, field, value):
    dataset = PackedIterableDataset(build.path, batch_rows=2)
    state = {**dataset.state_dict(), field: value}
    with pytest.raises(ValueError, match=rf"^loader state: {field} ") as refused:
        PackedIterableDataset(build.path, batch_rows=2).load_state_dict(state)
    assert "\n" not in str(refused.value)


def test_a_stateful_dataloader_state_out_of_range_is_refused(build):
    dataset = PackedIterableDataset(build.path, batch_rows=2)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    state["_steps_since_snapshot"] = 10**6
    with pytest.raises(ValueError, match=r"^loader state: next_batch "):
        PackedIterableDataset(build.path, batch_rows=2).load_state_dict(state)


MALFORMED_STATES = {  # a state of the wrong shape, and the field the error names
    "version-a-string": ({"format": "varpack.loader_state", "version": "2"}, "version '2' must be an integer"),
    "snapshot-not-an-object": ({"_snapshot": 5}, "_snapshot 5 must be an object"),
    "snapshot-without-workers": ({"_snapshot": {}}, "_snapshot._worker_snapshots None must be a non-empty object"),
    "workers-a-list": ({"_snapshot": {"_worker_snapshots": [1]}}, r"_snapshot._worker_snapshots \[1\] must be"),
    "worker-without-dataset-state": ({"_snapshot": {"_worker_snapshots": {"0": {}}}},
                                     r"_snapshot._worker_snapshots\['0'\] {} must be an object with a dataset_state"),
}


@pytest.mark.parametrize("case", MALFORMED_STATES)
def test_a_malformed_state_is_one_line_naming_its_field(build, tmp_path, case):
    state, message = MALFORMED_STATES[case]
    with pytest.raises(ValueError, match=rf"^loader state: {message}") as refused:
        PackedIterableDataset(build.path, batch_rows=2).load_state_dict(state)
    assert "\n" not in str(refused.value)


def test_train_py_resume_from_a_malformed_loader_state_is_one_line(tmp_path):
    import json

    from test_train import MODEL, load_script

    shards = build_shard_dir(tmp_path / "shards", np.random.default_rng(0).integers(8, 120, 30), capacity=256,
                             vocab_size=128).path
    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32",
              "--batch-rows", "2", "--out", str(tmp_path / "run")]
    main = load_script().main
    main([*common, "--max-steps", "2"])
    (tmp_path / "run" / "checkpoint-2" / "loader_state.json").write_text(json.dumps({"_snapshot": {}}))
    with pytest.raises(SystemExit) as refused:
        main([*common, "--max-steps", "3", "--resume"])
    state_file = tmp_path / "run" / "checkpoint-2" / "loader_state.json"
    assert str(refused.value).startswith(f"train.py: error: {state_file}: loader state: _snapshot._worker_snapshots None must be")
    assert "\n" not in str(refused.value) and not (tmp_path / "run" / "checkpoint-3").exists()


@st.composite
def runs(draw, build):
    """Loader settings, and where a run stops and how it saves and resumes."""
    world_size = draw(st.integers(1, 3))
    if draw(st.booleans()):
        batch = {"tokens_per_batch": draw(st.integers(CAPACITY, 4 * CAPACITY))}
    else:
        batch = {"batch_rows": draw(st.integers(1, 4))}
    settings_ = {**batch, "seed": draw(st.integers(0, 100)), "world_size": world_size,
                 "shuffle_buffer_rows": draw(st.integers(1, 20))}
    ends = np.cumsum(batches_per_epoch(build, settings_)).tolist()
    # Exactly at the end of an epoch half the time, else anywhere.
    stop = draw(st.sampled_from(ends[:-1]) | st.integers(1, ends[-1]))
    at_end = stop in ends
    return {
        "settings": settings_,
        "stop": stop,
        "save_after_loop": at_end and draw(st.booleans()),
        "resume_next_epoch": draw(st.booleans()),
    }


def batches_per_epoch(build, settings_) -> list[int]:
    """A rank's batches in each epoch (under a token budget they vary by epoch)."""
    dataset = PackedIterableDataset(build.path, rank=0, **settings_)
    counts = []
    for epoch in range(EPOCHS):
        dataset.set_epoch(epoch)
        counts.append(len(dataset))
    return counts


def resume_start(epoch, run):
    """The loop's first epoch after resume: the checkpoint's, or the next one when taken after its loop ended."""
    return epoch + 1 if run["save_after_loop"] and run["resume_next_epoch"] else epoch


def assert_once_per_epoch(reads_by_rank, expected_by_rank):
    """Each rank read what it reads uninterrupted; across ranks no example is read twice in an epoch."""
    for rank, (reads, expected) in enumerate(zip(reads_by_rank, expected_by_rank)):
        assert reads == expected, f"rank {rank} read other batches than uninterrupted"
    merged: dict[int, list[int]] = {}
    for reads in reads_by_rank:
        for epoch, examples in data_epochs(reads).items():
            merged.setdefault(epoch, []).extend(examples)
    assert sorted(merged) == list(range(EPOCHS))
    for epoch, examples in merged.items():
        assert len(examples) == len(set(examples)), f"epoch {epoch} read an example twice"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plain_loop_resumes_every_example_once_per_epoch(build, example_of, data):
    run = data.draw(runs(build))
    settings_ = run["settings"]
    reads_by_rank, expected_by_rank = [], []
    for rank in range(settings_["world_size"]):
        expected_by_rank.append(uninterrupted(build, example_of, {**settings_, "rank": rank}))
        head, state, epoch = plain_loop(PackedIterableDataset(build.path, rank=rank, **settings_), example_of, 0,
                                        run["stop"], run["save_after_loop"])
        resumed = PackedIterableDataset(build.path, rank=rank, **settings_)
        resumed.load_state_dict(state)
        rest, _, _ = plain_loop(resumed, example_of, resume_start(epoch, run))
        reads_by_rank.append(head + rest)
    assert_once_per_epoch(reads_by_rank, expected_by_rank)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stateful_dataloader_resumes_every_example_once_per_epoch(build, example_of, data):
    run = data.draw(runs(build))
    settings_ = run["settings"]
    workers = data.draw(st.sampled_from([0, 1, 2]))
    workers_after = data.draw(st.sampled_from([workers, 0, 1, 2]))
    # One rank runs through the loaders (workers cost a process each); the others read uninterrupted.
    resumed_rank = data.draw(st.integers(0, settings_["world_size"] - 1))
    reads_by_rank = [uninterrupted(build, example_of, {**settings_, "rank": r}) for r in range(settings_["world_size"])]
    expected_by_rank = list(reads_by_rank)
    dataset = PackedIterableDataset(build.path, rank=resumed_rank, **settings_)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers)
    head, state, epoch = loader_loop(dataset, loader, example_of, 0, run["stop"], run["save_after_loop"])
    del loader
    resumed = PackedIterableDataset(build.path, rank=resumed_rank, **settings_)
    resumed.load_state_dict(state)
    loader = StatefulDataLoader(resumed, batch_size=None, num_workers=workers_after)
    if workers_after == workers:
        loader.load_state_dict(state)  # the same workers: torchdata gives each its own state back
    rest, _, _ = loader_loop(resumed, loader, example_of, resume_start(epoch, run))
    reads_by_rank[resumed_rank] = head + rest
    assert_once_per_epoch(reads_by_rank, expected_by_rank)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_dataset_state_after_a_dataloader_with_workers_is_refused(build, context):
    """Workers read copies of the dataset: its own state in the training process would say batch 0 after 10
    batches, and replay them. It is refused in one line naming the exact alternative, which works."""
    import torch

    dataset = PackedIterableDataset(build.path, batch_rows=1, seed=3)
    assert len(dataset) > 10
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
    batches = iter(loader)
    for _ in range(10):
        next(batches)
    with pytest.raises(RuntimeError, match=r"DataLoader workers read this dataset, so its position in the training "
                                           r"process is not the loader's; save torchdata's "
                                           r"StatefulDataLoader.state_dict\(\) instead \(exact for any num_workers\), "
                                           r"or read with num_workers=0$"):
        dataset.state_dict()
    del batches

    dataset.set_epoch(0)  # the pass above was broken off: a new one names its epoch
    stateful = StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
    batches = iter(stateful)
    read = [next(batches)["input_ids"] for _ in range(10)]
    dataset.load_state_dict(stateful.state_dict())
    assert dataset.state_dict()["next_batch"] == 10
    first = next(iter(dataset))["input_ids"]
    assert torch.equal(first, next(batches)["input_ids"])
    assert not any(torch.equal(first, earlier) for earlier in read)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_restored_after_its_epoch_ended_reads_nothing_more_of_that_epoch(build, example_of, workers):
    """A loader state saved after the epoch's loop ended, restored into a StatefulDataLoader whose loop names that
    epoch again: torchdata makes one iterator while restoring and another for the loop, and neither reads the epoch
    again (nor the next epoch under its number); the next epoch then reads as it does uninterrupted."""
    settings_ = {"batch_rows": 1, "seed": 0, "shuffle_buffer_rows": 1}
    expected = uninterrupted(build, example_of, settings_, epochs=2)
    dataset = PackedIterableDataset(build.path, **settings_)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers)
    dataset.set_epoch(0)
    head = [(0, read(batch, example_of)) for batch in loader]
    state = loader.state_dict()
    resumed = PackedIterableDataset(build.path, **settings_)
    resumed.load_state_dict(state)
    loader = StatefulDataLoader(resumed, batch_size=None, num_workers=workers)
    loader.load_state_dict(state)
    rest = []
    for epoch in (0, 1):
        resumed.set_epoch(epoch)
        rest += [(epoch, read(batch, example_of)) for batch in loader]
    assert head + rest == expected
