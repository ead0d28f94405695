"""Mixtures: the blending schedule's proportions at every prefix, and PackedMixture over real builds."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata import stateful_dataloader as stateful

from loaders import PackedIterableDataset, PackedMixture, load_mixture_file
from loaders.blend import BlendState, blend
from loaders.mixture import source_counts
from schemas import ManifestError
from tests.shard_factory import build_shard_dir

CAPACITY = 64
ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = {"flan": 0.5, "gsm8k": 0.3, "chat": 0.2}


# ---- the schedule ---------------------------------------------------------------------------


@st.composite
def schedules(draw):
    """Sources with weights and rows of random sizes (zero allowed, as a row without loss tokens)."""
    k = draw(st.integers(2, 6))
    weights = np.array(draw(st.lists(st.floats(0.02, 1.0), min_size=k, max_size=k)))
    largest = draw(st.integers(1, 100))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kinds = draw(st.lists(st.sampled_from(["rows", "uniform", "bimodal", "constant"]), min_size=k, max_size=k))
    rows = []
    for kind in kinds:
        if kind == "rows":
            sizes = np.ones(4000, dtype=np.int64)
        elif kind == "uniform":
            sizes = rng.integers(0, largest + 1, 4000)
        elif kind == "bimodal":
            sizes = np.where(rng.random(4000) < 0.5, 1, largest)
        else:
            sizes = np.full(4000, rng.integers(1, largest + 1))
        rows.append(sizes)
    weights = weights / weights.sum()
    # Units for the first 1-60 rows of every source, or fewer, so that no source runs out.
    rows_per_source, largest = draw(st.integers(1, 60)), max(int(r.max()) for r in rows)
    until = min(sum(int(r[:rows_per_source].sum()) for r in rows), *((r.sum() - 2 * largest) / w for r, w in zip(rows, weights)))
    return weights, rows, int(until)


def ahead_of_shares(picks, rows, weights):
    """After every pick ([picks, sources]): each source's units taken minus its share, and its last row's units."""
    taken = np.zeros((picks.size, weights.size), dtype=np.int64)
    for i, sizes in enumerate(rows):
        mine = picks == i
        taken[mine, i] = sizes[: int(mine.sum())]
    consumed = np.cumsum(taken, axis=0)
    ahead = consumed - consumed.sum(axis=1, keepdims=True) * weights
    last_pick = np.maximum.accumulate(np.where(picks[:, None] == np.arange(weights.size), np.arange(picks.size)[:, None], -1))
    last_row = np.where(last_pick >= 0, taken[np.maximum(last_pick, 0), np.arange(weights.size)], 0)
    return ahead, last_row


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_every_prefix_keeps_each_share_less_than_a_row_behind_and_its_own_last_row_ahead(schedule):
    weights, rows, until = schedule
    largest = max(int(r.max()) for r in rows)
    picks, taken, state = blend(rows, weights, BlendState.start(weights.size), until)
    assert state.total >= until and (picks.size == 0 or state.total - until < largest)
    assert np.array_equal(taken, np.bincount(picks, minlength=weights.size))
    ahead, last_row = ahead_of_shares(picks, rows, weights)
    assert -ahead.min(initial=0) < largest, "a source fell a whole row behind its share"
    # Ahead by at most (1 - w_i) of its last row: less than that row (and not at all before its first).
    assert (ahead <= (1 - weights) * last_row + 1e-9 * max(1, until)).all(), "a source ran its own row ahead"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.02, 1.0), min_size=2, max_size=6), st.integers(1, 300))
def test_rows_unit_gives_each_source_the_floor_or_ceiling_of_its_share_at_every_prefix(weights, until):
    weights = np.array(weights) / sum(weights)
    picks, _, _ = blend([np.ones(until, dtype=np.int64)] * weights.size, weights, BlendState.start(weights.size), until)
    counts = np.cumsum(picks[:, None] == np.arange(weights.size), axis=0)
    shares = np.arange(1, until + 1)[:, None] * weights
    assert np.all((counts >= np.floor(shares - 1e-9)) & (counts <= np.ceil(shares + 1e-9)))


@settings(max_examples=100, deadline=None)
@given(schedules(), st.integers(1, 40))
def test_a_schedule_continued_from_its_state_is_the_same_schedule(schedule, chunk):
    """Rows supplied a few at a time (as a source repeats) give the picks of one long call."""
    weights, rows, until = schedule
    whole, _, _ = blend(rows, weights, BlendState.start(weights.size), until)
    state, offsets, parts = BlendState.start(weights.size), np.zeros(weights.size, dtype=np.int64), []
    while state.total < until:
        picks, taken, state = blend([r[o : o + chunk] for r, o in zip(rows, offsets)], weights, state, until)
        parts.append(picks)
        offsets += taken
    assert np.array_equal(np.concatenate([whole[:0], *parts]), whole)


# ---- PackedMixture over real builds ---------------------------------------------------------


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Three builds of one tokenizer and capacity, of different sizes; no example is split."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    return {
        "flan": build_shard_dir(root / "flan", rng.integers(4, 60, 300), capacity=CAPACITY, rows_per_shard=20, seed=1),
        "gsm8k": build_shard_dir(root / "gsm8k", rng.integers(4, 30, 40), capacity=CAPACITY, rows_per_shard=5, seed=2),
        "chat": build_shard_dir(root / "chat", rng.integers(20, 64, 100), capacity=CAPACITY, rows_per_shard=16, seed=3),
    }


def mixture(builds, **options):
    settings = {"weights": WEIGHTS, "batch_rows": 2, "seed": 3, **options}
    return PackedMixture({name: build.path for name, build in builds.items()}, **settings)


def examples_by_source(builds):
    """Each example's tokens -> (source index, example id)."""
    found = {}
    for index, build in enumerate(builds.values()):
        for example in range(build.lengths.size):
            found[tuple(build.example(example)[0].tolist())] = (index, example)
    return found


def sequences(batch):
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"][0].tolist()
    return [tuple(ids[a:b]) for a, b in zip(cu, cu[1:])]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key


@pytest.mark.parametrize("unit", ["tokens", "loss_tokens"])
def test_every_prefix_of_batches_holds_the_weights_and_source_ids_name_each_sequence(builds, unit):
    data = mixture(builds, unit=unit)
    known = examples_by_source(builds)
    weights = np.array(list(WEIGHTS.values()))
    totals = np.zeros(3)
    for batch in data:
        assert batch["source_ids"].numel() == len(sequences(batch))
        for source, tokens in zip(batch["source_ids"].tolist(), sequences(batch)):
            assert known[tokens][0] == source
        counts = source_counts(batch, 3)
        assert counts["tokens"].sum() == batch["num_real_tokens"]
        assert counts["loss_tokens"].sum() == batch["num_loss_tokens"]
        totals += counts[unit]
        # A batch boundary is a prefix of the schedule: each share within a row of its target.
        assert np.abs(totals - weights * totals.sum()).max() < CAPACITY
    assert np.abs(totals / totals.sum() - weights).max() < 0.02


def test_rows_unit_counts_rows(builds):
    data = mixture(builds, unit="rows", batch_rows=1)
    rows = np.zeros(3)
    weights = np.array(list(WEIGHTS.values()))
    for batch in data:
        rows[int(batch["source_ids"][0])] += 1
        assert np.abs(rows - weights * rows.sum()).max() < 1


def test_each_source_is_read_epoch_after_epoch_every_example_once_per_epoch_reshuffled(builds):
    data = mixture(builds, batch_rows=1)
    plan = {p.name: p for p in data.plan()}
    assert plan["gsm8k"].epochs_per_mixture_epoch > 3 > 1 > plan["flan"].epochs_per_mixture_epoch
    known = examples_by_source(builds)
    read: list[list[int]] = [[], [], []]
    for epoch in range(3):
        data.set_epoch(epoch)
        for batch in data:
            for tokens, source in zip(sequences(batch), batch["source_ids"].tolist()):
                read[source].append(known[tokens][1])
    for source, (name, build) in enumerate(builds.items()):
        per_epoch = build.lengths.size
        assert len(read[source]) // per_epoch == int(data.source_epochs(2)[name])
        orders = [read[source][e * per_epoch : (e + 1) * per_epoch] for e in range(len(read[source]) // per_epoch)]
        for order in orders:
            assert sorted(order) == list(range(per_epoch)), f"{name}: an epoch must read every example once"
        assert orders[0] != orders[1], f"{name}: each epoch is reshuffled"


def test_max_epochs_caps_repetition(builds):
    with pytest.raises(ValueError, match=r"mixture epoch 0 needs more of source 'gsm8k' than its max_epochs=2"):
        mixture(builds, max_epochs={"gsm8k": 2})
    capped = mixture(builds, max_epochs={"gsm8k": 20})
    assert capped.plan()[1].max_epochs == 20
    with pytest.raises(ValueError, match="needs more of source 'gsm8k'"):
        capped.set_epoch(3)
        list(capped)


def test_ranks_and_workers_split_the_one_list_of_batches(builds):
    whole = list(mixture(builds))
    parts = [list(mixture(builds, rank=r, world_size=2)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole) // 2
    for rank, part in enumerate(parts):
        assert_same_batches(part, whole[rank::2][: len(part)])
    workers = list(stateful.StatefulDataLoader(mixture(builds), batch_size=None, num_workers=2))
    assert_same_batches(workers, whole)


def gsm8k_epoch_boundary(data):
    """The batch index in epoch 0 at which gsm8k's stream passes its first epoch."""
    rows = data._plan(0)
    gsm8k_rows = 0
    per_epoch = data.manifests()["gsm8k"].num_rows
    for j in range(len(rows)):
        sources = np.searchsorted(data._source_first_row, rows.batch_rows(j), side="right") - 1
        gsm8k_rows += int((sources == 1).sum())
        if gsm8k_rows >= per_epoch:
            return j
    raise AssertionError("gsm8k does not repeat in epoch 0")


def test_resume_mid_epoch_at_a_source_epoch_boundary_and_in_a_later_epoch(builds):
    expected = []
    reference = mixture(builds)
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append(list(reference))
    boundary = gsm8k_epoch_boundary(mixture(builds))
    for epoch, stop in ((0, 5), (0, boundary), (0, boundary + 1), (2, 3)):
        first = mixture(builds)
        first.set_epoch(epoch)
        iterator = iter(first)
        head = [next(iterator) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = mixture(builds)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)
        assert_same_batches(head + list(resumed), expected[epoch])
    # A state saved at the end of an epoch resumes at the next one.
    finished = mixture(builds)
    list(finished)
    resumed = mixture(builds)
    resumed.load_state_dict(finished.state_dict())
    assert_same_batches(list(resumed), expected[1])


def test_a_state_of_another_mixture_is_refused(builds):
    """Other builds, unit or a single build; other weights resume (tests/test_elastic.py)."""
    state = mixture(builds).state_dict()
    with pytest.raises(ValueError, match="mixture"):
        PackedMixture({"flan": builds["flan"].path, "chat": builds["chat"].path}, weights={"flan": 1, "chat": 1},
                      batch_rows=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="unit"):
        mixture(builds, unit="rows").load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        PackedIterableDataset(builds["flan"].path, batch_rows=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="mixture"):
        mixture(builds).load_state_dict(PackedIterableDataset(builds["flan"].path, batch_rows=2, seed=3).state_dict())


def test_a_state_of_the_same_mixture_with_its_sources_reordered_is_refused(builds):
    """Ties go to the earlier source, so the order of the sources is part of the schedule."""
    reordered = {name: builds[name].path for name in ("chat", "gsm8k", "flan")}

    def rows(data):
        return [sequences(batch) for batch in data]

    assert rows(mixture(builds, unit="rows")) != rows(PackedMixture(reordered, weights=WEIGHTS, unit="rows", batch_rows=2,
                                                                     seed=3))
    first = mixture(builds, unit="rows")
    iterator = iter(first)
    next(iterator)
    with pytest.raises(ValueError, match=r"sources \['flan', 'gsm8k', 'chat'\] -> \['chat', 'gsm8k', 'flan'\]") as raised:
        PackedMixture(reordered, weights=WEIGHTS, unit="rows", batch_rows=2, seed=3).load_state_dict(first.state_dict())
    assert "\n" not in str(raised.value)


def test_a_state_of_a_late_epoch_resumes_without_replaying_the_epochs_before_it(builds):
    """The state carries where its epoch's schedule starts; a forged epoch or schedule is refused at once."""
    late = mixture(builds)
    late.set_epoch(40)
    state = late.state_dict()
    expected = list(late)
    resumed = mixture(builds)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert sorted(resumed._epoch_starts) == [0, 1, 40, 41]  # epochs 1 to 39 were not blended again
    assert_same_batches(list(resumed), expected)
    started = time.perf_counter()
    total = state["mixture_schedule"]["total"]
    for edit, message in (
        ({"epoch": 10**9}, "mixture_schedule total"),
        ({"epoch": 10**30}, f"epoch {10**30} must be a non-negative integer below"),
        ({"mixture_schedule": None}, "mixture_schedule is missing"),
        ({"mixture_schedule": {**state["mixture_schedule"], "total": total + 1}},
         "mixture_schedule total"),
        ({"mixture_schedule": {**state["mixture_schedule"], "consumed": {"flan": 0, "gsm8k": 0, "chat": total}}},
         "mixture_schedule consumed"),
        ({"mixture_schedule": {**state["mixture_schedule"], "source_offsets": {"flan": 1, "gsm8k": 2, "chat": 3}}},
         "mixture_schedule source_epochs and source_offsets of 'flan' must hold the"),
        ({"mixture_schedule": {**state["mixture_schedule"], "source_offsets": {"flan": 10**6, "gsm8k": 0, "chat": 0}}},
         "mixture_schedule source_offsets must stand within 'flan'"),
        ({"mixture_schedule": {**state["mixture_schedule"], "source_epochs": {"flan": True, "gsm8k": 0, "chat": 0}}},
         "mixture_schedule source_epochs"),
    ):
        with pytest.raises(ValueError, match=message) as raised:
            mixture(builds).load_state_dict({**state, **edit})
        assert "\n" not in str(raised.value)
    assert time.perf_counter() - started < 1.5


def test_a_state_saved_as_json_with_sorted_keys_resumes_a_mixture_whose_names_are_not_sorted(builds, tmp_path):
    """save_loader_state writes sorted keys; the schedule is read by source name, in the order of ``sources``."""
    from loaders.train.checkpoint import load_loader_state, save_loader_state

    unsorted = {name: builds[name].path for name in ("gsm8k", "chat", "flan")}

    def make():
        return PackedMixture(unsorted, weights=WEIGHTS, batch_rows=2, seed=3)

    first = make()
    first.set_epoch(1)
    iterator = iter(first)
    head = [next(iterator) for _ in range(3)]
    save_loader_state(tmp_path, 0, first.state_dict())
    resumed = make()
    resumed.load_state_dict(load_loader_state(tmp_path, 0))
    expected = make()
    expected.set_epoch(1)
    assert_same_batches(head + list(resumed), list(expected))


def shifted_schedules(data, state):
    """The state's schedule with one source a row further on and another a row back: starts that are not real."""
    schedule = state["mixture_schedule"]
    for i, j in itertools.permutations(range(len(data.names)), 2):
        forged = copy.deepcopy(state)
        edit = forged["mixture_schedule"]
        for k, step in ((i, -1), (j, +1)):
            name, reader, units = data.names[k], data._readers[k], data._row_units[k]
            epoch, offset = schedule["source_epochs"][name], schedule["source_offsets"][name] + step
            if offset < 0:
                epoch, offset = epoch - 1, reader.manifest.num_rows - 1
            if offset >= reader.manifest.num_rows:
                epoch, offset = epoch + 1, 0
            edit["source_epochs"][name], edit["source_offsets"][name] = epoch, offset
            edit["consumed"][name] = epoch * int(units.sum()) + int(units[reader.epoch_rows(epoch)[:offset]].sum())
        edit["total"] = sum(edit["consumed"].values())
        yield forged


def test_a_refused_state_leaves_the_mixture_as_it_was(builds):
    reference = mixture(builds)
    reference.set_epoch(2)
    state = json.loads(json.dumps(reference.state_dict()))
    expected = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append(list(reference))
    # A start the schedule's checks accept (see docs/mixtures.md), with a next batch outside the epoch.
    accepted = []
    for forged in shifted_schedules(mixture(builds), state):
        try:
            mixture(builds).load_state_dict(forged)
        except ValueError:
            continue
        accepted.append(forged)
    assert accepted, "no shifted start passes the checks; the test cannot show a refused state's effect"
    data = mixture(builds)
    with pytest.raises(ValueError, match="next_batch"):
        data.load_state_dict({**accepted[0], "next_batch": 10**6})
    for epoch in range(3):
        data.set_epoch(epoch)
        assert_same_batches(list(data), expected[epoch])


@pytest.mark.parametrize("unit", ["rows", "tokens"])
def test_the_rows_trained_keep_their_shares_across_epochs_and_each_stream_is_read_without_a_gap(builds, unit):
    """Rows an epoch's batches leave over are the next epoch's first: every prefix of the batches trained (batch j
    of rank 0, 1, 2, then j + 1) keeps each source within a row of its share, epoch after epoch."""
    world = 3
    ranks = [mixture(builds, unit=unit, batch_rows=7, rank=r, world_size=world) for r in range(world)]
    units = np.concatenate(ranks[0]._row_units)
    largest, weights = int(units.max()), ranks[0].weights
    trained = []
    for epoch in range(30):
        plans = [data._plan(epoch) for data in ranks]
        trained += [plan.batch_rows(j) for j in range(len(plans[0])) for plan in plans]
    rows = np.concatenate(trained)
    sources = ranks[0]._row_place[rows, 0]
    taken = np.cumsum(np.where(sources[:, None] == np.arange(3), units[rows, None], 0), axis=0)
    behind = weights * taken.sum(axis=1, keepdims=True) - taken
    assert behind.max() < largest and -behind.min() < largest
    # Each source's stream is trained in order, build epoch after build epoch, every example once in each.
    for source, data in enumerate(ranks[0]._readers):
        read = rows[sources == source] - ranks[0]._source_first_row[source]
        per_epoch = data.manifest.num_rows
        stream = np.concatenate([data.epoch_rows(e) for e in range(read.size // per_epoch + 1)])
        assert np.array_equal(read, stream[: read.size])


def test_a_build_and_a_mixture_take_one_set_of_options(builds):
    """One LoaderOptions for both; keyword arguments replace its fields; an unknown or per-build option is named."""
    from loaders.dataset import LoaderOptions

    options = LoaderOptions(batch_rows=2, seed=3, shuffle_buffer_rows=12)
    paths = {name: build.path for name, build in builds.items()}
    assert_same_batches(list(PackedMixture(paths, weights=WEIGHTS, options=options)),
                        list(mixture(builds, shuffle_buffer_rows=12)))
    single = PackedIterableDataset(builds["flan"].path, options=options, batch_rows=4)
    assert (single.batch_rows, single.seed, single.shuffle_buffer_rows) == (4, 3, 12)
    with pytest.raises(TypeError, match="unknown loader option 'batch_size'"):
        PackedIterableDataset(builds["flan"].path, batch_size=2)
    with pytest.raises(TypeError, match="example_weights is per build, so a mixture does not take it"):
        PackedMixture(paths, weights=WEIGHTS, example_weights=np.ones(3))
    with pytest.raises(ValueError, match="give batch_rows or tokens_per_batch, not both"):
        LoaderOptions(batch_rows=2, tokens_per_batch=4 * CAPACITY)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_each_shard_is_opened_once_to_start_and_read_an_epoch(builds, monkeypatch, reduction):
    """The row index, the sequence loss's example targets and the batches read the shards opened once, for a
    single build and a mixture of three."""
    from loaders import dataset as dataset_module

    opened: list[str] = []
    real_open = dataset_module.open_build_shard
    monkeypatch.setattr(dataset_module, "open_build_shard",
                        lambda path, *args, **kwargs: opened.append(str(path)) or real_open(path, *args, **kwargs))
    shards = sorted(str(p) for p in builds["flan"].path.glob("shard-*.arrow"))
    for batch in PackedIterableDataset(builds["flan"].path, batch_rows=2, loss_reduction=reduction):
        assert batch["num_loss_tokens"] > 0
    assert sorted(opened) == shards
    opened.clear()
    for batch in mixture(builds, loss_reduction=reduction):
        assert batch["num_loss_tokens"] > 0
    assert sorted(opened) == sorted(str(p) for build in builds.values() for p in build.path.glob("shard-*.arrow"))


def test_fixed_shapes_and_sequence_loss_weights(builds):
    for buckets in (False, True):
        data = mixture(builds, pad_to_fixed_shape=True, bucket_shapes=buckets, loss_reduction="sequence")
        for batch, plain in zip(data, mixture(builds)):
            assert batch["input_ids"].shape == (1, 2 * CAPACITY)
            assert torch.equal(batch["source_ids"], plain["source_ids"])
            # No example is split, so every example with targets weighs 1 in all.
            lengths = np.diff(plain["cu_seq_lens_q"].numpy())
            trained = [int((plain["labels"][0, a : a + n] != -100).sum()) for a, n in
                       zip(plain["cu_seq_lens_q"][:-1].tolist(), lengths.tolist())]
            assert batch["loss_weight_sum"] == pytest.approx(sum(t > 0 for t in trained), rel=1e-5)


def test_sequence_loss_sizes_its_tables_by_the_example_ids_present_not_the_largest(tmp_path):
    """One row whose example id is 2**45 (the manifest's num_examples says so; nothing is forged): the loader keeps
    a table of the ids present, so it neither allocates per id nor fails."""
    from pipeline.write.shard_writer import ShardWriter
    from schemas import BuildInputs, DatasetInputs, TokenizerInputs

    top = 1 << 45
    paths = {}
    for name, example in (("big", top), ("small", 3)):
        inputs = BuildInputs(
            dataset=DatasetInputs(id=name, split="train", content_hash="h", num_examples=example + 1),
            tokenizer=TokenizerInputs(name="t", content_hash="t", vocab_size=100), template="none",
            loss_masking="given", max_len=8, overflow="split", packing="best_fit_decreasing", seed=0,
            package_version="0.1.0")
        with ShardWriter(tmp_path / name, inputs) as writer:
            writer.write_row([5, 6, 7, 8], loss_mask=[0, 1, 1, 1], example_ids=[example])
        paths[name] = tmp_path / name
    alone = PackedIterableDataset(paths["big"], loss_reduction="sequence")
    assert alone.loss_weighting.example_ids.tolist() == [top]
    for batch in (*alone, *PackedMixture(paths, weights={"big": 1, "small": 1}, loss_reduction="sequence")):
        weights = batch["loss_weights"][0]
        assert weights[batch["labels"][0] != -100].tolist() == pytest.approx([1 / 3] * 3)
        assert batch["loss_weight_sum"] == pytest.approx(1.0)


def test_incompatible_builds_and_bad_mixtures_are_one_line_errors(builds, tmp_path):
    paths = {name: build.path for name, build in builds.items()}
    other_tokenizer = build_shard_dir(tmp_path / "other", [10, 20, 30], capacity=CAPACITY, vocab_size=500)
    other_capacity = build_shard_dir(tmp_path / "wide", [10, 20, 30], capacity=2 * CAPACITY)
    cases = [
        ({**paths, "x": other_tokenizer.path}, {**WEIGHTS, "x": 1}, ManifestError,
         rf"'flan' \({paths['flan']}\) and 'x' \({other_tokenizer.path}\) were tokenized differently"),
        ({**paths, "x": other_capacity.path}, {**WEIGHTS, "x": 1}, ManifestError, "rows of 64 and 128 tokens"),
        (paths, {**WEIGHTS, "code": 1}, ValueError, "weights name 'code', which is not a source"),
        (paths, {"flan": 1, "gsm8k": 1}, ValueError, "source 'chat' has no weight"),
        (paths, {**WEIGHTS, "chat": 0}, ValueError, "source 'chat' has weight 0; weights must be positive"),
        (paths, {**WEIGHTS, "chat": -1.0}, ValueError, "weight -1.0"),
        ({**paths, "chat": tmp_path / "missing"}, WEIGHTS, ManifestError, "missing"),
    ]
    for sources, weights, error, message in cases:
        with pytest.raises(error, match=message) as raised:
            PackedMixture(sources, weights=weights, batch_rows=2)
        assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="unit must be one of tokens, loss_tokens, rows"):
        PackedMixture(paths, weights=WEIGHTS, unit="bytes")
    with pytest.raises(ValueError, match="max_epochs names 'code'"):
        PackedMixture(paths, weights=WEIGHTS, max_epochs={"code": 2})


def test_a_source_that_is_no_build_is_named_with_the_mixture_file(builds, tmp_path, capsys):
    from pipeline import cli

    path = tmp_path / "mixture.json"
    path.write_text(json.dumps({"sources": {"flan": str(builds["flan"].path), "root": "/"}, "weights": {"flan": 1, "root": 1}}))
    with pytest.raises(ManifestError, match=r"^mixture source 'root': /manifest.json: no manifest"):
        PackedMixture(**load_mixture_file(path))
    assert cli.main(["inspect", "--steps", "3", str(path)]) == 1
    assert capsys.readouterr().err.startswith(f"varpack inspect: error: {path}: mixture source 'root': /manifest.json: "
                                              "no manifest")


def test_mixture_file(builds, tmp_path):
    spec = {"sources": {name: str(build.path) for name, build in builds.items()}, "weights": WEIGHTS,
            "unit": "loss_tokens", "max_epochs": {"gsm8k": 50}}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    data = PackedMixture(**load_mixture_file(path), batch_rows=2, seed=3)
    assert data.unit == "loss_tokens" and data.plan()[1].max_epochs == 50
    assert_same_batches(list(data), list(mixture(builds, unit="loss_tokens", max_epochs={"gsm8k": 50})))
    for text, message in (("{", "not a JSON mixture file"), ('{"sources": {}}', "'sources' must be a non-empty"),
                          ('{"sources": {"a": "x"}, "weights": {"a": 1}, "seed": 1}', "unknown key 'seed'")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_mixture_file(path)


SOURCES = '"sources": {"flan": "flan", "gsm8k": "gsm8k"}'
EQUAL = '"weights": {"flan": 1, "gsm8k": 1}'
BAD_MIXTURE_FILES = {  # the file's text, and what the error says after the file's name
    "weights-whose-sum-overflows": ('{%s, "weights": {"flan": 1e308, "gsm8k": 1e308}, "unit": "rows"}' % SOURCES, None),
    "integer-weight-of-1e38": ('{%s, "weights": {"flan": %d, "gsm8k": 1}}' % (SOURCES, 10**38), None),
    "integer-weight-past-floats": ('{%s, "weights": {"flan": %d, "gsm8k": 1}}' % (SOURCES, 10**400),
                                   "source 'flan' has weight 1000"),
    "build-path-not-a-string": ('{"sources": {"flan": 5, "gsm8k": "gsm8k"}, %s}' % EQUAL,
                                "sources['flan'] must be a build directory"),
    "max-epochs-a-list": ('{%s, %s, "max_epochs": [1]}' % (SOURCES, EQUAL), "max_epochs must be {source name"),
    "max-epochs-a-number": ('{%s, %s, "max_epochs": 3}' % (SOURCES, EQUAL), "max_epochs must be {source name"),
    "max-epochs-of-1e23": ('{%s, %s, "max_epochs": {"gsm8k": %d}}' % (SOURCES, EQUAL, 10**23),
                           "max_epochs['gsm8k'] must be at most 2**53"),
    "nan-weight": ('{%s, "weights": {"flan": NaN, "gsm8k": 1}}' % SOURCES, "source 'flan' has weight nan"),
    "infinite-weight": ('{%s, "weights": {"flan": 1, "gsm8k": Infinity}}' % SOURCES, "source 'gsm8k' has weight inf"),
    "negative-weight": ('{%s, "weights": {"flan": -0.5, "gsm8k": 1}}' % SOURCES, "source 'flan' has weight -0.5"),
    "boolean-weight": ('{%s, "weights": {"flan": true, "gsm8k": 1}}' % SOURCES, "source 'flan' has weight True"),
    "weight-too-small-for-a-share": ('{%s, "weights": {"flan": 5e-324, "gsm8k": 1e308}}' % SOURCES,
                                     "source 'flan' has weight 5e-324, too small"),
    "weights-not-an-object": ('{%s, "weights": [1, 1]}' % SOURCES, "'weights' must be a non-empty object"),
    "no-sources": ('{"sources": {}, %s}' % EQUAL, "'sources' must be a non-empty object"),
    "a-source-named-twice": ('{"sources": {"flan": "flan", "flan": "gsm8k"}, "weights": {"flan": 1}}',
                             "'flan' is given twice in one object"),
    "a-weight-named-twice": ('{%s, "weights": {"flan": 1, "gsm8k": 1, "gsm8k": 9}}' % SOURCES,
                             "'gsm8k' is given twice"),
    "empty-build-path": ('{"sources": {"flan": "flan", "gsm8k": ""}, %s}' % EQUAL, "sources['gsm8k'] must be"),
    "nul-in-build-path": ('{"sources": {"flan": "fl\\u0000an", "gsm8k": "gsm8k"}, %s}' % EQUAL,
                          "sources['flan'] must be"),
    "boolean-max-epochs": ('{%s, %s, "max_epochs": {"flan": true}}' % (SOURCES, EQUAL),
                           "max_epochs['flan'] must be a positive integer, got True"),
    "unit-not-a-string": ('{%s, %s, "unit": 5}' % (SOURCES, EQUAL), "unit must be one of"),
    "nested-too-deeply": ("[" * 100_000 + "]" * 100_000, "not a JSON mixture file"),
    "url-of-an-unknown-protocol": ('{"sources": {"flan": "flan", "gsm8k": "nosuch://x/build"}, %s}' % EQUAL,
                                   "sources['gsm8k'] is nosuch://x/build: no installed filesystem opens nosuch:// URLs"),
    **({"http-url-without-aiohttp": ('{"sources": {"flan": "flan", "gsm8k": "http://127.0.0.1:9/b"}, %s}' % EQUAL,
                                     "sources['gsm8k'] is http://127.0.0.1:9/b: opening http:// URLs needs a package "
                                     "that is not installed")}
       if importlib.util.find_spec("aiohttp") is None else {}),
}


AUDITED = {"weights-whose-sum-overflows", "integer-weight-of-1e38", "build-path-not-a-string", "max-epochs-a-list",
           "max-epochs-a-number", "max-epochs-of-1e23", "http-url-without-aiohttp"}  # run as a subprocess too: the
# tracebacks an audit found


@pytest.mark.parametrize("case", BAD_MIXTURE_FILES)
def test_bad_mixture_files_are_one_line_errors(builds, tmp_path, case, capsys):
    """A mixture file that is not one is a one-line error naming the file and the field, from the Python API,
    ``varpack inspect`` and ``train.py --mixture``; weights that overflow a float sum, or integers as weights,
    are read as the shares they stand for."""
    from pipeline import cli

    for name in ("flan", "gsm8k"):
        (tmp_path / name).symlink_to(builds[name].path)
    text, message = BAD_MIXTURE_FILES[case]
    path = tmp_path / "mixture.json"
    path.write_text(text)
    inspect = ["inspect", str(path), "--steps", "3"]
    if case in AUDITED:
        run = subprocess.run([sys.executable, "-m", "pipeline.cli", *inspect], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        returncode, stderr = run.returncode, run.stderr
    else:
        returncode, stderr = cli.main(inspect), capsys.readouterr().err
    if message is None:  # read as the shares it stands for
        assert returncode == 0, stderr
        data = PackedMixture(**load_mixture_file(path), batch_rows=2)
        assert np.all(data.weights > 0) and data.weights.sum() == pytest.approx(1)
        return
    pattern = re.escape(f"{path}: {message}")
    with pytest.raises(ValueError, match=pattern) as raised:
        PackedMixture(**load_mixture_file(path), batch_rows=2)
    assert "\n" not in str(raised.value)
    assert returncode == 1 and re.fullmatch(rf"varpack inspect: error: {pattern}.*\n", stderr), stderr
    from tests.test_train import MODEL, load_script

    with pytest.raises(SystemExit, match=rf"train.py: error: {pattern}"):
        load_script().main(["--mixture", str(path), "--random-init", MODEL, "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_train_script_on_a_mixture_logs_tokens_per_source_and_resumes_exactly(tmp_path, trainer, capsys):
    if trainer == "hf":
        pytest.importorskip("accelerate")
    from tests.test_train import MODEL, load_script, losses

    rng = np.random.default_rng(5)
    for name, seed in (("math", 1), ("chat", 2)):
        build_shard_dir(tmp_path / name, rng.integers(8, 120, 60), capacity=256, vocab_size=128, seed=seed)
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": {"math": "math", "chat": "chat"}, "weights": {"math": 3, "chat": 1}}))
    common = ["--mixture", str(spec), "--random-init", MODEL, "--trainer", trainer, "--attn", "sdpa", "--precision",
              "fp32", "--lr", "1e-2", "--batch-rows", "2", "--log-every", "1"]
    main = load_script().main
    main([*common, "--out", str(tmp_path / "straight"), "--max-steps", "4"])
    plan = next(json.loads(line) for line in capsys.readouterr().out.splitlines() if "mixture_plan" in line)
    assert [(p["name"], p["weight"]) for p in plan["mixture_plan"]] == [("math", 0.75), ("chat", 0.25)]
    main([*common, "--out", str(tmp_path / "resumed"), "--max-steps", "2", "--save-every", "2"])
    main([*common, "--out", str(tmp_path / "resumed"), "--max-steps", "4", "--save-every", "2", "--resume"])
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step
    if trainer == "plain":
        records = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
        tokens = np.array([[r["source_tokens"][n]["tokens"] for n in ("math", "chat")] for r in records]).sum(axis=0)
        assert abs(tokens[0] / tokens.sum() - 0.75) <= 256 / tokens.sum()


# ---- the training loss of each source ---------------------------------------------------------


def examples_alone(model, batches, num_sources):
    """Each source's summed token loss and loss tokens, every sequence of ``batches`` run on its own."""
    import torch.nn.functional as F

    summed, tokens = np.zeros(num_sources), np.zeros(num_sources)
    with torch.no_grad():
        for batch in batches:
            cu = batch["cu_seq_lens_q"].tolist()
            for source, start, end in zip(batch["source_ids"].tolist(), cu, cu[1:]):
                labels = batch["labels"][0, start + 1 : end]
                logits = model(input_ids=batch["input_ids"][:, start:end]).logits[0, :-1]
                summed[source] += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
                tokens[source] += int((labels != -100).sum())
    return summed, tokens


@pytest.mark.parametrize("options", [{}, {"pad_to_fixed_shape": True, "loss_reduction": "sequence"}],
                         ids=["packed", "fixed-shape-sequence-weights"])
def test_each_sources_training_loss_equals_its_examples_alone_and_leaves_the_gradients_alone(builds, options):
    """The per-sequence losses of a training forward, summed by source on the device, give each source's mean
    token loss, from the loss-position head and from a model's own logits; the loss and every gradient are
    bit for bit those of the same forward without them."""
    pytest.importorskip("transformers")
    import tiny_model

    from loaders.loss_weights import LOSS_WEIGHT_SUM, LOSS_WEIGHTS
    from loaders.train.loss_head import PADDED_LOSS_ROWS, SEQUENCE_LOSSES, use_loss_position_head
    from loaders.train.models import model_inputs
    from loaders.train.source_loss import SourceLosses

    data = mixture(builds, **options)
    batches = list(itertools.islice(data, 6))
    full = tiny_model.tiny_llama(1000, 2 * CAPACITY)
    head = use_loss_position_head(copy.deepcopy(full))
    by_head, by_logits = SourceLosses(data.names, "cpu"), SourceLosses(data.names, "cpu")

    def step(model, inputs):
        model.zero_grad(set_to_none=True)
        outputs = model(**inputs)
        outputs.loss.backward()
        return outputs, [p.grad.clone() for p in model.parameters()]

    for batch in batches:
        inputs = model_inputs(batch, torch.device("cpu"), full_logits=False)
        plain, plain_grads = step(head, inputs)
        counted, counted_grads = step(head, {**inputs, SEQUENCE_LOSSES: True})
        assert plain.sequence_losses is None and counted.sequence_losses.shape == (2, batch["cu_seq_lens_q"].numel() - 1)
        assert torch.equal(counted.loss, plain.loss)
        assert all(torch.equal(a, b) for a, b in zip(counted_grads, plain_grads))
        # Labelled positions padded to a fixed count (CUDA graphs): the padding counts for no sequence.
        padded = head(**inputs, **{SEQUENCE_LOSSES: True, PADDED_LOSS_ROWS: batch["num_loss_tokens"] + 37})
        torch.testing.assert_close(padded.sequence_losses, counted.sequence_losses)
        by_head.add_outputs(counted, batch)
        with torch.no_grad():
            logits_only = {k: v for k, v in model_inputs(batch, torch.device("cpu"), full_logits=True).items()
                           if k not in ("labels", LOSS_WEIGHTS, LOSS_WEIGHT_SUM)}
            by_logits.add_outputs(full(**logits_only), batch)

    summed, tokens = examples_alone(full, batches, len(data.names))
    assert (tokens > 0).all()
    want = dict(zip(data.names, summed / tokens))
    assert by_head.pop() == pytest.approx(want, rel=1e-5)
    assert by_logits.pop() == pytest.approx(want, rel=1e-5)
    assert by_head.pop() == dict.fromkeys(data.names), "pop starts again"


def test_train_script_reports_each_sources_loss_in_both_loops(tmp_path):
    """``source_loss`` in train.py's log lines: with one step a line, the sources' losses weighted by their
    loss tokens give the step's loss; the head, the model's own logits and PackedTrainer agree."""
    pytest.importorskip("accelerate")
    from tests.test_train import MODEL, load_script

    rng = np.random.default_rng(6)
    for name, seed in (("math", 1), ("chat", 2), ("code", 3)):
        build_shard_dir(tmp_path / name, rng.integers(8, 120, 40), capacity=256, vocab_size=128, seed=seed)
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": {n: n for n in ("math", "chat", "code")},
                                "weights": {"math": 3, "chat": 2, "code": 1}}))
    common = ["--mixture", str(spec), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32", "--lr", "1e-2",
              "--batch-rows", "2", "--log-every", "1", "--max-steps", "3"]
    main = load_script().main
    runs = {"plain": [], "full-logits": ["--full-logits"], "hf": ["--trainer", "hf"]}
    logs = {}
    for run, extra in runs.items():
        main([*common, *extra, "--out", str(tmp_path / run)])
        logs[run] = [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
    for record in logs["plain"]:
        losses, counts = record["source_loss"], record["source_tokens"]
        trained = [n for n in losses if counts[n]["loss_tokens"]]
        assert [n for n in losses if losses[n] is not None] == trained, "a source without loss tokens has no loss"
        pooled = sum(losses[n] * counts[n]["loss_tokens"] for n in trained) / sum(counts[n]["loss_tokens"] for n in trained)
        assert pooled == pytest.approx(record["loss"], rel=1e-5)
    def measured(record):
        return {name: loss for name, loss in record["source_loss"].items() if loss is not None}

    for run in ("full-logits", "hf"):
        for record, want in zip(logs[run], logs["plain"], strict=True):
            assert measured(record) == pytest.approx(measured(want), rel=1e-5), (run, record["step"])


def test_evaluate_script_reports_the_loss_of_each_source(tmp_path, capsys):
    pytest.importorskip("transformers")
    import importlib.util

    import tiny_model

    from loaders.train.evaluate import evaluate_packed

    # Loaded by path: a package named `evaluate` (Hugging Face's) may be installed.
    spec = importlib.util.spec_from_file_location("evaluate_script", Path(__file__).parents[1] / "scripts" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(4)
    builds = {name: build_shard_dir(tmp_path / name, rng.integers(4, 40, 20), capacity=CAPACITY, seed=seed)
              for name, seed in (("math", 1), ("chat", 2))}
    model = tiny_model.tiny_llama(1000, 2 * CAPACITY)
    model.save_pretrained(tmp_path / "model")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": {"math": "math", "chat": "chat"}, "weights": {"math": 1, "chat": 1}}))
    out = tmp_path / "eval.jsonl"
    summary = script.main(["--model", str(tmp_path / "model"), "--mixture", str(mix), "--out", str(out),
                           "--attn", "sdpa", "--batch-rows", "4"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    records = [json.loads(line) for line in out.read_text().splitlines()]
    targets = 0
    for name, build in builds.items():
        alone = evaluate_packed(model, build.path, batch_rows=4).summary
        assert summary["sources"][name]["mean_token_loss"] == pytest.approx(alone["mean_token_loss"], rel=1e-6)
        assert [r["example_id"] for r in records if r["source"] == name] == list(range(build.lengths.size))
        targets += alone["target_tokens"]
    assert summary["target_tokens"] == targets
    pooled = sum(s["mean_token_loss"] * s["target_tokens"] for s in summary["sources"].values()) / targets
    assert summary["mean_token_loss"] == pytest.approx(pooled, rel=1e-9)

    # PackedTrainer.evaluate on the mixture: the same pooled and per-source losses.
    pytest.importorskip("accelerate")
    import transformers

    from loaders.train.hf_trainer import PackedTrainer

    data = PackedMixture({name: build.path for name, build in builds.items()}, weights={"math": 1, "chat": 1},
                         batch_rows=4)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    metrics = PackedTrainer(model=model, args=args, train_dataset=data).evaluate(data)
    assert metrics["eval_loss"] == pytest.approx(summary["mean_token_loss"], rel=1e-6)
    for name in builds:
        assert metrics[f"eval_{name}_loss"] == pytest.approx(summary["sources"][name]["mean_token_loss"], rel=1e-6)


def test_plan_command_prints_each_source_and_its_realised_share(builds, tmp_path, capsys):
    """``python -m loaders.mixture FILE`` and ``varpack inspect FILE`` print the plan of a mixture file."""
    from loaders.mixture import main
    from pipeline import cli

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {n: str(b.path) for n, b in builds.items()}, "weights": WEIGHTS}))
    assert main([str(path), "--steps", "60", "--batch-rows", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in records] == list(WEIGHTS)
    for record in records:
        assert record["tokens"] == builds[record["name"]].lengths.sum()
        assert abs(record["share_first_60_steps"] - WEIGHTS[record["name"]]) < 0.05
    assert cli.main(["inspect", str(path), "--steps", "60", "--batch-rows", "2"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == records
    path.write_text(json.dumps({"sources": {"a": str(builds["flan"].path)}, "weights": {"a": -1}}))
    assert main([str(path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert cli.main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err.startswith("varpack inspect: error: ")


def test_plot_draws_the_realised_shares_as_a_png(builds, tmp_path, capsys):
    """``varpack inspect MIXTURE.json --plot FILE.png`` writes a PNG of the shares over the first steps."""
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from loaders.mixture import main, units_per_step
    from pipeline import cli

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {n: str(b.path) for n, b in builds.items()}, "weights": WEIGHTS}))
    figure = tmp_path / "shares.png"
    assert cli.main(["inspect", str(path), "--steps", "40", "--batch-rows", "2", "--plot", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(figure).shape
    assert width > 600 and height > 300
    assert capsys.readouterr().err.strip() == f"varpack inspect: wrote {figure}"
    # The curves are drawn from each batch's tokens per source.
    data = mixture(builds)
    counted = [source_counts(batch, 3)["tokens"] for batch in itertools.islice(data, 40)]
    np.testing.assert_array_equal(units_per_step(data, 40), counted)
    assert main([str(path), "--plot", str(tmp_path / "missing" / "shares.png")]) == 1
    assert capsys.readouterr().err.count("\n") == 1
