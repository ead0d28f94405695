"""Shard files: what the writer puts in, the reader gives back; every corruption is caught."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.shard_reader import Shard, open_shard
from pipeline.config import default_rows_per_shard
from pipeline.packing.algorithms import PackingPlan, pack
from pipeline.packing.rows import build_rows
from pipeline.write.shard_writer import ShardWriter, shard_name, write_shard
from schemas import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BuildInputs,
    DatasetInputs,
    FormatVersionError,
    Manifest,
    ShardError,
    ShardInfo,
    TokenizerInputs,
    WriteError,
    read_manifest,
    validate_table,
)
from schemas.shard_identity import ShardIdentity

CAPACITY = 16
IDENTITY = ShardIdentity("0123456789abcdef", index=0, last=True)  # a shard written on its own


@dataclass(frozen=True)
class Examples:
    """Tokenized examples as flat buffers, the way the pipeline hands them to the writer."""

    lengths: np.ndarray
    tokens: np.ndarray
    loss_mask: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    def tokens_of(self, i: int) -> np.ndarray:
        return self.tokens[self.starts[i] : self.starts[i] + self.lengths[i]]

    def mask_of(self, i: int) -> np.ndarray:
        return self.loss_mask[self.starts[i] : self.starts[i] + self.lengths[i]]


def make_examples(lengths: list[int] | np.ndarray, seed: int = 0) -> Examples:
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    return Examples(lengths, rng.integers(0, 50_000, total).astype(np.int32), rng.integers(0, 2, total).astype(np.uint8))


def packed_table(examples: Examples, capacity: int = CAPACITY, algorithm: str = "best_fit_decreasing") -> pa.Table:
    """All rows of the examples packed at ``capacity``, as one table."""
    plan = pack(examples.lengths, capacity, algorithm=algorithm)
    segment_starts = examples.starts[plan.segment_example] + plan.segment_offset
    return build_rows(plan, segment_starts, examples.tokens, examples.loss_mask)


def write_build(directory: Path, examples: Examples, capacity: int = CAPACITY, rows_per_shard: int = 4,
                example_ids: np.ndarray | None = None, num_examples: int | None = None) -> tuple[Manifest, PackingPlan]:
    """Pack and write the examples with ShardWriter, in shards of ``rows_per_shard`` rows; the plan it packed by.

    ``num_examples``: the size of the source the ``example_ids`` number, when they go past the examples.
    """
    inputs = BuildInputs(
        dataset=DatasetInputs(id="test", split="train", content_hash="00", num_examples=num_examples),
        tokenizer=TokenizerInputs(name="test", content_hash="11", vocab_size=50_000),
        template="none", loss_masking="given", max_len=capacity, overflow="split",
        packing="best_fit_decreasing", seed=7, package_version="0.1.0",
    )
    with ShardWriter(directory, inputs, rows_per_shard) as writer:
        writer.write_examples(examples.tokens, examples.lengths, examples.loss_mask, example_ids)
    return writer.manifest, pack(examples.lengths, capacity, seed=7)


def open_build(directory: Path) -> list[Shard]:
    """Every shard of a build, opened and fully verified against its manifest."""
    manifest = read_manifest(directory)
    return [open_shard(directory / info.path, manifest.capacity, info, verify_checksum=True) for info in manifest.shards]


def reassemble(shards: list[Shard], examples: Examples, example_ids: np.ndarray | None = None) -> None:
    """Put every example back together from the rows and compare it with what went in."""
    pieces: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for shard in shards:
        for i in range(shard.num_rows):
            row = shard.row(i)
            cu = row["cu_seqlens"]
            assert cu[0] == 0 and cu[-1] == row["input_ids"].size <= CAPACITY
            assert row["max_seqlen"] == int(np.diff(cu).max())
            for j, (example, offset) in enumerate(zip(row["example_ids"].tolist(), row["example_offsets"].tolist())):
                segment = slice(cu[j], cu[j + 1])
                pieces.setdefault(example, []).append((offset, row["input_ids"][segment], row["loss_mask"][segment]))
    ids = np.arange(examples.lengths.size) if example_ids is None else example_ids
    assert sorted(pieces) == sorted(ids.tolist())
    for index, example in enumerate(ids.tolist()):
        parts = sorted(pieces[example], key=lambda part: part[0])
        assert np.array_equal(np.concatenate([p[1] for p in parts]), examples.tokens_of(index))
        assert np.array_equal(np.concatenate([p[2] for p in parts]), examples.mask_of(index))


# Round trip.


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=3 * CAPACITY), min_size=1, max_size=60),
    rows_per_shard=st.integers(1, 6),
)
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, lengths: list[int], rows_per_shard: int) -> None:
    directory = tmp_path_factory.mktemp("build")
    examples = make_examples(lengths)
    manifest, plan = write_build(directory, examples, rows_per_shard=rows_per_shard)
    shards = open_build(directory)
    assert sum(s.num_rows for s in shards) == manifest.num_rows == plan.num_rows
    assert sum(s.num_tokens for s in shards) == manifest.num_tokens == int(examples.lengths.sum())
    assert all(s.num_rows == rows_per_shard for s in shards[:-1])
    reassemble(shards, examples)


def test_round_trip_keeps_the_rows_of_the_plan(tmp_path: Path) -> None:
    examples = make_examples(np.random.default_rng(3).integers(1, 40, 200))
    _, plan = write_build(tmp_path, examples, rows_per_shard=8)
    shards = open_build(tmp_path)
    cu_lengths = np.concatenate([np.diff(s.cu_seqlens)[np.diff(s.cu_seqlens) > 0] for s in shards])
    assert np.array_equal(np.concatenate([s.example_ids for s in shards]), plan.segment_example)
    assert np.array_equal(np.concatenate([s.example_offsets for s in shards]), plan.segment_offset)
    assert np.array_equal(np.concatenate([np.diff(s.token_offsets) for s in shards]), plan.row_lengths())
    assert np.array_equal(np.concatenate([np.diff(s.cu_offsets) - 1 for s in shards]), np.diff(plan.row_offsets))
    assert cu_lengths.sum() == plan.segment_length.sum()
    reassemble(shards, examples)


def test_example_ids_map_plan_indices_to_stored_ids(tmp_path: Path) -> None:
    examples = make_examples([5, 30, 7, 16, 1])
    ids = np.array([900, 901, 902, 903, 904], dtype=np.int64)
    write_build(tmp_path, examples, example_ids=ids, num_examples=1000)
    reassemble(open_build(tmp_path), examples, ids)


def test_the_reader_maps_without_copying(tmp_path: Path) -> None:
    write_build(tmp_path, make_examples([5, 9, 14, 3, 16]))
    shard = open_build(tmp_path)[0]
    buffer = shard.table.column("input_ids").chunk(0).values.buffers()[1]
    assert np.shares_memory(shard.input_ids, np.frombuffer(buffer, dtype=np.int32))
    for name in ("input_ids", "loss_mask", "cu_seqlens", "max_seqlen", "example_ids", "example_offsets"):
        view = getattr(shard, name)
        assert not view.flags.writeable and not view.flags.owndata, name
    row = shard.row(0)
    assert np.shares_memory(row["input_ids"], shard.input_ids)
    with pytest.raises(IndexError, match=r"row 99 out of range"):
        shard.row(99)


def test_a_shard_is_one_record_batch_even_from_a_chunked_table(tmp_path: Path) -> None:
    examples = make_examples([5, 9, 14, 3, 16, 2, 8])
    table = packed_table(examples)
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    info = write_shard(chunked, tmp_path, "chunked.arrow", CAPACITY, IDENTITY)
    assert pa.ipc.open_file(str(tmp_path / "chunked.arrow")).num_record_batches == 1
    shard = open_shard(tmp_path / "chunked.arrow", CAPACITY, info, verify_checksum=True)
    assert shard.table.column("input_ids").num_chunks == 1 and shard.num_tokens == int(examples.lengths.sum())


def test_default_rows_per_shard_and_names() -> None:
    assert default_rows_per_shard(4096) == 2048 and default_rows_per_shard(1 << 30) == 1
    assert shard_name(3) == "shard-00003.arrow"


# The writer refuses what would make a wrong shard.


def test_write_shard_refuses_a_broken_table_and_leaves_nothing(tmp_path: Path) -> None:
    table = packed_table(make_examples([5, 9, 14]))
    with pytest.raises(ShardError, match=r"^shard-00000.arrow row 0: holds more than the capacity of 8 tokens"):
        write_shard(table, tmp_path, "shard-00000.arrow", 8, IDENTITY)
    assert list(tmp_path.iterdir()) == []


def test_write_shard_reports_an_unwritable_directory(tmp_path: Path) -> None:
    table = packed_table(make_examples([5, 9]))
    missing = tmp_path / "no-such-dir"
    with pytest.raises(WriteError, match=rf"^{re.escape(str(missing / 'a.arrow'))}: could not be written: the directory "
                                         rf"{re.escape(str(missing))} does not exist"):
        write_shard(table, missing, "a.arrow", CAPACITY, IDENTITY)


def test_build_rows_refuses_bad_buffers() -> None:
    examples = make_examples([5, 9, 14])
    plan = pack(examples.lengths, CAPACITY)
    starts = examples.starts[plan.segment_example] + plan.segment_offset
    with pytest.raises(ValueError, match="segment_starts point outside the token buffer of 28 tokens"):
        build_rows(plan, starts + 20, examples.tokens, examples.loss_mask)
    with pytest.raises(ValueError, match="segment_starts point outside"):
        build_rows(plan, starts - 1, examples.tokens, examples.loss_mask)
    with pytest.raises(ValueError, match="segment_starts has 2 entries, the plan has 3 segments"):
        build_rows(plan, starts[:2], examples.tokens, examples.loss_mask)
    with pytest.raises(ValueError, match="must be flat buffers of one length"):
        build_rows(plan, starts, examples.tokens, examples.loss_mask[:-1])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*31 - 1\]"):
        build_rows(plan, starts, examples.tokens.astype(np.int64) + 2**31, examples.loss_mask)
    with pytest.raises(ValueError, match="the plan has no rows"):
        build_rows(pack([], CAPACITY), np.array([], dtype=np.int64), examples.tokens, examples.loss_mask)


def test_build_rows_output_passes_validation() -> None:
    examples = make_examples(np.random.default_rng(5).integers(1, 50, 300))
    examples = replace(examples, loss_mask=examples.loss_mask.astype(bool))
    table = packed_table(examples, algorithm="first_fit_decreasing")
    validate_table(table, CAPACITY, "all.arrow")
    assert table.column("loss_mask").type == pa.list_(pa.uint8())


# Every corruption is caught and named.


@pytest.fixture
def build(tmp_path: Path) -> tuple[Path, Manifest]:
    examples = make_examples(np.random.default_rng(11).integers(1, 40, 60))
    manifest, _ = write_build(tmp_path, examples, rows_per_shard=8)
    assert len(manifest.shards) >= 2
    return tmp_path, manifest


def shard_path(build: tuple[Path, Manifest], index: int = 0) -> tuple[Path, ShardInfo]:
    directory, manifest = build
    return directory / manifest.shards[index].path, manifest.shards[index]


def test_a_flipped_byte_fails_the_checksum(build: tuple[Path, Manifest]) -> None:
    path, info = shard_path(build)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(ShardError, match=rf"^{re.escape(str(path))}: checksum mismatch: the file is corrupt; rebuild it"):
        open_shard(path, CAPACITY, info, verify_checksum=True)


def test_a_truncated_file_is_caught_by_size_and_by_format(build: tuple[Path, Manifest]) -> None:
    path, info = shard_path(build)
    path.write_bytes(path.read_bytes()[: info.bytes - 100])
    size_error = rf"^{re.escape(str(path))}: is {info.bytes - 100} bytes, the manifest says {info.bytes}: truncated"
    with pytest.raises(ShardError, match=size_error):
        open_shard(path, CAPACITY, info)
    with pytest.raises(ShardError, match=rf"^{re.escape(str(path))}: is not a readable Arrow IPC file"):
        open_shard(path, CAPACITY)


def test_an_empty_file_is_caught(build: tuple[Path, Manifest]) -> None:
    path, _ = shard_path(build)
    path.write_bytes(b"")
    with pytest.raises(ShardError, match="is not a readable Arrow IPC file"):
        open_shard(path, CAPACITY)


def test_a_missing_shard_is_named(build: tuple[Path, Manifest]) -> None:
    path, info = shard_path(build, 1)
    path.unlink()
    with pytest.raises(ShardError, match=rf"^{re.escape(str(path))}: shard file is missing"):
        open_shard(path, CAPACITY, info, verify_checksum=True)


def test_a_shard_swapped_for_another_is_caught(build: tuple[Path, Manifest]) -> None:
    directory, manifest = build
    first, second = (directory / info.path for info in manifest.shards[:2])
    second.write_bytes(first.read_bytes())
    resized = replace(manifest.shards[1], bytes=first.stat().st_size)
    with pytest.raises(ShardError, match=r"checksum mismatch"):
        open_shard(second, CAPACITY, resized, verify_checksum=True)
    with pytest.raises(ShardError, match=r"holds 8 rows, the manifest says 7"):
        open_shard(second, CAPACITY, replace(resized, rows=7))


def test_a_shard_read_at_a_smaller_capacity_is_refused(build: tuple[Path, Manifest]) -> None:
    path, info = shard_path(build)
    with pytest.raises(ShardError, match=r"row \d+: holds more than the capacity of 4 tokens"):
        open_shard(path, 4, info)


def test_a_manifest_of_a_newer_format_is_refused(build: tuple[Path, Manifest]) -> None:
    directory, _ = build
    path = directory / MANIFEST_NAME
    written = f'"format_version": {build[1].format_version}'
    path.write_text(path.read_text().replace(written, f'"format_version": {FORMAT_VERSION + 1}'))
    newer = rf"^{re.escape(str(path))}: format version {FORMAT_VERSION + 1} is newer than this varpack reads \({FORMAT_VERSION}\)"
    with pytest.raises(FormatVersionError, match=newer):
        read_manifest(directory)


def test_a_row_whose_cu_seqlens_disagrees_with_its_length_is_named(tmp_path: Path) -> None:
    table = packed_table(make_examples([5, 9, 14, 3, 16, 2]))
    rows = table.to_pylist()
    rows[2]["cu_seqlens"][-1] -= 1
    bad = pa.Table.from_pylist(rows, schema=table.schema)
    with pytest.raises(ShardError, match=r"^bad.arrow row 2: cu_seqlens does not end at the row's token count"):
        validate_table(bad, CAPACITY, "bad.arrow")
    path = tmp_path / "bad.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, bad.schema) as writer:
        writer.write_table(bad)
    with pytest.raises(ShardError, match=rf"^{re.escape(str(path))} row 2: cu_seqlens does not end"):
        open_shard(path, CAPACITY)


def test_a_flipped_byte_anywhere_never_crashes_the_reader(build: tuple[Path, Manifest]) -> None:
    path, info = shard_path(build)
    original = path.read_bytes()
    for position in range(0, len(original), 7):
        for bit in (0x01, 0x80):
            data = bytearray(original)
            data[position] ^= bit
            path.write_bytes(data)
            try:
                open_shard(path, CAPACITY)
            except ShardError as err:
                assert str(err).startswith(str(path))
            with pytest.raises(ShardError):
                open_shard(path, CAPACITY, info, verify_checksum=True)


def test_verify_checksum_needs_the_manifest_entry(build: tuple[Path, Manifest]) -> None:
    path, _ = shard_path(build)
    with pytest.raises(ValueError, match="verify_checksum needs the shard's manifest entry"):
        open_shard(path, CAPACITY, verify_checksum=True)
