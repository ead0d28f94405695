"""The bin-packing core: every token placed once, rows within capacity, honest statistics."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.packing.algorithms import PACKERS, PackingPlan, best_fit_decreasing, first_fit_decreasing, pack, sequential
from pipeline.read.synthetic import SHAPES
from schemas import Overflow, PackingAlgorithm, PackingError

ALGORITHMS = sorted(PACKERS)
FAST = settings(max_examples=60, deadline=None)

capacities = st.integers(min_value=1, max_value=64)
seeds = st.integers(min_value=0, max_value=2**32 - 1)
algorithms = st.sampled_from(ALGORITHMS)
lossy_or_split = st.sampled_from(["split", "truncate", "drop"])


@st.composite
def lengths_and_capacity(draw: st.DrawFn, max_examples: int = 60) -> tuple[list[int], int]:
    """Example lengths from 1 to three times a drawn capacity, so some overflow."""
    capacity = draw(capacities)
    lengths = draw(st.lists(st.integers(min_value=1, max_value=3 * capacity), max_size=max_examples))
    return lengths, capacity


def flan_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths of the pipeline's FLAN shape (lognormal(5.3, 0.9) in [16, 4096]) from ``seed``."""
    return SHAPES["synthetic-flan"].lengths(np.random.default_rng(seed), n)


def segments_by_example(plan: PackingPlan) -> dict[int, list[tuple[int, int]]]:
    """Each example's (offset, length) segments as the plan places them, sorted by offset."""
    found: dict[int, list[tuple[int, int]]] = defaultdict(list)
    segments = zip(plan.segment_example.tolist(), plan.segment_offset.tolist(), plan.segment_length.tolist())
    for example, offset, length in segments:
        found[example].append((offset, length))
    return {example: sorted(parts) for example, parts in found.items()}


def assert_well_formed(plan: PackingPlan, capacity: int) -> None:
    """Rows partition the segments, none is empty, none exceeds capacity, and segments within a row go by example."""
    assert plan.row_offsets[0] == 0 and plan.row_offsets[-1] == plan.segment_length.size
    assert np.all(np.diff(plan.row_offsets) >= 1)
    assert np.all(plan.segment_length >= 1)
    assert np.all(plan.row_lengths() <= capacity)
    for start, stop in zip(plan.row_offsets[:-1].tolist(), plan.row_offsets[1:].tolist()):
        keys = list(zip(plan.segment_example[start:stop].tolist(), plan.segment_offset[start:stop].tolist()))
        assert keys == sorted(keys)
    for name in ("segment_example", "segment_offset", "segment_length", "row_offsets"):
        assert getattr(plan, name).dtype == np.int64


def loads_of(bin_of_item: np.ndarray, sizes: list[int] | np.ndarray) -> np.ndarray:
    """Tokens in each bin, by bin number."""
    return np.bincount(bin_of_item, weights=np.asarray(sizes, dtype=np.float64)).astype(np.int64)


def reference_best_fit_decreasing(sizes: list[int], capacity: int) -> list[int]:
    """Per-item best-fit decreasing, the obvious way: the loads of the bins it opens."""
    rooms: list[int] = []
    for size in sorted(sizes, reverse=True):
        fitting = [b for b, room in enumerate(rooms) if room >= size]
        if fitting:
            best = min(fitting, key=lambda b: rooms[b])
            rooms[best] -= size
        else:
            rooms.append(capacity - size)
    return [capacity - room for room in rooms]


def reference_first_fit_decreasing(sizes: list[int], capacity: int) -> list[int]:
    """Per-item first-fit decreasing, the obvious way: the loads of its bins in opening order."""
    rooms: list[int] = []
    for size in sorted(sizes, reverse=True):
        first = next((b for b, room in enumerate(rooms) if room >= size), None)
        if first is None:
            rooms.append(capacity - size)
        else:
            rooms[first] -= size
    return [capacity - room for room in rooms]


# Every token placed once, rows within capacity.


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, seed=seeds)
def test_split_places_every_token_exactly_once(case: tuple[list[int], int], algorithm: str, seed: int) -> None:
    lengths, capacity = case
    plan = pack(lengths, capacity, overflow="split", algorithm=algorithm, seed=seed)
    assert_well_formed(plan, capacity)
    placed = segments_by_example(plan)
    assert sorted(placed) == list(range(len(lengths)))
    for example, parts in placed.items():
        position = 0
        for offset, length in parts:
            assert offset == position, f"example {example}: gap or overlap at token {position}"
            assert length <= capacity
            position += length
        assert position == lengths[example]


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, seed=seeds)
def test_split_cuts_only_examples_longer_than_capacity(case: tuple[list[int], int], algorithm: str, seed: int) -> None:
    lengths, capacity = case
    plan = pack(lengths, capacity, algorithm=algorithm, seed=seed)
    for example, parts in segments_by_example(plan).items():
        expected = -(-lengths[example] // capacity)
        assert len(parts) == expected
        assert all(length == capacity for _, length in parts[:-1])


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, overflow=lossy_or_split, seed=seeds)
def test_same_seed_gives_the_same_plan(case: tuple[list[int], int], algorithm: str, overflow: str, seed: int) -> None:
    lengths, capacity = case
    first = pack(lengths, capacity, overflow, algorithm, seed)
    second = pack(np.array(lengths, dtype=np.int32), capacity, overflow, algorithm, seed)
    for name in ("segment_example", "segment_offset", "segment_length", "row_offsets"):
        assert np.array_equal(getattr(first, name), getattr(second, name))
    assert first.stats == second.stats


def test_seed_changes_the_row_order_but_not_the_loads() -> None:
    lengths = flan_lengths(5_000)
    plans = [pack(lengths, 4096, seed=seed) for seed in (0, 1)]
    assert not np.array_equal(plans[0].row_lengths(), plans[1].row_lengths())
    assert np.array_equal(np.sort(plans[0].row_lengths()), np.sort(plans[1].row_lengths()))


# Statistics add up.


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, overflow=lossy_or_split, seed=seeds)
def test_statistics_add_up(case: tuple[list[int], int], algorithm: str, overflow: str, seed: int) -> None:
    lengths, capacity = case
    plan = pack(lengths, capacity, overflow, algorithm, seed)
    stats = plan.stats
    long = [n for n in lengths if n > capacity]
    assert stats.examples == len(lengths)
    assert stats.tokens + stats.tokens_truncated + stats.tokens_dropped == sum(lengths)
    assert stats.tokens == int(plan.segment_length.sum()) == int(plan.row_lengths().sum())
    assert stats.segments == plan.segment_length.size
    assert stats.rows == plan.num_rows
    assert stats.capacity_tokens == plan.num_rows * capacity
    assert stats.fill == (stats.tokens / stats.capacity_tokens if plan.num_rows else 0.0)
    assert 0.0 <= stats.fill <= 1.0
    histogram = {int(k): v for k, v in stats.segments_per_row.items()}
    assert sum(histogram.values()) == stats.rows
    assert sum(k * v for k, v in histogram.items()) == stats.segments
    segments_in_row = np.diff(plan.row_offsets).tolist()
    assert histogram == {k: segments_in_row.count(k) for k in set(segments_in_row)}
    if overflow == "split":
        assert (stats.examples_split, stats.tokens_split) == (len(long), sum(long))
    if overflow == "truncate":
        assert (stats.examples_truncated, stats.tokens_truncated) == (len(long), sum(n - capacity for n in long))
    if overflow == "drop":
        assert (stats.examples_dropped, stats.tokens_dropped) == (len(long), sum(long))
    for policy, done in (("split", "split"), ("truncate", "truncated"), ("drop", "dropped")):
        if policy != overflow:
            assert getattr(stats, f"examples_{done}") == getattr(stats, f"tokens_{done}") == 0


def test_statistics_serialise_with_fill() -> None:
    stats = pack([5, 3, 9], 8).stats
    data = stats.to_dict()
    assert data["fill"] == stats.fill == 17 / 24
    assert type(stats).from_dict(data) == stats


# Overflow policies.


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, seed=seeds)
def test_truncate_keeps_the_first_tokens_of_each_example(case: tuple[list[int], int], algorithm: str, seed: int) -> None:
    lengths, capacity = case
    plan = pack(lengths, capacity, overflow="truncate", algorithm=algorithm, seed=seed)
    assert_well_formed(plan, capacity)
    placed = segments_by_example(plan)
    assert placed == {i: [(0, min(n, capacity))] for i, n in enumerate(lengths)}


@FAST
@given(case=lengths_and_capacity(), algorithm=algorithms, seed=seeds)
def test_drop_leaves_out_exactly_the_long_examples(case: tuple[list[int], int], algorithm: str, seed: int) -> None:
    lengths, capacity = case
    plan = pack(lengths, capacity, overflow="drop", algorithm=algorithm, seed=seed)
    assert_well_formed(plan, capacity)
    placed = segments_by_example(plan)
    assert placed == {i: [(0, n)] for i, n in enumerate(lengths) if n <= capacity}


def test_error_names_the_first_long_example() -> None:
    with pytest.raises(PackingError, match=r"example 2 has 9 tokens, more than max length 8 \(2 such examples\)"):
        pack([3, 8, 9, 1, 12], 8, overflow="error")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_error_policy_packs_when_nothing_is_too_long(algorithm: str) -> None:
    assert pack([3, 8, 5, 1], 8, overflow="error", algorithm=algorithm).stats.tokens == 17


def test_every_policy_is_accepted_and_unknown_ones_are_not() -> None:
    assert set(Overflow) == {"split", "truncate", "drop", "error"}
    with pytest.raises(PackingError, match="overflow must be one of split, truncate, drop, error, got 'wrap'"):
        pack([1, 2], 4, overflow="wrap")
    with pytest.raises(PackingError, match="algorithm must be one of best_fit_decreasing, .*, got 'worst_fit'"):
        pack([1, 2], 4, algorithm="worst_fit")
    assert set(PackingAlgorithm) == set(PACKERS)


def test_drop_of_every_example_gives_no_rows() -> None:
    plan = pack([9, 10], 8, overflow="drop")
    assert plan.num_rows == 0 and plan.stats.tokens_dropped == 19 and plan.stats.fill == 0.0


# Best-fit decreasing is exactly best-fit decreasing, and packs well.


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=40), data=st.data(), seed=seeds)
def test_best_fit_decreasing_matches_the_per_item_reference(capacity: int, data: st.DataObject, seed: int) -> None:
    sizes = data.draw(st.lists(st.integers(min_value=1, max_value=capacity), max_size=80))
    bin_of_item = best_fit_decreasing(np.array(sizes, dtype=np.int64), capacity, seed)
    reference = reference_best_fit_decreasing(sizes, capacity)
    loads = loads_of(bin_of_item, sizes) if sizes else np.array([], dtype=np.int64)
    assert len(loads) == len(reference)
    assert sorted(loads.tolist()) == sorted(reference)
    assert np.all(loads >= 1), "bins are numbered 0..rows-1 with none left empty"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seed=seeds)
def test_best_fit_decreasing_matches_the_reference_with_few_distinct_sizes(data: st.DataObject, seed: int) -> None:
    capacity = data.draw(st.sampled_from([7, 12, 100, 128]))
    distinct = data.draw(st.lists(st.integers(min_value=1, max_value=capacity), min_size=1, max_size=4))
    sizes = data.draw(st.lists(st.sampled_from(distinct), max_size=300))
    bin_of_item = best_fit_decreasing(sizes, capacity, seed)
    loads = loads_of(bin_of_item, sizes) if sizes else np.array([], dtype=np.int64)
    assert sorted(loads.tolist()) == sorted(reference_best_fit_decreasing(sizes, capacity))


@pytest.mark.parametrize("seed", range(3))
def test_best_fit_decreasing_matches_the_reference_on_flan_lengths(seed: int) -> None:
    sizes = flan_lengths(1_500, seed).tolist()
    loads = loads_of(best_fit_decreasing(sizes, 4096, seed), sizes)
    assert sorted(loads.tolist()) == sorted(reference_best_fit_decreasing(sizes, 4096))


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=2**40), data=st.data(), seed=seeds)
def test_best_fit_decreasing_matches_the_reference_at_random_capacities(capacity: int, data: st.DataObject, seed: int) -> None:
    """Large capacities too: sizes near a drawn fraction of the capacity, so bins fill to the last token."""
    unit = capacity // data.draw(st.integers(min_value=1, max_value=6))
    near = st.integers(min_value=-3, max_value=3).map(lambda delta: min(capacity, max(1, unit + delta)))
    sizes = data.draw(st.lists(st.one_of(near, st.integers(min_value=1, max_value=capacity)), max_size=60))
    bin_of_item = best_fit_decreasing(np.array(sizes, dtype=np.int64), capacity, seed)
    loads = [sum(size for size, b in zip(sizes, bin_of_item.tolist()) if b == row) for row in range(len(set(bin_of_item.tolist())))]
    assert sorted(loads) == sorted(reference_best_fit_decreasing(sizes, capacity))
    assert all(loads), "bins are numbered 0..rows-1 with none left empty"


def test_a_plan_stays_the_same_from_release_to_release() -> None:
    """Builds are content-addressed: the same lengths, capacity and seed give the plan they always gave."""
    plan = pack(np.random.default_rng(28).integers(1, 6000, 50_000), 4096, seed=7)
    digest = hashlib.sha256()
    for column in (plan.segment_example, plan.segment_offset, plan.segment_length, plan.row_offsets):
        digest.update(column.tobytes())
    assert (plan.num_rows, digest.hexdigest()[:16]) == (36503, "dfc8606b9882ef31")


PEAK_MEMORY = """
import resource, sys
from pipeline.packing.algorithms import pack
plan = pack([int(length) for length in sys.argv[2:]], capacity=int(sys.argv[1]))
print(plan.row_offsets.tolist(), plan.segment_length.tolist(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_memory_of_a_plan(capacity: int, lengths: list[int]) -> tuple[str, int]:
    """The plan of ``lengths`` in rows of ``capacity`` (as text) and the peak memory of the process that made it."""
    two_gb = 2 << 30  # the old packer needed 24 GB at 2**31: stop it early rather than let it take the machine
    run = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY, str(capacity), *map(str, lengths)], capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (two_gb, two_gb)),
    )
    plan, peak = run.stdout.rsplit(" ", 1)
    return plan, int(peak)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and ru_maxrss in kilobytes are Linux's")
def test_memory_grows_with_the_examples_not_with_the_capacity() -> None:
    small_plan, small_peak = peak_memory_of_a_plan(64, [5, 7, 9])
    plan, peak = peak_memory_of_a_plan(2**31, [5, 7, 2**31 + 9])
    assert small_plan == "[0, 3] [5, 7, 9]"
    assert plan == "[0, 1, 4] [2147483648, 5, 7, 9]"  # the long example's chunk alone, then the rest together
    assert peak < small_peak + (32 << 20)


@FAST
@given(capacity=st.integers(min_value=1, max_value=40), data=st.data(), seed=seeds)
def test_first_fit_decreasing_matches_the_per_item_reference(capacity: int, data: st.DataObject, seed: int) -> None:
    sizes = data.draw(st.lists(st.integers(min_value=1, max_value=capacity), max_size=80))
    loads = loads_of(first_fit_decreasing(sizes, capacity, seed), sizes) if sizes else np.array([], dtype=np.int64)
    assert loads.tolist() == reference_first_fit_decreasing(sizes, capacity)


@FAST
@given(capacity=st.integers(min_value=1, max_value=40), data=st.data())
def test_sequential_fills_rows_in_input_order(capacity: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(min_value=1, max_value=capacity), max_size=80))
    bin_of_item = sequential(sizes, capacity)
    assert np.all(np.diff(bin_of_item) >= 0) and np.all(np.diff(bin_of_item) <= 1)
    loads = loads_of(bin_of_item, sizes) if sizes else np.array([], dtype=np.int64)
    assert np.all(loads <= capacity)
    starts = np.flatnonzero(np.diff(bin_of_item)) + 1
    assert all(loads[bin_of_item[i - 1]] + sizes[i] > capacity for i in starts), "a row was closed while the next example fit"


def test_sequential_plan_keeps_input_order() -> None:
    lengths = flan_lengths(2_000)
    plan = pack(lengths, 4096, algorithm="sequential")
    assert np.array_equal(plan.segment_example, np.arange(lengths.size))


@pytest.mark.parametrize("dist", ["flan", "uniform", "bimodal"])
@pytest.mark.parametrize("seed", range(2))
def test_best_fit_decreasing_fills_at_least_as_well_as_the_baselines(dist: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = {
        "flan": flan_lengths(4_000, seed),
        "uniform": rng.integers(1, 2048, 4_000),
        "bimodal": np.where(rng.random(4_000) < 0.5, rng.integers(16, 300, 4_000), rng.integers(1500, 3000, 4_000)),
    }[dist]
    fill = {algorithm: pack(lengths, 4096, algorithm=algorithm, seed=seed).stats.fill for algorithm in ALGORITHMS}
    assert fill["best_fit_decreasing"] >= fill["first_fit_decreasing"] - 0.002
    assert fill["best_fit_decreasing"] >= fill["sequential"]


def test_flan_lengths_pack_to_the_issue_target() -> None:
    plan = pack(flan_lengths(200_000), 4096)
    assert plan.stats.fill >= 0.999
    assert plan.stats.tokens_truncated == plan.stats.tokens_dropped == 0
    assert plan.stats.tokens == int(flan_lengths(200_000).sum())


# Bad input.


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([3, 0, 4], r"example 1 has length 0: every example needs at least one token"),
        ([3, -2, 4, -1], r"example 1 has length -2.*\(2 such examples\)"),
        ([3, 3.5, 4], r"lengths must be integers, got 3.5 for example 1"),
        ([3.0, float("nan")], r"lengths must be integers, got nan for example 1"),
        ([3.0, float("inf")], r"lengths must be integers, got inf for example 1"),
        ([1e30], r"lengths must be integers, got 1e\+30 for example 0"),
        (["3", "4"], r"lengths must be integers, got dtype <U1"),
        ([1, None], r"lengths must be integers, got dtype object"),
        ([True, False], r"lengths must be integers, got dtype bool"),
        ([[1, 2], [3, 4]], r"lengths must be a 1-D array, got shape \(2, 2\)"),
        ([[1, 2], [3]], r"lengths must be a 1-D sequence of integers"),
        (5, r"lengths must be a 1-D array, got shape \(\)"),
    ],
)
def test_bad_lengths_raise_a_clear_error(lengths: object, message: str) -> None:
    with pytest.raises(PackingError, match=message):
        pack(lengths, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -4, 2.5, 8.0, "8", True, None])
def test_bad_capacity_raises_a_clear_error(capacity: object) -> None:
    with pytest.raises(PackingError, match="capacity must be a positive integer"):
        pack([1, 2], capacity)  # type: ignore[arg-type]


def test_a_capacity_past_int64_is_refused_and_the_largest_is_packed() -> None:
    with pytest.raises(PackingError, match=r"capacity must fit int64 \(at most 9223372036854775807\), got 9223372036854775808"):
        pack([1, 2], 2**63)
    assert pack([1, 2], 2**63 - 1).row_offsets.tolist() == [0, 2]


def test_whole_float_lengths_and_numpy_capacity_are_accepted() -> None:
    plan = pack(np.array([3.0, 5.0]), np.int32(8))
    assert plan.stats.tokens == 8 and plan.num_rows == 1 and plan.capacity == 8


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_lengths_give_an_empty_plan(algorithm: str) -> None:
    plan = pack([], 8, algorithm=algorithm)
    assert plan.num_rows == 0 and plan.row_offsets.tolist() == [0]
    assert plan.segment_length.size == 0 and plan.row_lengths().size == 0
    assert plan.stats.rows == plan.stats.tokens == plan.stats.examples == 0
    assert plan.stats.fill == 0.0 and plan.stats.segments_per_row == {}


@pytest.mark.parametrize("packer", [best_fit_decreasing, first_fit_decreasing, sequential])
@pytest.mark.parametrize("sizes", [[3, 9], [0, 2], [-1]])
def test_packers_reject_sizes_outside_one_to_capacity(packer, sizes: list[int]) -> None:  # noqa: ANN001
    with pytest.raises(PackingError, match=r"item sizes must lie in \[1, 8\]"):
        packer(np.array(sizes), 8)


def test_row_slice_selects_rows() -> None:
    plan = pack(flan_lengths(500), 1024)
    middle = plan.row_slice(3, 7)
    assert middle.num_rows == 4
    assert np.array_equal(middle.row_lengths(), plan.row_lengths()[3:7])
    lo = plan.row_offsets[3]
    assert np.array_equal(middle.segment_example, plan.segment_example[lo : plan.row_offsets[7]])
