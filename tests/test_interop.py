"""A build read by other tools: pyarrow.dataset and Hugging Face datasets, through the documented one-liners."""

from __future__ import annotations

import glob

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from shard_factory import build_shard_dir

from loaders.interop import arrow_dataset, shard_paths, to_hf_dataset
from loaders.shard_reader import open_shard
from schemas import ROW_COLUMNS, ShardError, read_manifest


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory):
    lengths = np.random.default_rng(2).integers(1, 200, 3000)
    shards = build_shard_dir(tmp_path_factory.mktemp("interop"), lengths, capacity=256, rows_per_shard=400, vocab_size=500)
    (shards.path / "report.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # the extra files a build may hold
    (shards.path / "rejected.jsonl").write_text("")
    return shards


def stored_rows(build) -> pa.Table:
    """Every row of the build in manifest order, read by the loader's own shard reader."""
    manifest = build.manifest
    return pa.concat_tables(open_shard(build.path / s.path, manifest.capacity, s).table for s in manifest.shards)


def test_to_hf_dataset_maps_the_shards_without_copying(build) -> None:
    size = sum(s.bytes for s in build.manifest.shards)
    allocated = pa.total_allocated_bytes()
    hf = to_hf_dataset(build.path, verify_checksum=True)
    assert pa.total_allocated_bytes() - allocated < size / 20  # the rows stay in the memory-mapped files
    assert hf.num_rows == build.manifest.num_rows and hf.column_names == list(ROW_COLUMNS)
    assert hf.cache_files == [] and hf._fingerprint == build.manifest.fingerprint
    expected = stored_rows(build)
    assert all(hf.data.table.column(name).equals(expected.column(name)) for name in ROW_COLUMNS)
    rows = hf.with_format("numpy")
    assert np.array_equal(rows[7]["input_ids"], np.asarray(expected.column("input_ids")[7].as_py()))
    trained = hf.map(lambda row: {"trained": int(sum(row["loss_mask"]))})
    assert sum(trained["trained"]) == int(np.sum(build.loss_mask))


def test_load_dataset_reads_the_shards_by_glob(build) -> None:
    hf = datasets.load_dataset("arrow", data_files=str(build.path / "shard-*.arrow"), split="train")
    assert hf.num_rows == build.manifest.num_rows
    assert sorted(hf["num_tokens"]) == sorted(stored_rows(build).column("num_tokens").to_pylist())
    assert datasets.load_dataset("arrow", data_files=shard_paths(build.path), split="train")["input_ids"] == (
        stored_rows(build).column("input_ids").to_pylist()
    )


def test_pyarrow_dataset_over_the_shards(build) -> None:
    by_glob = ds.dataset(sorted(glob.glob(str(build.path / "shard-*.arrow"))), format="arrow")
    assert by_glob.to_table().equals(stored_rows(build))
    dataset = arrow_dataset(build.path)
    long_rows = dataset.to_table(columns=["num_tokens"], filter=ds.field("num_tokens") > 250)
    assert long_rows.num_rows == int(np.sum(stored_rows(build).column("num_tokens").to_numpy() > 250))
    assert dataset.count_rows() == build.manifest.num_rows


def test_a_truncated_shard_is_refused_by_name(tmp_path) -> None:
    shards = build_shard_dir(tmp_path, [30, 40, 50], capacity=64)
    path = shards.path / read_manifest(shards.path).shards[0].path
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ShardError, match=rf"^{path}: is \d+ bytes, the manifest says \d+: truncated or replaced"):
        to_hf_dataset(shards.path)
    with pytest.raises(ShardError, match="truncated or replaced"):
        arrow_dataset(shards.path)
