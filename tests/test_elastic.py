"""Elastic resume: a state saved by any rank of a run on N ranks resumes every rank of a run on M ranks.

Also with another ``batch_rows`` or ``tokens_per_batch``, another number of DataLoader workers,
and, for a mixture, other weights. Ranks are simulated in one process (each dataset built with
its ``rank`` and ``world_size``); a global step reads batch ``j`` of rank 0, 1, ..., then ``j + 1``.
What must hold: every row of the epoch is read once but for the tail that does not fill a batch
on every rank; the epoch after is the one the new layout reads uninterrupted; a mixture reads
each source's stream in order, no row repeated or skipped, and after a weight change every
prefix of the batches read keeps each source within one row of its new share.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from loaders import PackedIterableDataset, PackedMixture
from loaders.mixture import source_counts
from loaders.train.checkpoint import CheckpointError, load_loader_state, save_loader_state
from tests.shard_factory import build_shard_dir

CAPACITY = 32
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Three small builds of whole examples of random tokens (a sequence's tokens name its example)."""
    root = tmp_path_factory.mktemp("elastic")
    rng = np.random.default_rng(5)
    return {name: build_shard_dir(root / name, rng.integers(3, CAPACITY + 1, count), capacity=CAPACITY, rows_per_shard=5,
                                  vocab_size=30000, seed=seed)
            for seed, (name, count) in enumerate((("a", 70), ("b", 30), ("c", 40)))}


@pytest.fixture(scope="module")
def known(builds):
    """(source, example id) by the tuple of an example's tokens."""
    return {tuple(build.example(i)[0].tolist()): (source, i)
            for source, build in enumerate(builds.values()) for i in range(build.lengths.size)}


def make(builds, kind, **options):
    """The single build "a", or the mixture of all three."""
    options = {"verify_checksum": False, **options}
    if kind == "single":
        return PackedIterableDataset(builds["a"].path, **options)
    return PackedMixture({name: build.path for name, build in builds.items()}, **{"weights": WEIGHTS, **options})


def sequences(batch, known) -> list[tuple[int, int]]:
    """(source, example id) of each sequence of a batch, in order."""
    tokens, cu = batch["input_ids"][0].tolist(), batch["cu_seq_lens_q"].tolist()
    return [known[tuple(tokens[a:b])] for a, b in zip(cu[:-1], cu[1:]) if b > a]


def in_step_order(per_rank: list[list]) -> list:
    """The batches of all ranks in the order of the global steps: batch j of rank 0, 1, ..., then j + 1."""
    assert len({len(batches) for batches in per_rank}) == 1, "ranks read different numbers of batches"
    return [batches[j] for j in range(len(per_rank[0])) for batches in per_rank]


def first_run(builds, kind, layout, stop, save_after_loop):
    """Every rank of the first run reads ``stop`` batches of epoch 0 (``save_after_loop``: then ends the loop);
    its batches in step order, and each rank's state."""
    per_rank, states = [], []
    for rank in range(layout["world_size"]):
        dataset = make(builds, kind, rank=rank, **layout)
        dataset.set_epoch(0)
        batches = iter(dataset)
        per_rank.append([next(batches) for _ in range(stop)])
        if save_after_loop:
            assert not list(batches)
        states.append(dataset.state_dict())
    return in_step_order(per_rank), states


def resumed_run(builds, kind, layout, states):
    """Every rank of the resumed run loads one of ``states`` and loops over epochs 0 and 1: its batches of each."""
    per_rank: list[list[list]] = [[], []]
    for rank, state in enumerate(states):
        dataset = make(builds, kind, rank=rank, **layout)
        dataset.load_state_dict(state)
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            per_rank[epoch].append(list(dataset))
    return [in_step_order(batches) for batches in per_rank]


def row_index(dataset, source: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """For a build's reader: each example id's row, and each row's first example id."""
    reader = dataset.readers[source] if isinstance(dataset, PackedMixture) else dataset.reader
    shards = [reader.shard(i) for i in range(len(reader.manifest.shards))]
    row_of_example = np.zeros(reader.manifest.num_example_ids, dtype=np.int64)
    first_examples = []
    offset = 0
    for shard in shards:
        rows = np.repeat(np.arange(shard.num_rows), np.diff(shard.segment_offsets)) + offset
        row_of_example[shard.example_ids] = rows
        first_examples.append(shard.example_ids[shard.segment_offsets[:-1]])
        offset += shard.num_rows
    return row_of_example, np.concatenate(first_examples)


@st.composite
def layouts(draw):
    """A world size of 1 to 4 and a batch budget: rows, or tokens."""
    budget = ({"tokens_per_batch": draw(st.integers(CAPACITY, 3 * CAPACITY))} if draw(st.booleans())
              else {"batch_rows": draw(st.integers(1, 3))})
    return {"world_size": draw(st.integers(1, 4)), **budget}


@st.composite
def resumes(draw, builds, kind):
    """Two layouts, where the first run stops (epoch ends half the time), and which rank's state each new rank loads."""
    seed = draw(st.integers(0, 50))
    before, after = draw(layouts()), draw(layouts())
    per_epoch = len(make(builds, kind, seed=seed, rank=0, **before))
    stop = draw(st.sampled_from([per_epoch]) | st.integers(1, per_epoch))
    return {
        "seed": seed,
        "before": before,
        "after": after,
        "stop": stop,
        "save_after_loop": stop == per_epoch and draw(st.booleans()),
        "loaded": draw(st.lists(st.integers(0, before["world_size"] - 1), min_size=after["world_size"],
                                max_size=after["world_size"])),
        "weights": draw(st.sampled_from([WEIGHTS, {"a": 0.2, "b": 0.3, "c": 0.5}, {"a": 1, "b": 1, "c": 3}])),
    }


def tail_bound(run, dataset) -> tuple[str, int]:
    """What the rows no rank reads in epoch 0 stay below: rows (row mode) or tokens (token budget), by the layout
    whose epoch end dropped them (the first run's when it had ended its epoch's loop)."""
    layout = run["before"] if run["save_after_loop"] else run["after"]
    if layout.get("tokens_per_batch"):
        return "tokens", layout["world_size"] * layout["tokens_per_batch"]
    return "rows", layout["world_size"] * layout["batch_rows"]


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_a_single_build_resumed_on_other_ranks_and_batch_sizes_reads_every_row_once(builds, known, data):
    run = data.draw(resumes(builds, "single"))
    head, states = first_run(builds, "single", {**run["before"], "seed": run["seed"]}, run["stop"], run["save_after_loop"])
    after = {**run["after"], "seed": run["seed"]}
    rest, next_epoch = resumed_run(builds, "single", after, [states[r] for r in run["loaded"]])

    examples = [e for batch in head + rest for _, e in sequences(batch, known)]
    assert len(examples) == len(set(examples)), "an example was read twice in the epoch"
    reference = make(builds, "single", **after, rank=0)
    row_of_example, _ = row_index(reference)
    order = reference.reader.epoch_rows(0)
    unread = np.setdiff1d(np.arange(order.size), row_of_example[examples])
    # The rows no rank read are the epoch's last ones, fewer than the layout that dropped them reads in one step.
    assert np.array_equal(np.sort(order[order.size - unread.size:]), unread), "a row inside the epoch was skipped"
    unit, bound = tail_bound(run, reference)
    assert (unread.size if unit == "rows" else int(reference.reader.row_tokens[unread].sum())) < bound
    # The next epoch is the new layout's own.
    uninterrupted = []
    for rank in range(run["after"]["world_size"]):
        dataset = make(builds, "single", **after, rank=rank)
        dataset.set_epoch(1)
        uninterrupted.append(list(dataset))
    assert [sequences(b, known) for b in next_epoch] == [sequences(b, known) for b in in_step_order(uninterrupted)]


def assert_streams_read_in_order(mixture, known, batches):
    """Each source's rows, in the order read, are its stream's first rows: build epoch after epoch, none skipped
    or repeated (a row is counted at its first example)."""
    read: dict[int, list[int]] = {source: [] for source in range(len(mixture.names))}
    index = {source: row_index(mixture, source) for source in read}
    for batch in batches:
        for source, example in sequences(batch, known):
            row_of_example, first_examples = index[source]
            if first_examples[row_of_example[example]] == example:
                read[source].append(int(row_of_example[example]))
    for source, rows in read.items():
        reader = mixture.readers[source]
        stream = np.concatenate([reader.epoch_rows(e) for e in range(len(rows) // reader.num_rows + 1)])
        assert rows == stream[: len(rows)].tolist(), f"source {mixture.names[source]}: a row skipped or repeated"


def assert_shares_from_here(batches, weights, largest):
    """Every prefix of ``batches`` keeps each source's tokens within one row of its share of the tokens."""
    weights = np.array(list(weights.values()), dtype=float) / sum(weights.values())
    totals = np.zeros(weights.size)
    for batch in batches:
        totals += source_counts(batch, weights.size)["tokens"]
        assert np.abs(totals - weights * totals.sum()).max() < largest, "a source is a row off its new share"


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_a_mixture_resumed_on_other_ranks_batch_sizes_and_weights_reads_each_stream_in_order(builds, known, data):
    run = data.draw(resumes(builds, "mixture"))
    head, states = first_run(builds, "mixture", {**run["before"], "seed": run["seed"]}, run["stop"],
                             run["save_after_loop"])
    after = {**run["after"], "seed": run["seed"], "weights": run["weights"]}
    rest, next_epoch = resumed_run(builds, "mixture", after, [states[r] for r in run["loaded"]])
    reference = make(builds, "mixture", **after, rank=0)
    assert_streams_read_in_order(reference, known, head + rest + next_epoch)
    if run["weights"] != WEIGHTS:
        assert_shares_from_here(rest + next_epoch, run["weights"], int(reference._row_tokens.max()))


@settings(max_examples=4, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_a_stateful_dataloader_state_resumes_under_other_workers_ranks_and_batch_sizes(builds, known, data):
    """One rank of each run reads through a StatefulDataLoader with 0-3 workers (the others in the process); the
    whole loader state, loaded into each new rank's dataset, resumes the new layout."""
    kind = data.draw(st.sampled_from(["single", "mixture"]))
    run = data.draw(resumes(builds, kind))
    workers, workers_after = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    before, after = {**run["before"], "seed": run["seed"]}, {**run["after"], "seed": run["seed"]}
    per_rank, states = [], []
    for rank in range(before["world_size"]):
        dataset = make(builds, kind, rank=rank, **before)
        dataset.set_epoch(0)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers if rank == 0 else 0)
        batches = iter(loader)
        per_rank.append([next(batches) for _ in range(run["stop"])])
        if run["save_after_loop"]:
            assert not list(batches)
        states.append(loader.state_dict())
        del batches
    head = in_step_order(per_rank)
    resumed: list[list[list]] = [[], []]
    for rank in range(after["world_size"]):
        dataset = make(builds, kind, rank=rank, **after)
        dataset.load_state_dict(states[run["loaded"][rank]])
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=workers_after if rank == 0 else 0)
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            resumed[epoch].append(list(loader))
    rest, next_epoch = (in_step_order(batches) for batches in resumed)
    if kind == "mixture":
        assert_streams_read_in_order(make(builds, kind, **after, rank=0), known, head + rest + next_epoch)
        return
    examples = [e for batch in head + rest for _, e in sequences(batch, known)]
    assert len(examples) == len(set(examples)), "an example was read twice in the epoch"
    reference = make(builds, kind, **after, rank=0)
    row_of_example, _ = row_index(reference)
    unread = np.setdiff1d(np.arange(reference.reader.num_rows), row_of_example[examples])
    order = reference.reader.epoch_rows(0)
    assert np.array_equal(np.sort(order[order.size - unread.size:]), unread), "a row inside the epoch was skipped"


@pytest.mark.parametrize(("kind", "change", "named"), [
    ("single", {"seed": 1}, "seed 0 -> 1"),
    ("single", {"shuffle": False}, "shuffle True -> False"),
    ("single", {"shuffle_buffer_rows": 7}, "shuffle_buffer_rows 20 -> 7"),
    ("mixture", {"seed": 1}, "seed 0 -> 1"),
    ("mixture", {"unit": "rows"}, "unit 'tokens' -> 'rows'"),
])
def test_a_state_of_another_build_seed_or_shuffle_is_refused_in_one_line(builds, kind, change, named):
    saved = make(builds, kind, batch_rows=2, world_size=2, rank=1)
    next(iter(saved))
    with pytest.raises(ValueError, match=f"cannot be resumed: {named}$") as refused:
        make(builds, kind, **{"batch_rows": 3, **change}).load_state_dict(saved.state_dict())
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"fingerprint .* -> "):
        other = "b" if kind == "single" else "a"
        PackedIterableDataset(builds[other].path, verify_checksum=False).load_state_dict(saved.state_dict())


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rank", 2, r"rank 2 must be in \[0, 1\] \(world_size 2\)"),
    ("rank", "0", r"rank '0' must be in \[0, 1\]"),
    ("world_size", 0, "world_size 0 must be a positive integer"),
    ("batch_rows", None, "batch_rows None must be a positive integer when tokens_per_batch is null"),
    ("tokens_per_batch", 8, "batch_rows 2 must be a positive integer when tokens_per_batch is null, else null"),
    ("start_row", 10**6, r"start_row 1000000 must be in \[0, "),
    ("rows_read", 5, r"rows_read 5 must be 4, the rows all ranks had read at next_batch 1 of epoch 0"),
])
def test_a_state_whose_layout_or_rank_no_run_had_is_refused_naming_the_field(builds, field, value, message):
    """Loaded directly into a dataset, a state's rank must lie within its world size, its batch budget be one a
    reader takes, and its first row inside the epoch: these place the rows all ranks had read."""
    saved = make(builds, "single", batch_rows=2, world_size=2, rank=1)
    next(iter(saved))
    with pytest.raises(ValueError, match=f"^loader state: {message}") as refused:
        make(builds, "single", batch_rows=3).load_state_dict({**saved.state_dict(), field: value})
    assert "\n" not in str(refused.value)


FORGED_FIELDS = ["world_size", "rank", "batch_rows", "tokens_per_batch", "epoch", "start_row", "pass_start",
                 "next_batch", "num_workers", "worker_id", "rows_read", "version"]


@pytest.mark.parametrize("kind", ["single", "mixture"])
@pytest.mark.parametrize("field", FORGED_FIELDS)
@pytest.mark.parametrize("value", [2**63, 10**30, -(2**63) - 1])
def test_an_integer_field_beyond_any_run_is_refused_in_one_line_naming_it(builds, kind, field, value):
    """Every integer of a state is bounded by what a run could have (ranks and workers in a C int, a batch's tokens
    in int32, counts below 2**53): a forged one is a one-line ValueError naming it, never an OverflowError."""
    budget = {"tokens_per_batch": 2 * CAPACITY} if field == "tokens_per_batch" else {"batch_rows": 2}
    saved = make(builds, kind, world_size=2, rank=1, **budget)
    next(iter(saved))
    for layout in ({"batch_rows": 3, "world_size": 3, "rank": 2}, {**budget, "world_size": 2, "rank": 1}):
        with pytest.raises(ValueError, match=rf"^loader state:? {field} ") as refused:
            make(builds, kind, **layout).load_state_dict({**saved.state_dict(), field: value})
        assert "\n" not in str(refused.value)


def test_rank_states_of_different_steps_are_refused_naming_two_ranks(builds, known, tmp_path):
    """A checkpoint whose ranks' loader states stand at different steps (rank 0 after 3 batches, rank 1 after 2)
    would read rows twice on resume: every rank's resume refuses it in one line naming the ranks. States of one
    step resume three ranks, every row read at most once."""
    def save(directory, steps):
        directory.mkdir()
        for rank, stop in enumerate(steps):
            dataset = make(builds, "single", batch_rows=2, world_size=2, rank=rank)
            batches = iter(dataset)
            for _ in range(stop):
                next(batches)
            save_loader_state(directory, rank, dataset.state_dict())
        return directory

    mixed = save(tmp_path / "mixed", [3, 2])
    for rank in range(3):
        with pytest.raises(CheckpointError, match=r"rank 0 \(next_batch 3, rows_read 12\) and rank 1 \(next_batch 2, "
                           r"rows_read 8\) stand at different steps") as refused:
            load_loader_state(mixed, rank)
        assert "\n" not in str(refused.value)
    same = save(tmp_path / "same", [3, 3])
    read = []
    for rank in range(3):
        dataset = make(builds, "single", batch_rows=2, world_size=3, rank=rank)
        dataset.load_state_dict(load_loader_state(same, rank))
        read += [example for batch in dataset for example in sequences(batch, known)]
    assert read and len(read) == len(set(read))


def test_a_worker_state_of_another_layout_names_the_whole_loader_state(builds):
    """A new loader that loads the old loader's state hands each worker its own state: under another layout
    that cannot be placed, and the error says to load the whole state into the dataset instead (which works)."""
    dataset = make(builds, "single", batch_rows=2, world_size=2, rank=0)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del batches
    resumed = make(builds, "single", batch_rows=3)
    misused = StatefulDataLoader(resumed, batch_size=None, num_workers=2)
    misused.load_state_dict(state)
    with pytest.raises(ValueError, match=r"load the StatefulDataLoader's whole state into the dataset \(dataset"):
        list(misused)
    resumed.load_state_dict(state)
    assert len(list(StatefulDataLoader(resumed, batch_size=None, num_workers=2))) == len(resumed)


@pytest.mark.parametrize("kind", ["single", "mixture"])
def test_a_state_saved_before_elastic_resume_still_resumes(builds, known, kind):
    """A version 1 state (no start_row, no weights_since; a mixture's fingerprint of its weights) resumes exactly."""
    saved = make(builds, kind, batch_rows=2, seed=4)
    batches = iter(saved)
    head = [next(batches) for _ in range(3)]
    state = saved.state_dict()
    old = {key: value for key, value in state.items() if key != "start_row"}
    old["version"] = 1
    if kind == "mixture":
        old["fingerprint"] = "0123456789abcdef"
        old["mixture_schedule"] = {k: v for k, v in state["mixture_schedule"].items() if k != "weights_since"}
    resumed = make(builds, kind, batch_rows=2, seed=4)
    resumed.load_state_dict(old)
    resumed.set_epoch(0)
    expected = make(builds, kind, batch_rows=2, seed=4)
    assert [sequences(b, known) for b in head + list(resumed)] == [sequences(b, known) for b in expected]
