"""Packing groups are cut by example: ``--batch-size`` and the runner change neither a build's shards nor its fingerprint.

A build of more than ``--examples-per-group`` N examples is packed in groups; group k holds the examples whose
ids (source row numbers) lie in [k * N, (k + 1) * N), wherever the batches of ``--batch-size`` rows start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.build import BuildResult, build, plan_build
from pipeline.config import PackConfig
from pipeline.errors import InputError
from pipeline.pack import main
from pipeline.read.readers import TEXT_TYPE, read_schema, scan_file_header
from pipeline.read.synthetic import SHAPES, generate_block
from schemas import FORMAT_VERSION, MANIFEST_NAME, SCHEMA_PATH, GroupCut, ManifestError, compute_fingerprint, read_manifest
from schemas.manifest import manifest_digest
from schemas.shard_identity import ShardIdentity

ROWS, EXAMPLES_PER_GROUP = 300, 70
# Builds of these 300 rows made while groups were cut where a batch started (format 7), by varpack 0.1.0: the
# fingerprint of each one-group build (with the default group size, and with 300 to a group) and a digest of its
# shards' rows, the same for both, and the fingerprint of the build of five groups.
ONE_GROUP = {None: "809056a2434de698", ROWS: "9ebcd945f2824848"}
ONE_GROUP_ROWS = "480ee31ed892b3cc"
# A digest of each one-group build's manifest (format 7) but for its date, digest and the fields bound to the varpack
# version (the version, the fingerprint and the shards' hashes, which hold it).
ONE_GROUP_MANIFEST = {None: "4272184ade685a46", ROWS: "7fc5cbdc4464b18f"}
FIVE_GROUPS_CUT_AT_BATCHES = "b5387d3afa559e10"
MULTI_PROCESS = ("--direct_running_mode=multi_processing", "--direct_num_workers=2")
PORTABLE = ("--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """300 synthetic OrcaMath rows in three JSON-lines files of 100 (three read tasks), bytes that depend on no library."""
    records = generate_block(SHAPES["synthetic-orcamath"], 0, ROWS).to_pylist()
    directory = tmp_path_factory.mktemp("rows") / "orca"
    directory.mkdir()
    for part in range(3):
        lines = "".join(json.dumps(record) + "\n" for record in records[part * 100 : (part + 1) * 100])
        (directory / f"train-{part:05d}-of-00003.jsonl").write_text(lines, encoding="utf-8")
    return directory


def config(rows: Path, out: Path, **changes) -> PackConfig:
    return PackConfig(dataset=str(rows), out=str(out), max_len=512, rows_per_shard=10, progress=False, report=False, **changes)


def shard_tables(result: BuildResult) -> list[pa.Table]:
    return [pa.ipc.open_file(Path(result.out_dir) / shard.path).read_all() for shard in result.manifest.shards]


@pytest.fixture(scope="module")
def grouped(rows, tmp_path_factory) -> BuildResult:
    """A build of five groups of 70 examples (the last of 20), on the in-process runner at ``--batch-size 16``."""
    return build(config(rows, tmp_path_factory.mktemp("grouped"), examples_per_group=EXAMPLES_PER_GROUP, batch_size=16))


@pytest.mark.parametrize(
    ("batch_size", "beam_args"), [(50, ()), (37, MULTI_PROCESS), (23, PORTABLE)], ids=["in-process", "multi-process", "portable"]
)
def test_the_batch_size_changes_neither_the_shards_nor_the_fingerprint_of_a_build_of_several_groups(
    grouped, rows, tmp_path, batch_size, beam_args
):
    other = build(config(rows, tmp_path, examples_per_group=EXAMPLES_PER_GROUP, batch_size=batch_size, beam_args=beam_args))
    assert other.manifest.fingerprint == grouped.manifest.fingerprint
    assert Path(other.out_dir).name == Path(grouped.out_dir).name
    for shard, (expected, got) in enumerate(zip(shard_tables(grouped), shard_tables(other), strict=True)):
        assert got.to_pydict() == expected.to_pydict(), f"shard {shard}"
    assert [s.sha256 for s in other.manifest.shards] == [s.sha256 for s in grouped.manifest.shards]
    assert other.manifest.stats == grouped.manifest.stats


def test_each_row_of_a_build_of_several_groups_holds_examples_of_one_group_in_group_order(grouped):
    groups = [
        {example // EXAMPLES_PER_GROUP for example in row}
        for table in shard_tables(grouped) for row in table.column("example_ids").to_pylist()
    ]
    assert all(len(group) == 1 for group in groups)
    in_order = [group.pop() for group in groups]
    assert in_order == sorted(in_order) and set(in_order) == set(range(-(-ROWS // EXAMPLES_PER_GROUP)))
    assert read_manifest(grouped.out_dir).stats.num_example_ids == ROWS


def test_a_build_of_several_groups_records_its_cut_and_is_another_build_than_one_cut_at_batch_starts(grouped, rows, tmp_path):
    manifest = read_manifest(grouped.out_dir)
    assert manifest.inputs.group_cut == GroupCut.EXAMPLE and manifest.format_version == FORMAT_VERSION == 8
    # The cut is all that tells this build's inputs from those of the build cut at batch starts, and it gives them
    # another fingerprint, so another directory: a cached build of the old cut is never reused as this one.
    inputs = dataclasses.replace(manifest.inputs, package_version="0.1.0")
    assert compute_fingerprint(dataclasses.replace(inputs, group_cut=None)) == FIVE_GROUPS_CUT_AT_BATCHES
    assert compute_fingerprint(inputs) != FIVE_GROUPS_CUT_AT_BATCHES
    assert plan_build(config(rows, tmp_path, examples_per_group=ROWS - 1)).inputs.group_cut == GroupCut.EXAMPLE
    assert plan_build(config(rows, tmp_path, examples_per_group=ROWS)).inputs.group_cut is None
    assert '"enum": ["example"]' in SCHEMA_PATH.read_text() and [cut.value for cut in GroupCut] == ["example"]


def manifest_digest_but_version(result: BuildResult) -> str:
    """A digest of the build's manifest as written, but for ``created_at``, its digests and what holds the version."""
    data = json.loads((Path(result.out_dir) / MANIFEST_NAME).read_text())
    for key in ("created_at", "manifest_digest", "fingerprint", "shards_digest"):
        del data[key]
    del data["inputs"]["package_version"]
    for shard in data["shards"]:
        del shard["sha256"]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def rows_digest(result: BuildResult) -> str:
    """A digest of every row of every shard, in order: the shards' bytes but for the fingerprint each one carries."""
    digest = hashlib.sha256()
    for table in shard_tables(result):
        digest.update(json.dumps(table.to_pydict()).encode())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize(
    ("examples_per_group", "batch_size", "beam_args"), [(None, 16, ()), (None, 50, MULTI_PROCESS), (ROWS, 16, ())],
    ids=["default-in-process", "default-multi-process", "all-rows-in-one-group"],
)
def test_a_build_of_one_group_keeps_its_fingerprint_and_shards_byte_for_byte(rows, tmp_path, examples_per_group, batch_size, beam_args):
    result = build(config(rows, tmp_path, examples_per_group=examples_per_group, batch_size=batch_size, beam_args=beam_args))
    assert result.manifest.inputs.group_cut is None
    # Another varpack version is another fingerprint; the rest of the inputs must give the one they gave.
    assert compute_fingerprint(dataclasses.replace(result.manifest.inputs, package_version="0.1.0")) == ONE_GROUP[examples_per_group]
    assert rows_digest(result) == ONE_GROUP_ROWS
    # Written as format 7, which the previous varpack wrote and reads: its manifest, field for field.
    assert result.manifest.format_version == 7 and manifest_digest_but_version(result) == ONE_GROUP_MANIFEST[examples_per_group]
    for shard, info in enumerate(result.manifest.shards):  # so the files are those bytes with the build's identity
        identity = ShardIdentity.from_metadata(pa.ipc.open_file(Path(result.out_dir) / info.path).schema.metadata)
        assert identity == ShardIdentity(result.manifest.fingerprint, shard, last=shard == len(result.manifest.shards) - 1)


def test_a_manifest_holding_group_cut_under_a_format_before_8_is_refused_in_one_line(grouped, tmp_path):
    data = json.loads((Path(grouped.out_dir) / MANIFEST_NAME).read_text())
    data["format_version"] = 7
    data["manifest_digest"] = manifest_digest(data)  # so that the version alone is wrong
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    message = (f"{tmp_path / MANIFEST_NAME}: inputs.group_cut is a field of format 8, but the manifest claims format 7: "
               "it was edited or is corrupt; rebuild the shards (pack --force)")
    with pytest.raises(ManifestError, match=f"^{re.escape(message)}$"):
        read_manifest(tmp_path)


def test_rows_not_counted_before_reading_may_make_several_groups_unless_num_examples_bounds_them():
    assert PackConfig().may_pack_in_groups(None)
    assert not PackConfig(num_examples=50).may_pack_in_groups(None)
    assert PackConfig(num_examples=50, examples_per_group=49).may_pack_in_groups(None)
    assert not PackConfig(examples_per_group=49).may_pack_in_groups(49)


@pytest.mark.parametrize("examples_per_group", [2**63, 10**20])
def test_examples_per_group_past_int64_is_one_line_naming_the_option_before_anything_is_written(
    rows, tmp_path, capsys, examples_per_group
):
    out = tmp_path / "out"
    args = ["--dataset", str(rows), "--out", str(out), "--max-len", "512", "--no-progress", "--no-report"]
    assert main([*args, "--examples-per-group", str(examples_per_group)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"varpack: error: --examples-per-group must be between 1 and 9,223,372,036,854,775,807, got {examples_per_group:,}"
    )
    assert not out.exists()
    assert main([*args, "--examples-per-group", str(2**63 - 1)]) == 0  # the largest is one group of every row
    assert read_manifest(next(out.iterdir())).stats.num_example_ids == ROWS



@pytest.mark.parametrize(
    ("between", "on_bad_row", "problem"),
    [
        (b"", "error", "holds more than one JSON record (another starts at byte {at} of the line); JSON lines hold one record per line"),
        (b"\r", "skip", "holds more than one JSON record (another starts at byte {at} of the line); JSON lines hold one record per line"),
        (b"\n", "skip", "not valid JSON (Expecting"),
    ],
    ids=["cat-of-a-file-without-its-final-newline", "a-bare-carriage-return", "a-record-across-two-lines"],
)
def test_a_line_of_other_than_one_record_is_one_line_naming_it_so_the_rows_read_are_the_lines(
    rows, tmp_path, capsys, between, on_bad_row, problem
):
    """Arrow reads records wherever they start, the driver counts lines: 300 records on 299 lines (or 300 on 301) must
    not be read as rows the build did not count, which would pack them in groups that ``inputs.group_cut`` misses."""
    lines = b"".join(path.read_bytes() for path in sorted(rows.iterdir())).splitlines()
    if between == b"\n":
        cut = lines[149].index(b', "') + 1  # between two fields, where JSON allows a newline
        changed = [*lines[:149], lines[149][:cut], lines[149][cut:], *lines[150:]]
    else:
        changed = [*lines[:149], lines[149] + between + lines[150], *lines[151:]]
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_bytes(b"\n".join(changed) + b"\n")
    out = tmp_path / "out"
    args = ["--dataset", str(data), "--out", str(out), "--max-len", "512", "--no-progress", "--no-report"]
    assert main([*args, "--examples-per-group", str(ROWS - 1), "--on-bad-row", on_bad_row, "--max-bad-rows", "0.5"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("varpack: error:")]
    expected = f"varpack: error: {data / 'train.jsonl'} line 150: {problem.format(at=len(lines[149]) + len(between))}"
    assert len(errors) == 1 and errors[0].startswith(expected)
    assert not list(out.rglob("manifest.json")) and not list(out.rglob("*.arrow"))


def test_a_file_whose_rows_were_not_counted_is_held_to_one_record_per_line_too(tmp_path):
    """A Hub file read without a count (``scan_file_header``): a line of two records is named, not read as two rows."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "p1", "response": "r1"}\n\n{"prompt": "p2", "response": "r2"}{"prompt": "p3", "response": "r3"}\n')
    (task,) = scan_file_header(str(path)).tasks
    assert task.rows is None
    with pytest.raises(InputError, match=rf"^{path} line 3: holds more than one JSON record \(another starts at byte 34 of"):
        list(task.read(read_schema(["prompt", "response"], TEXT_TYPE), batch_size=16))
    path.write_bytes(b'{"prompt": "p1", "response": "r1"}\n\n{"prompt": "p2", "response": "r2"}\n')
    (task,) = scan_file_header(str(path)).tasks
    assert [table.num_rows for _, table in task.read(read_schema(["prompt", "response"], TEXT_TYPE), batch_size=16)] == [2]
