"""Persistent DataLoader workers read the epoch ``set_epoch`` names, from where a worker started now would.

A loop that calls ``set_epoch(epoch)`` before each pass and turns on ``persistent_workers=True``
for speed reads, pass by pass, the batches of the same loop without persistent workers (and, but
for a pass broken off mid-epoch, of the training process reading the dataset itself): the workers
take the position the training process's dataset was set to from the memory they share with it
(``loaders/worker_ledger.py``) at the start of each pass, instead of going on from their own.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_resume import epochs_read, read
from torch.utils.data import DataLoader

from loaders import PackedIterableDataset, PackedMixture

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

SETTINGS = {"batch_rows": 2, "seed": 5}  # 18 batches an epoch of the 36 rows of test_resume.py's build
LOADERS = {"DataLoader": DataLoader, "StatefulDataLoader": StatefulDataLoader}


@pytest.fixture(scope="module")
def build(resume_build):
    """test_resume.py's build (conftest.py): whole examples of random tokens, a segment's tokens name its example."""
    return resume_build


@pytest.fixture(scope="module")
def example_of(resume_example_of):
    """Example id by the tuple of its tokens."""
    return resume_example_of


def run_loop(loader, dataset, example_of, loop):
    """The batches (example ids) of each pass of ``loop``: steps of (epoch set_epoch names or None, batches the pass
    takes before it breaks off, or None to read it through)."""
    passes = []
    for epoch, taken in loop:
        if epoch is not None:
            dataset.set_epoch(epoch)
        batches = iter(loader)
        if taken is None:
            passes.append([read(batch, example_of) for batch in batches])
        else:
            passes.append([read(next(batches), example_of) for _ in range(taken)])
            time.sleep(0.2)  # the workers prefetch past the break while the step trains
        del batches
    return passes


def loop_batches(build, example_of, loop, workers, persistent, loader_class=DataLoader):
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    if workers == 0:
        return run_loop(DataLoader(dataset, batch_size=None), dataset, example_of, loop)
    loader = loader_class(dataset, batch_size=None, num_workers=workers, persistent_workers=persistent)
    return run_loop(loader, dataset, example_of, loop)


LOOPS = {
    "set_epoch before each epoch": [(0, None), (1, None), (2, None)],
    "set_epoch(5) after epoch 0": [(0, None), (5, None), (6, None)],
    "set_epoch(0) twice": [(0, None), (0, None), (1, None)],
    "no set_epoch": [(None, None), (None, None), (None, None)],
}


@pytest.mark.parametrize("loader_name", list(LOADERS))
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_persistent_workers_read_each_pass_as_workers_started_for_it(build, example_of, loop, workers, loader_name):
    """Each pass of the loop reads, through persistent workers, the batches it reads through workers started for it
    and in the training process: the epoch set_epoch names, whole, or without set_epoch the next epoch. (Persistent
    workers that went on from their own place read epoch 1 after epoch 0 for set_epoch(5) and for set_epoch(0).)"""
    expected = loop_batches(build, example_of, LOOPS[loop], 0, False)
    assert len(expected[0]) == 18 and expected[0] != expected[2]
    loader_class = LOADERS[loader_name]
    assert loop_batches(build, example_of, LOOPS[loop], workers, False, loader_class) == expected
    assert loop_batches(build, example_of, LOOPS[loop], workers, True, loader_class) == expected


@pytest.mark.parametrize("loader_name", list(LOADERS))
@pytest.mark.parametrize("workers", [1, 2])
def test_persistent_workers_read_the_epoch_whole_after_a_broken_off_pass_and_set_epoch(build, example_of, workers,
                                                                                     loader_name):
    """A pass broken off after three batches, then set_epoch(0): epoch 0 is read whole, as by workers started for
    the pass (persistent workers read the rest of it, from where their prefetching stopped); set_epoch(1) then reads
    epoch 1. The training process reading the dataset itself knows which batches the loop took, and reads the rest."""
    loop = [(0, 3), (0, None), (1, None)]
    in_process = loop_batches(build, example_of, loop, 0, False)
    epoch_0, epoch_1 = in_process[0] + in_process[1], in_process[2]
    assert len(epoch_0) == 18
    loader_class = LOADERS[loader_name]
    expected = [epoch_0[:3], epoch_0, epoch_1]
    assert loop_batches(build, example_of, loop, workers, False, loader_class) == expected
    assert loop_batches(build, example_of, loop, workers, True, loader_class) == expected


def test_a_mixture_through_persistent_workers_reads_each_named_epoch(build, example_of):
    """A mixture is a PackedIterableDataset: through persistent workers, set_epoch(5) after epoch 0 reads mixture
    epoch 5, and a broken-off pass then set_epoch(0) reads epoch 0 whole, as in the training process."""
    def mixture():
        return PackedMixture({"a": build.path, "b": build.path}, weights={"a": 0.7, "b": 0.3}, **SETTINGS)

    in_process = mixture()
    expected = run_loop(in_process, in_process, example_of, [(0, None), (5, None)])
    dataset = mixture()
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    assert run_loop(loader, dataset, example_of, [(0, None), (5, 4), (0, None), (5, None)]) == [
        expected[0], expected[1][:4], expected[0], expected[1]]


def test_spawned_persistent_workers_follow_set_epoch(build, example_of):
    """Workers spawned, not forked, get the shared memory as they start: they too read epoch 0 whole after a broken-off
    pass and set_epoch(0), then the epoch set_epoch(5) names."""
    in_process = loop_batches(build, example_of, [(0, None), (5, None)], 0, False)
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="spawn")
    assert run_loop(loader, dataset, example_of, [(0, 3), (0, None), (5, None)]) == [in_process[0][:3], *in_process]


def saved(state):
    """A state as a checkpoint holds it: through JSON."""
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("workers", [1, 2])
def test_persistent_workers_resumed_mid_epoch_read_the_rest_and_then_each_named_epoch(build, example_of, workers):
    """A run through persistent workers stopped after five batches of epoch 1 and resumed (the whole state into the
    dataset and the loader) reads the rest of epoch 1, then epochs 2 and 3 whole, as the run without a stop."""
    epochs = epochs_read(build, example_of, SETTINGS, 4)
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)
    dataset.set_epoch(0)
    assert [read(batch, example_of) for batch in loader] == epochs[0]
    dataset.set_epoch(1)
    batches = iter(loader)
    head = [read(next(batches), example_of) for _ in range(5)]
    state = saved(loader.state_dict())
    del batches, loader
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    dataset.load_state_dict(copy.deepcopy(state))
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)
    loader.load_state_dict(copy.deepcopy(state))
    read_by_epoch = []
    for epoch in range(1, 4):
        dataset.set_epoch(epoch)
        read_by_epoch.append([read(batch, example_of) for batch in loader])
    assert [head + read_by_epoch[0], *read_by_epoch[1:]] == epochs[1:]


@st.composite
def loops(draw):
    """A loop of up to four passes, each after set_epoch of one of a few epochs (or none), read through or broken off;
    a pass after a broken-off one names its epoch (without, it is refused)."""
    loop = []
    for _ in range(draw(st.integers(1, 4))):
        must_name = bool(loop) and loop[-1][1] is not None
        epoch = draw(st.sampled_from([0, 1, 3]) if must_name else st.none() | st.sampled_from([0, 1, 3]))
        loop.append((epoch, draw(st.none() | st.integers(1, 12))))
    return loop


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loop=loops(), workers=st.sampled_from([1, 2]), loader_name=st.sampled_from(list(LOADERS)))
def test_any_loop_reads_the_same_batches_through_persistent_workers(build, example_of, loop, workers, loader_name):
    """Any loop of set_epoch calls and passes, read through or broken off, reads the same batches each pass through
    persistent workers as through workers started for each pass, and, when no pass breaks off, as the training
    process reading the dataset itself."""
    loader_class = LOADERS[loader_name]
    persistent = loop_batches(build, example_of, loop, workers, True, loader_class)
    assert persistent == loop_batches(build, example_of, loop, workers, False, loader_class)
    if all(taken is None for _, taken in loop):
        assert persistent == loop_batches(build, example_of, loop, 0, False)


@pytest.mark.parametrize("taken", [None, 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_go_on_from_a_pass_the_training_process_read_itself(build, example_of, persistent, taken):
    """Without set_epoch: a pass through workers, a pass the training process reads itself (num_workers=0, the same
    dataset), read through or broken off after three batches, then a pass through the workers again. The workers go on
    from where the training process's pass stopped, persistent ones too: epochs 0, 1 and 2, or epoch 0, the first
    three batches of epoch 1 and its rest. (Persistent workers that missed the training process's pass read epoch 1
    again.)"""
    epochs = loop_batches(build, example_of, [(0, None), (1, None), (2, None)], 0, False)
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    passes = run_loop(loader, dataset, example_of, [(None, None)])
    passes += run_loop(DataLoader(dataset, batch_size=None), dataset, example_of, [(None, taken)])
    passes += run_loop(loader, dataset, example_of, [(None, None)])
    assert passes == ([epochs[0], epochs[1][:3], epochs[1][3:]] if taken else epochs)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_go_on_from_the_empty_pass_the_training_process_read_over_a_finished_loaded_epoch(build, example_of,
                                                                                                   persistent):
    """Workers already started, then a state saved after epoch 0's loop loaded, set_epoch(0) as a resumed run calls,
    and the finished epoch's empty pass read by the training process itself: the workers' next passes, without
    set_epoch, read epochs 1 and 2, persistent ones too. (Persistent workers that missed the training process's empty
    pass read it again, and each later pass one epoch late.)"""
    epochs = loop_batches(build, example_of, [(1, None), (2, None)], 0, False)
    saved = PackedIterableDataset(build.path, **SETTINGS)
    saver = StatefulDataLoader(saved, batch_size=None, num_workers=2)
    run_loop(saver, saved, example_of, [(0, None)])
    state = json.loads(json.dumps(saver.state_dict()))
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    run_loop(loader, dataset, example_of, [(3, None)])
    dataset.load_state_dict(state)
    passes = run_loop(DataLoader(dataset, batch_size=None), dataset, example_of, [(0, None)])
    passes += run_loop(loader, dataset, example_of, [(None, None), (None, None)])
    assert passes == [[], *epochs]
