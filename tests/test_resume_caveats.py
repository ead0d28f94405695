"""Resumes and passes through DataLoader workers that used to lose or repeat rows without ``set_epoch``.

Each case reads every row of an epoch once, as the training process would, or is refused in one line
that says what to do: a one-worker loader's state loaded into a loader of another batch size, a copied
dataset, a pass broken off mid-epoch, and persistent workers started by ``state_dict()`` before the
loop's first ``set_epoch``.
"""

from __future__ import annotations

import copy
import json
import pickle
import time

import numpy as np
import pytest
from shard_factory import build_shard_dir
from test_resume import CAPACITY, epochs_read, read
from torch.utils.data import DataLoader

from loaders import PackedIterableDataset
from loaders.resume import StaleStateError

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

SETTINGS = {"batch_rows": 4, "seed": 1}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    # Whole examples of random tokens, as test_resume.py's: a segment's tokens name its example.
    lengths = np.random.default_rng(13).integers(3, CAPACITY + 1, 60)
    return build_shard_dir(tmp_path_factory.mktemp("caveats"), lengths, capacity=CAPACITY, rows_per_shard=4,
                           vocab_size=30000)


@pytest.fixture(scope="module")
def example_of(build):
    """Example id by the tuple of its tokens."""
    return {tuple(build.example(i)[0].tolist()): i for i in range(build.lengths.size)}


def saved(state):
    """A state as a checkpoint holds it: through JSON."""
    return json.loads(json.dumps(state))


def test_a_one_worker_loader_state_loaded_into_a_loader_of_another_batch_size_is_refused(build, example_of):
    """A worker's own state cannot place a worker of another layout (torchdata goes on counting the old pass's
    batches), with one worker as with two: the loader refuses, saying to load the whole state into the dataset,
    and that resume reads every example of the epoch once."""
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    dataset.set_epoch(0)
    batches = iter(StatefulDataLoader(dataset, batch_size=None, num_workers=1))
    head = [example for _ in range(5) for example in read(next(batches), example_of)]
    state = saved(batches.state_dict())
    del batches
    other = {**SETTINGS, "batch_rows": 3}
    resumed = PackedIterableDataset(build.path, **other)
    resumed.load_state_dict(copy.deepcopy(state))
    misused = StatefulDataLoader(resumed, batch_size=None, num_workers=1)
    misused.load_state_dict(copy.deepcopy(state))
    resumed.set_epoch(0)
    with pytest.raises(ValueError, match=r"load the StatefulDataLoader's whole state into the dataset \(dataset"):
        next(iter(misused))
    resumed = PackedIterableDataset(build.path, **other)
    resumed.load_state_dict(copy.deepcopy(state))
    resumed.set_epoch(0)
    rest = [read(batch, example_of) for batch in StatefulDataLoader(resumed, batch_size=None, num_workers=1)]
    examples = head + [example for batch in rest for example in batch]
    rows = resumed.reader.num_rows
    assert len(examples) == len(set(examples)) and 5 * 4 + 3 * len(rest) == rows - (rows - 5 * 4) % 3


@pytest.mark.parametrize("copied", ["deepcopy", "pickle"])
def test_a_copied_dataset_read_through_workers_without_set_epoch_reads_the_next_epoch_each_pass(
        build, example_of, copied):
    """A copy is a dataset of its own: its workers tell it which epoch they read through, as the original's tell
    the original, and its position after they read it is refused as stale."""
    def passes(loader):
        return [[read(batch, example_of) for batch in loader] for _ in range(3)]

    in_process = PackedIterableDataset(build.path, **SETTINGS)
    epochs = passes(in_process)
    original = PackedIterableDataset(build.path, **SETTINGS)
    dataset = copy.deepcopy(original) if copied == "deepcopy" else pickle.loads(pickle.dumps(original))
    assert passes(DataLoader(dataset, batch_size=None, num_workers=2)) == epochs
    with pytest.raises(StaleStateError, match="DataLoader workers read this dataset"):
        dataset.state_dict()
    assert original.state_dict()["epoch"] == 0, "the original is a dataset of its own"


@pytest.mark.parametrize("one_share_read", [True, False])
def test_a_pass_through_workers_broken_off_mid_epoch_is_refused_until_set_epoch(build, example_of, one_share_read):
    """Which batches of a broken-off pass its loop took is unknown (workers prefetch beyond it), so a new pass
    without set_epoch neither skips the rest of the epoch (it did once one worker had read its share through)
    nor reads it again (it did when none had): it is refused, saying to call set_epoch, which reads it whole.

    With 5 batches (worker 0 reads 0, 2 and 4, worker 1 reads 1 and 3) and two prefetched a worker, taking two
    batches asks worker 1 for a third, past its share: its share is read through, worker 0's is not."""
    rows = PackedIterableDataset(build.path).reader.num_rows
    settings_ = {**SETTINGS, "batch_rows": rows // 5 if one_share_read else 2}
    epoch = [read(batch, example_of) for batch in PackedIterableDataset(build.path, **settings_)]
    dataset = PackedIterableDataset(build.path, **settings_)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    batches = iter(loader)
    taken = 2 if one_share_read else 1
    assert [read(next(batches), example_of) for _ in range(taken)] == epoch[:taken]
    time.sleep(1)  # the workers prefetch while the step trains
    del batches  # the loop breaks, to evaluate say, and training goes on with a new pass
    with pytest.raises(ValueError, match=r"a pass through DataLoader workers over epoch 0 was broken off before its "
                                         r"end, .*call dataset.set_epoch\(epoch\) before each pass"):
        next(iter(loader))
    dataset.set_epoch(0)
    assert [read(batch, example_of) for batch in loader] == epoch


@pytest.mark.parametrize("next_workers", [0, 1, 3])
def test_a_broken_off_pass_is_refused_also_to_another_number_of_workers_or_the_process_itself(build, example_of,
                                                                                              next_workers):
    """A pass of two workers broken off after one batch, then a pass of another number of workers (or none: the
    training process reading the dataset itself) without set_epoch: refused, not read again from its first batch;
    set_epoch then reads the epoch whole. An epoch set_epoch cannot name in a state is refused."""
    settings_ = {**SETTINGS, "batch_rows": 2}
    epoch = [read(batch, example_of) for batch in PackedIterableDataset(build.path, **settings_)]
    dataset = PackedIterableDataset(build.path, **settings_)
    batches = iter(DataLoader(dataset, batch_size=None, num_workers=2))
    assert read(next(batches), example_of) == epoch[0]
    time.sleep(1)  # the workers prefetch while the step trains
    del batches
    loader = DataLoader(dataset, batch_size=None, num_workers=next_workers)
    with pytest.raises(ValueError, match=r"over epoch 0 was broken off before its end, .*also through persistent workers"):
        next(iter(loader))
    dataset.set_epoch(0)
    assert [read(batch, example_of) for batch in loader] == epoch
    with pytest.raises(ValueError, match=r"epoch must be an integer from 0 to 2\*\*53 - 1"):
        dataset.set_epoch(2**53)


@pytest.mark.parametrize("workers", [1, 2])
def test_persistent_workers_started_by_state_dict_before_set_epoch_read_each_epoch_under_its_number(
        build, example_of, workers):
    """Resumed from a state saved after epoch 0's loop ended, a loader whose state_dict() is taken before the
    loop's first set_epoch (a checkpoint or a log right after resuming) starts its persistent workers then; they
    still see the loop name the finished epoch, read nothing more of it, and then epochs 1 and 2 under their
    numbers."""
    epochs = epochs_read(build, example_of, SETTINGS, 3)
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)
    dataset.set_epoch(0)
    assert [read(batch, example_of) for batch in loader] == epochs[0]
    state = saved(loader.state_dict())
    del loader
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    dataset.load_state_dict(copy.deepcopy(state))
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)
    loader.load_state_dict(copy.deepcopy(state))
    saved(loader.state_dict())  # checkpointed or logged right after resuming
    read_by_epoch = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        read_by_epoch.append([read(batch, example_of) for batch in loader])
    assert read_by_epoch == [[], epochs[1], epochs[2]]


@pytest.mark.parametrize(("workers", "persistent"), [(1, False), (2, False), (2, True)])
def test_a_resumed_pass_past_an_epoch_end_broken_off_then_set_epoch_reads_the_named_epoch_whole(
        build, example_of, workers, persistent):
    """Resumed from a state saved after epoch 0's loop ended: a pass through workers without set_epoch reads epoch 1
    and breaks off after two batches; set_epoch(0) then reads epoch 0 whole, as in the run without a stop. (The
    resumed dataset went on counting the finished epoch 0 as loaded, and its pass read nothing.)"""
    epochs = epochs_read(build, example_of, SETTINGS, 2)
    first = PackedIterableDataset(build.path, **SETTINGS)
    loader = StatefulDataLoader(first, batch_size=None, num_workers=2)
    first.set_epoch(0)
    assert [read(batch, example_of) for batch in loader] == epochs[0]
    state = saved(loader.state_dict())
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    dataset.load_state_dict(state)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=persistent)
    batches = iter(loader)
    assert [read(next(batches), example_of) for _ in range(2)] == epochs[1][:2]
    time.sleep(0.2)  # the workers prefetch past the break
    del batches
    dataset.set_epoch(0)
    assert len(epochs[0]) > 4 and [read(batch, example_of) for batch in loader] == epochs[0]
