"""Resume at and around an epoch's end through DataLoader workers, and chains of resumes.

A run stopped and resumed any number of times, through a plain loop or torchdata's
``StatefulDataLoader`` with 0-3 workers, persistent or not, reads the batches of the run
without stops, epoch by epoch. Without ``set_epoch``, every full pass through workers reads the
next epoch, as in the training process. ``PackedTrainer`` logs the share of the epochs read
after a resume under another batch size.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from shard_factory import build_shard_dir
from test_resume import EPOCHS, loader_loop, read, uninterrupted
from torch.utils.data import DataLoader

from loaders import PackedIterableDataset, PackedMixture

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

SETTINGS = {"batch_rows": 2, "seed": 3}


@pytest.fixture(scope="module")
def build(resume_build):
    """test_resume.py's build (conftest.py): whole examples of random tokens, a segment's tokens name its example."""
    return resume_build


@pytest.fixture(scope="module")
def example_of(resume_example_of):
    """Example id by the tuple of its tokens."""
    return resume_example_of


def saved(state):
    """A state as a checkpoint holds it: through JSON."""
    return json.loads(json.dumps(state))


def resumed_loader(build, state, workers, same_workers, persistent=False):
    """A dataset and a StatefulDataLoader resumed at ``state`` as docs/loading.md says: the whole state into the
    dataset, and into the loader too when it has the workers that saved it."""
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    dataset.load_state_dict(copy.deepcopy(state))
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=persistent)
    if same_workers:
        loader.load_state_dict(copy.deepcopy(state))
    return dataset, loader


def test_a_one_worker_loader_resumed_and_saved_again_resumes_at_its_batch(build, example_of):
    """Worker 0 of 1 records the fields a rank-level position has; restored into that worker, its state still
    counts from its pass's start, so the state saved after it is where the run stands, under any workers."""
    expected = uninterrupted(build, example_of, SETTINGS)
    per_epoch = len(PackedIterableDataset(build.path, **SETTINGS))
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    head, state, _ = loader_loop(dataset, StatefulDataLoader(dataset, batch_size=None, num_workers=1), example_of, 0,
                                 stop=3)
    dataset, loader = resumed_loader(build, saved(state), 1, same_workers=True)
    middle, state, _ = loader_loop(dataset, loader, example_of, 0, stop=3)
    assert saved(state)["_snapshot"]["_snapshot_step"] == 6
    for workers in (0, 2):
        dataset, loader = resumed_loader(build, saved(state), workers, same_workers=False)
        rest, _, _ = loader_loop(dataset, loader, example_of, 0)
        assert head + middle + rest == expected, f"resumed under {workers} workers"
    # Saved again after the epoch's loop ended, the state resumes (it was refused as past the epoch's end).
    dataset, loader = resumed_loader(build, saved(state), 1, same_workers=True)
    tail, state, epoch = loader_loop(dataset, loader, example_of, 0, stop=per_epoch - 6, save_after_loop=True)
    dataset, loader = resumed_loader(build, saved(state), 1, same_workers=True)
    rest, _, _ = loader_loop(dataset, loader, example_of, epoch)
    assert head + middle + tail + rest == expected


@pytest.mark.parametrize("kind", ["single", "mixture"])
def test_workers_without_set_epoch_read_the_next_epoch_each_pass(build, example_of, tmp_path, kind):
    """docs/loading.md: without set_epoch each full pass moves to the next epoch. Workers read copies of the
    training process's dataset; every new set of workers starts after the pass the last set read through, also
    after a resume mid-epoch (whose rows before the stop belong to no later pass)."""
    def make():
        if kind == "single":
            return PackedIterableDataset(build.path, **SETTINGS)
        return PackedMixture({"a": build.path, "b": build.path}, weights={"a": 0.5, "b": 0.5}, **SETTINGS)

    def passes(dataset, loader):
        return [[read(batch, example_of) for batch in loader] for _ in range(EPOCHS)]

    dataset = make()
    in_process = passes(dataset, dataset)
    assert in_process[0] != in_process[1]
    dataset = make()
    assert passes(dataset, DataLoader(dataset, batch_size=None, num_workers=2)) == in_process
    dataset.set_epoch(0)  # named again after the passes, the epoch starts over, as in the training process
    assert [read(batch, example_of) for batch in DataLoader(dataset, batch_size=None, num_workers=2)] == in_process[0]

    dataset = make()
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    batches = iter(loader)
    head = [read(next(batches), example_of) for _ in range(4)]
    state = saved(loader.state_dict())
    del batches, loader
    dataset = make()
    dataset.load_state_dict(state)
    resumed = passes(dataset, StatefulDataLoader(dataset, batch_size=None, num_workers=2))
    assert [head + resumed[0], *resumed[1:]] == in_process


@pytest.mark.parametrize("workers", [1, 2])
def test_persistent_workers_restored_after_the_epoch_ended_read_each_epoch_under_its_number(build, example_of, workers):
    """torchdata restores a loader whose pass had run out through an iterator the loop never sees; persistent
    workers (which the training process's copy does not restart) read neither that epoch again nor the next one
    under its number."""
    expected = uninterrupted(build, example_of, SETTINGS)
    per_epoch = len(PackedIterableDataset(build.path, **SETTINGS))
    for saving in (True, False):  # the saving loader's workers persistent or not
        dataset = PackedIterableDataset(build.path, **SETTINGS)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=saving)
        head, state, epoch = loader_loop(dataset, loader, example_of, 0, stop=per_epoch, save_after_loop=True)
        dataset, loader = resumed_loader(build, saved(state), workers, same_workers=True, persistent=True)
        rest, _, _ = loader_loop(dataset, loader, example_of, epoch)
        assert head + rest == expected, f"saved with persistent_workers={saving}"


def test_a_finished_epoch_stays_finished_through_a_worker_state_saved_before_its_empty_pass(build, example_of):
    """A state of a finished epoch, resumed under another batch size, the loop naming that epoch, and the
    2-worker loader's state saved before the (empty) pass ran: a third run under yet another batch size reads
    nothing more of that epoch, as when the dataset itself saved the state."""
    dataset = PackedIterableDataset(build.path, batch_rows=5, seed=3)
    assert dataset.reader.num_rows % 5, "the epoch's end drops a tail of rows, which a loop naming it must not read"
    dataset.set_epoch(0)
    epoch = [example for batch in dataset for example in read(batch, example_of)]
    finished = dataset.state_dict()
    for through_loader in (False, True):
        dataset = PackedIterableDataset(build.path, batch_rows=3, seed=3)
        dataset.load_state_dict(finished)
        dataset.set_epoch(0)
        state = StatefulDataLoader(dataset, batch_size=None, num_workers=2).state_dict() if through_loader \
            else dataset.state_dict()
        third = PackedIterableDataset(build.path, batch_rows=1, seed=3)
        third.load_state_dict(saved(state))
        third.set_epoch(0)
        assert list(third) == [], f"through the loader: {through_loader} (the epoch read {len(epoch)} examples)"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("_iterator_finished", "false", "_iterator_finished 'false' must be true or false"),
     ("_steps_since_snapshot", -4, "_steps_since_snapshot -4 must be a non-negative integer"),
     ("_snapshot_step", 2**70, "_snapshot_step 1180591620717411303424 must be a non-negative integer"),
     ("_snapshot_step", 2.0, "_snapshot_step 2.0 must be an integer")],
)
def test_a_stateful_dataloader_field_of_the_wrong_type_or_range_is_one_line_naming_it(build, field, value, message):
    dataset = PackedIterableDataset(build.path, **SETTINGS)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    state = saved(loader.state_dict())
    del batches, loader
    (state["_snapshot"] if field == "_snapshot_step" else state)[field] = value
    with pytest.raises(ValueError, match=rf"^loader state: {message}") as refused:
        PackedIterableDataset(build.path, **SETTINGS).load_state_dict(state)
    assert "\n" not in str(refused.value)


def test_epochs_read_counts_the_rows_read_before_a_resume_under_another_batch_size(build):
    """``epochs_read`` (the epoch ``PackedTrainer`` logs) is the epoch plus the share of its rows all ranks read,
    including those read before a resume under another layout, and 1 at an epoch's end even when the rest of
    the epoch holds no batch of the new layout."""
    first = PackedIterableDataset(build.path, batch_rows=4, seed=3)
    rows = first.reader.num_rows
    batches = iter(first)
    for _ in range(3):
        next(batches)
    assert first.epochs_read() == pytest.approx(12 / (rows - rows % 4))
    resumed = PackedIterableDataset(build.path, batch_rows=1, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.epochs_read() == pytest.approx(12 / rows)
    next(iter(resumed))
    assert resumed.epochs_read() == pytest.approx(13 / rows)

    first.set_epoch(0)  # read the rest of the epoch: its tail of fewer than 4 rows is dropped
    assert len(list(first)) == len(first) - 3
    resumed = PackedIterableDataset(build.path, batch_rows=8, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert len(resumed) == 0 and resumed.epochs_read() == 1.0


def test_packed_trainer_logs_the_epochs_read_after_a_resume_under_another_batch_size(tmp_path):
    """Resumed at an epoch's last batch with another batch size and ``eval_on_start``, the trainer trains on
    (it died of a ZeroDivisionError); resumed mid-epoch, its logged epoch keeps growing."""
    transformers = pytest.importorskip("transformers")
    import tiny_model

    from loaders.train.hf_trainer import PackedTrainer

    shards = build_shard_dir(tmp_path / "shards", np.random.default_rng(7).integers(4, 40, 30), capacity=64,
                             vocab_size=128).path

    def train(out, batch_rows, max_steps, resume=False, **evaluation):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=max_steps, learning_rate=0.1, optim="sgd", logging_steps=1,
            save_steps=max_steps, report_to="none", use_cpu=True, seed=0, disable_tqdm=True, **evaluation)
        extra = {"eval_dataset": PackedIterableDataset(shards, batch_rows=2, shuffle=False)} if evaluation else {}
        trainer = PackedTrainer(model=tiny_model.tiny_llama(128, 128), args=args,
                                train_dataset=PackedIterableDataset(shards, batch_rows=batch_rows, seed=0), **extra)
        trainer.train(resume_from_checkpoint=resume or None)
        return [entry["epoch"] for entry in trainer.state.log_history if "loss" in entry]

    rows = PackedIterableDataset(shards).reader.num_rows
    per_epoch = len(PackedIterableDataset(shards, batch_rows=2, seed=0))
    train("mid", 2, 2)
    assert train("mid", 1, 4, resume=True)[-2:] == pytest.approx([5 / rows, 6 / rows])
    train("end", 2, per_epoch)
    assert train("end", 4, per_epoch + 1, resume=True, eval_on_start=True, eval_strategy="steps",
                 eval_steps=100)[-1:] == pytest.approx([1 + 4 / (rows - rows % 4)])


class Run:
    """One segment of a chain: a plain loop over the dataset (``workers`` None) or a StatefulDataLoader."""

    def __init__(self, build, settings_, workers, persistent, state, into_loader):
        self.dataset = PackedIterableDataset(build.path, **settings_)
        if state is not None:
            self.dataset.load_state_dict(copy.deepcopy(state))
        self.workers = workers
        self.loader = self.dataset
        if workers is not None:
            self.loader = StatefulDataLoader(self.dataset, batch_size=None, num_workers=workers,
                                             persistent_workers=persistent and workers > 0)
            if state is not None and into_loader:
                self.loader.load_state_dict(copy.deepcopy(state))

    def events(self, start, example_of):
        """("set_epoch" | "batch" | "loop_end", epoch, example ids) of the README loop from epoch ``start``."""
        for epoch in range(start, EPOCHS):
            self.dataset.set_epoch(epoch)
            yield "set_epoch", epoch, ()
            for batch in self.loader:
                yield "batch", epoch, read(batch, example_of)
            yield "loop_end", epoch, ()

    def state(self):
        return saved(self.dataset.state_dict() if self.workers is None else self.loader.state_dict())


STOPS = st.one_of(st.tuples(st.just("after events"), st.integers(1, 80)),
                  st.tuples(st.sampled_from(["at the last batch", "at the loop's end", "at the next set_epoch"]),
                            st.integers(1, 2)))
# (workers: None for a plain loop, persistent, where it stops, whether a stop at a loop's end resumes at the next epoch)
SEGMENTS = st.tuples(st.sampled_from([None, 0, 1, 2]), st.booleans(), STOPS, st.booleans())
CHAINS = st.fixed_dictionaries({"batch_rows": st.integers(2, 4), "seed": st.integers(0, 9),
                                "segments": st.lists(SEGMENTS, min_size=1, max_size=3)})
ONE_WORKER_RESUMED_TWICE = {"batch_rows": 2, "seed": 3, "segments": [(1, False, ("after events", 4), False)] * 2}
PERSISTENT_AFTER_THE_LOOP = {"batch_rows": 2, "seed": 3, "segments": [(2, True, ("at the loop's end", 1), False),
                                                                      (2, True, ("after events", 80), False)]}


def stops(stop, event, reads, per_epoch, ends) -> bool:
    """Whether a segment stopping at ``stop`` stops after ``event``, which follows ``ends`` loop ends of the segment."""
    where, count = stop
    kind, epoch, _ = event
    if where == "at the last batch":
        return kind == "batch" and ends == count - 1 and sum(e == epoch for e, _ in reads) == per_epoch[epoch]
    if where == "at the loop's end":
        return kind == "loop_end" and ends == count - 1
    return kind == "set_epoch" and ends == count


@settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: each runs loaders
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=CHAINS)
@example(chain=ONE_WORKER_RESUMED_TWICE)
@example(chain=PERSISTENT_AFTER_THE_LOOP)
def test_any_chain_of_resumes_reads_the_uninterrupted_batches(build, example_of, chain):
    """Stopped and resumed up to three times, anywhere (after any event of the loop, at an epoch's last batch,
    its loop's end or the next set_epoch), through a plain loop or a StatefulDataLoader of 0-2 workers,
    persistent or not, resumed as docs/loading.md says, then read to the end in a plain loop: the run reads the
    batches of the run without stops, in order."""
    settings_ = {"batch_rows": chain["batch_rows"], "seed": chain["seed"]}
    expected = [(epoch, examples) for kind, epoch, examples in Run(build, settings_, None, False, None, False)
                .events(0, example_of) if kind == "batch"]
    per_epoch = {epoch: sum(e == epoch for e, _ in expected) for epoch in range(EPOCHS)}
    reads: list = []
    state, start, workers_before = None, 0, "none"
    for workers, persistent, stop, resume_next in chain["segments"]:
        run = Run(build, settings_, workers, persistent, state, into_loader=workers == workers_before)
        ends, last = 0, None
        for count, event in enumerate(run.events(start, example_of), 1):
            last = event
            if event[0] == "batch":
                reads.append(event[1:])
            if (count == stop[1]) if stop[0] == "after events" else stops(stop, event, reads, per_epoch, ends):
                break
            ends += event[0] == "loop_end"
        else:
            break  # read to the end without stopping
        state = run.state()
        kind, epoch, _ = last
        start, workers_before = epoch + (kind == "loop_end" and resume_next), workers
        del run
    else:
        reads += [event[1:] for event in Run(build, settings_, None, False, state, False).events(start, example_of)
                  if event[0] == "batch"]
    assert reads == expected
