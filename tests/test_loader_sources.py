"""Builds behind fsspec URLs: copied into the local cache once, verified, reused, re-fetched when damaged."""

from __future__ import annotations

import shutil
import uuid

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.remote import cache_name
from pipeline.write.shard_writer import ShardWriter
from schemas import ManifestError, ShardError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(11).integers(4, 60, 150)
    return build_shard_dir(tmp_path_factory.mktemp("local"), lengths, capacity=64, rows_per_shard=16)


@pytest.fixture
def remote(shards):
    """The build uploaded to fsspec's in-memory filesystem; yields its memory:// URL."""
    url = upload(shards.path)
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def upload(directory):
    """A build directory copied to fsspec's in-memory filesystem; its memory:// URL."""
    fs = fsspec.filesystem("memory")
    root = f"/build-{uuid.uuid4().hex}"
    for path in sorted(directory.iterdir()):
        fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
    return f"memory://{root}"


@pytest.fixture
def fetches(monkeypatch):
    """The remote shard paths copied from memory://, in order."""
    calls = []
    original = MemoryFileSystem.open
    monkeypatch.setattr(
        MemoryFileSystem, "open",
        lambda self, path, *args, **kw: (path.endswith(".arrow") and calls.append(path)) or original(self, path, *args, **kw),
    )
    return calls


def all_batches(source, **kwargs):
    return list(PackedIterableDataset(source, batch_rows=2, seed=4, **kwargs))


def assert_same(a, b):
    assert len(a) == len(b) and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))


def test_remote_build_is_cached_once_and_reused(shards, remote, fetches, tmp_path):
    expected = all_batches(shards.path)
    assert_same(all_batches(remote, cache_dir=tmp_path), expected)
    assert len(fetches) == len(shards.manifest.shards)
    cached = tmp_path / cache_name(shards.manifest)
    assert sorted(p.name for p in cached.glob("*.arrow")) == sorted(s.path for s in shards.manifest.shards)
    assert (cached / "manifest.json").is_file()

    fetches.clear()
    assert_same(all_batches(f"{remote}/manifest.json", cache_dir=tmp_path), expected)
    assert fetches == [], "a verified cached copy must be reused"

    # A damaged cached copy fails its checksum and is fetched again; the others are reused.
    damaged = cached / shards.manifest.shards[1].path
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert_same(all_batches(remote, cache_dir=tmp_path), expected)
    assert fetches == [f"{remote.removeprefix('memory://')}/{shards.manifest.shards[1].path}"]


@pytest.mark.parametrize("verify_checksum", [False, True])
def test_a_build_claiming_the_same_fingerprint_never_gets_another_builds_cached_copies(
    shards, remote, tmp_path, verify_checksum
):
    # The same inputs, so the same fingerprint, and shards of the same sizes, but other tokens.
    forged_dir = tmp_path / "forged"
    with ShardWriter(forged_dir, shards.manifest.inputs, rows_per_shard=16) as writer:
        writer.write_examples(shards.tokens % 997 + 1, shards.lengths, shards.loss_mask)
    forged = writer.manifest
    assert forged.fingerprint == shards.manifest.fingerprint
    assert [s.bytes for s in forged.shards] == [s.bytes for s in shards.manifest.shards]
    assert [s.sha256 for s in forged.shards] != [s.sha256 for s in shards.manifest.shards]
    forged_url = upload(forged_dir)
    try:
        # Opened first on the host, the forged build fills the cache; the real one must not be served its bytes.
        assert_same(all_batches(forged_url, cache_dir=tmp_path / "cache", verify_checksum=verify_checksum),
                    all_batches(forged_dir))
        assert_same(all_batches(remote, cache_dir=tmp_path / "cache", verify_checksum=verify_checksum),
                    all_batches(shards.path))
        assert_same(all_batches(forged_url, cache_dir=tmp_path / "cache", verify_checksum=verify_checksum),
                    all_batches(forged_dir))
    finally:
        fsspec.filesystem("memory").rm(forged_url.removeprefix("memory://"), recursive=True)


def test_corrupt_or_missing_remote_shard_is_refused(shards, remote, tmp_path):
    fs = fsspec.filesystem("memory")
    path = f"{remote.removeprefix('memory://')}/{shards.manifest.shards[0].path}"
    data = bytearray(fs.cat_file(path))
    data[100] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ShardError, match="source shard is corrupt"):
        PackedIterableDataset(remote, cache_dir=tmp_path / "a")
    fs.rm(path)
    with pytest.raises(ShardError, match="missing at the source"):
        PackedIterableDataset(remote, cache_dir=tmp_path / "b")
    assert not list((tmp_path / "b").rglob("shard-00000.arrow")), "no partial copy may be left behind"


def test_missing_remote_manifest_is_a_manifest_error(tmp_path):
    with pytest.raises(ManifestError, match="no manifest"):
        PackedIterableDataset(f"memory://nothing-{uuid.uuid4().hex}", cache_dir=tmp_path)


def test_file_url_reads_in_place(shards, tmp_path):
    assert_same(all_batches(f"file://{shards.path}", cache_dir=tmp_path / "cache"), all_batches(shards.path))
    assert not (tmp_path / "cache").exists(), "local builds are not copied"


def test_the_parent_of_builds_names_them(shards, tmp_path):
    parent = tmp_path / "shards"
    parent.mkdir()
    shutil.copytree(shards.path, parent / "gsm8k-0123456789abcdef")
    with pytest.warns(UserWarning, match=f"holds no manifest but one build; using {parent}/gsm8k-0123456789abcdef"):
        assert_same(all_batches(parent), all_batches(shards.path))
    shutil.copytree(shards.path, parent / "flan-fedcba9876543210")
    with pytest.raises(ManifestError, match=rf"^{parent}: no manifest here; this directory holds 2 builds "
                                            rf"\({parent}/flan-fedcba9876543210, {parent}/gsm8k-0123456789abcdef\): pass one"):
        PackedIterableDataset(parent)
    with pytest.raises(ManifestError, match="no manifest; the build is missing or was interrupted"):
        PackedIterableDataset(tmp_path / "shards" / "gsm8k-0123456789abcdef" / "nothing")
