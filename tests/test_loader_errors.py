"""Bad builds and bad settings: a clear error before any batch, never wrong or duplicated data."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
import torch
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.dataset import check_manifest
from loaders.verify import verify_build
from schemas import FORMAT_VERSION, FormatVersionError, ManifestError, PackingStats, ShardError, write_manifest
from schemas.verified import record_path

CAPACITY = 32


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    lengths = np.random.default_rng(5).integers(3, 40, 60)
    return build_shard_dir(tmp_path_factory.mktemp("pristine"), lengths, capacity=CAPACITY, rows_per_shard=10)


@pytest.fixture
def build(pristine, tmp_path):
    """A fresh copy of the build, free to damage."""
    shutil.copytree(pristine.path, tmp_path / "build")
    return dataclasses.replace(pristine, path=tmp_path / "build")


def shard_file(build, index=0):
    return build.path / build.manifest.shards[index].path


def test_missing_shard(build):
    shard_file(build, 2).unlink()
    with pytest.raises(ShardError, match="shard-00002.arrow: shard file is missing"):
        PackedIterableDataset(build.path)


def test_truncated_shard(build):
    path = shard_file(build)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match="truncated"):
        PackedIterableDataset(build.path, verify_checksum=False)


def test_flipped_byte_fails_the_checksum(build):
    path = shard_file(build, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-00001.arrow: checksum mismatch"):
        PackedIterableDataset(build.path)


def test_garbage_shard_of_the_right_size(build):
    path = shard_file(build)
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(ShardError, match="not a readable Arrow IPC file"):
        PackedIterableDataset(build.path, verify_checksum=False)


def set_example_id(path, row, value):
    """Overwrite the first example id of ``row`` in the shard file, in place: its size stays, its checksum does not."""
    table = pa.ipc.open_file(str(path)).read_all()
    ids = table.column("example_ids").combine_chunks()
    stored = ids.values.to_numpy().astype("<i8").tobytes()
    data = path.read_bytes()
    at = data.find(stored)
    assert at >= 0 and data.find(stored, at + 1) < 0, "the ids must be found once in the file"
    at += 8 * ids.offsets[row].as_py()
    path.write_bytes(data[:at] + np.int64(value).astype("<i8").tobytes() + data[at + 8 :])


# Bit 43 set in an id asked loss_reduction="sequence" for a 64 TiB count per example id; -1 and
# the example count itself lie just outside the build's ids.
@pytest.mark.parametrize("value", [(1 << 43) | 3, -1, 60], ids=["flipped-high-byte", "negative", "one-past-the-end"])
def test_an_example_id_outside_the_build_is_refused(build, value):
    assert build.manifest.stats.examples == 60
    set_example_id(shard_file(build, 1), 3, value)
    for reduction in ("sequence", "token"):
        with pytest.raises(ShardError, match=rf"shard-00001.arrow row 3: example_ids holds {value}, outside \[0, 60\)"):
            PackedIterableDataset(build.path, verify_checksum=False, loss_reduction=reduction)


def test_no_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no manifest"):
        PackedIterableDataset(tmp_path)


def test_newer_manifest_version(build):
    path = build.path / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(FormatVersionError, match="upgrade varpack"):
        PackedIterableDataset(build.path)


def test_unexpected_fingerprint_or_tokenizer(build):
    with pytest.raises(ManifestError, match="fingerprint .* differs from the expected 0123456789abcdef"):
        PackedIterableDataset(build.path, expected_fingerprint="0123456789abcdef")
    with pytest.raises(ManifestError, match="tokenizer content hash"):
        PackedIterableDataset(build.path, expected_tokenizer_hash="sha-of-another-tokenizer")
    inputs = build.manifest.inputs
    PackedIterableDataset(
        build.path, expected_fingerprint=build.manifest.fingerprint, expected_tokenizer_hash=inputs.tokenizer.content_hash
    )
    # What `varpack inspect` prints (12 characters) will do; fewer could match another tokenizer by chance.
    full = "0f" * 32
    real = dataclasses.replace(
        build.manifest, inputs=dataclasses.replace(inputs, tokenizer=dataclasses.replace(inputs.tokenizer, content_hash=full))
    )
    check_manifest(real, "build", None, full[:12])
    with pytest.raises(ManifestError, match="the full hash, or its first 12 characters or more"):
        check_manifest(real, "build", None, full[:6])


def test_empty_build(build):
    empty = dataclasses.replace(build.manifest, shards=[], stats=PackingStats())
    write_manifest(empty, build.path)
    with pytest.raises(ManifestError, match="holds no rows"):
        PackedIterableDataset(build.path)


def test_world_larger_than_the_rows(build):
    rows = build.manifest.num_rows
    with pytest.raises(ValueError, match=f"world size {rows + 1} is larger than the {rows} rows"):
        PackedIterableDataset(build.path, rank=0, world_size=rows + 1)
    with pytest.raises(ValueError, match="every rank would get none"):
        PackedIterableDataset(build.path, batch_rows=rows // 2 + 1, rank=0, world_size=2)


def test_bad_batch_settings(build):
    with pytest.raises(ValueError, match="smaller than one row"):
        PackedIterableDataset(build.path, tokens_per_batch=CAPACITY - 1)
    with pytest.raises(ValueError, match="not both"):
        PackedIterableDataset(build.path, batch_rows=2, tokens_per_batch=4 * CAPACITY)
    with pytest.raises(ValueError, match="batch_rows must be a positive integer"):
        PackedIterableDataset(build.path, batch_rows=0)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        PackedIterableDataset(build.path, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        PackedIterableDataset(build.path, rank=0, world_size=0)
    with pytest.raises(ValueError, match="both rank and world_size"):
        PackedIterableDataset(build.path, rank=0)


def test_fixed_shape_refuses_a_wrong_segment_histogram(build):
    stats = dataclasses.replace(build.manifest.stats, segments_per_row={"1": build.manifest.num_rows})
    write_manifest(dataclasses.replace(build.manifest, stats=stats), build.path)
    PackedIterableDataset(build.path)  # only the fixed shape depends on it
    with pytest.raises(ManifestError, match="segments_per_row disagrees"):
        PackedIterableDataset(build.path, pad_to_fixed_shape=True)


def test_checksums_are_verified_once_per_build_on_a_host(build, tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    paths = [build.path / s.path for s in build.manifest.shards]
    assert verify_build(build.manifest, paths).hashed == len(paths)
    assert verify_build(build.manifest, paths).hashed == 0  # recorded: the other ranks and later runs skip the hashing
    PackedIterableDataset(build.path)
    path = shard_file(build, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))  # rewritten since it was recorded, so hashed again
    with pytest.raises(ShardError, match="shard-00001.arrow: checksum mismatch"):
        PackedIterableDataset(build.path)


def test_an_unreadable_verification_record_means_hashing_again(build, tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    paths = [build.path / s.path for s in build.manifest.shards]
    verify_build(build.manifest, paths)
    record_path(build.manifest).write_text("{not json")
    assert verify_build(build.manifest, paths).hashed == len(paths)
    assert verify_build(build.manifest, paths).hashed == 0


def flip_a_byte_in_place(path):
    """Rewrite ``path`` in place, same size, one byte changed (the inode stays)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_shard_rewritten_in_place_after_it_was_opened_is_refused(build, tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    dataset = PackedIterableDataset(build.path, batch_rows=2, shuffle=False)
    batches = iter(dataset)
    next(batches)
    for shard in build.manifest.shards:
        flip_a_byte_in_place(build.path / shard.path)
    with pytest.raises(ShardError, match=r"shard-0000\d.arrow: checksum mismatch \(it was changed on disk since it was verified\)"):
        list(batches)
    # A dataset made before the change, iterated after it, refuses it too (it compares with what it verified).
    with pytest.raises(ShardError, match="changed on disk since it was verified"):
        list(dataset)


def test_dataloader_workers_started_after_a_same_size_overwrite_refuse_the_shard(build, tmp_path, monkeypatch):
    from torch.utils.data import DataLoader

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    dataset = PackedIterableDataset(build.path, batch_rows=2)
    for shard in build.manifest.shards:
        flip_a_byte_in_place(build.path / shard.path)
    # torch re-raises a worker's ShardError as a RuntimeError carrying its message.
    with pytest.raises((ShardError, RuntimeError), match=r"shard-0000\d.arrow: checksum mismatch \(it was changed"):
        list(DataLoader(dataset, batch_size=None, num_workers=1))


def test_a_shard_replaced_by_the_same_bytes_is_read_on(build, tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    expected = [b["input_ids"] for b in PackedIterableDataset(build.path, batch_rows=2, seed=1)]
    dataset = PackedIterableDataset(build.path, batch_rows=2, seed=1)
    for shard in build.manifest.shards:  # as a --force rebuild of the same inputs does: a new file, renamed into place
        path = build.path / shard.path
        shutil.copyfile(path, tmp_path / "copy")
        os.replace(tmp_path / "copy", path)
    got = [b["input_ids"] for b in dataset]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_shard_truncated_while_it_is_read_is_one_error_naming_it_not_sigbus(build):
    script = textwrap.dedent(f"""
        import os
        from loaders import PackedIterableDataset

        batches = iter(PackedIterableDataset({str(build.path)!r}, batch_rows=2, shuffle=False, verify_checksum=False))
        next(batches)
        for name in {[s.path for s in build.manifest.shards]!r}:
            os.truncate(os.path.join({str(build.path)!r}, name), 0)
        for batch in batches:
            pass
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])  # not -7 (SIGBUS; 135 in a shell)
    assert re.search(r"ShardError: \S+/shard-0000\d\.arrow: is 0 bytes, the manifest says \d+: truncated",
                     run.stderr.strip().splitlines()[-1]), run.stderr[-2000:]


def rewrite_first_token(path) -> int:
    """Add 1 to the first token of ``path`` in place (same size, same inode, a valid shard still); the old token."""
    mapped = pa.memory_map(str(path)).read_buffer()
    tokens = pa.ipc.open_file(mapped).read_all().column("input_ids").chunk(0).values
    offset = tokens.buffers()[1].address - mapped.address + tokens.offset * 4
    token = tokens[0].as_py()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.int32(token + 1).tobytes())
    return token


def test_evaluation_refuses_a_shard_edited_in_place_as_training_does(build, tmp_path, monkeypatch):
    from loaders.train.evaluate import packed_batches

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    rewrite_first_token(shard_file(build))
    for read in (lambda: PackedIterableDataset(build.path), lambda: next(packed_batches(build.path, batch_rows=1))):
        with pytest.raises(ShardError, match="shard-00000.arrow: checksum mismatch"):
            read()


def test_a_shard_rewritten_just_after_the_record_vouched_for_it_is_refused(build, tmp_path, monkeypatch):
    """The identity the host's record is compared with is the one the reader checks the file against: a rewrite
    landing between the record's check and the reader's open is hashed, not served."""
    from schemas.verified import VerifiedShards

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    PackedIterableDataset(build.path)  # hashed whole, and recorded on this host
    real_unchanged = VerifiedShards.unchanged

    def unchanged_then_rewritten(record, path, *identity):
        vouched = real_unchanged(record, path, *identity)
        if vouched and path == shard_file(build):
            rewrite_first_token(path)  # another process, just now
        return vouched

    monkeypatch.setattr(VerifiedShards, "unchanged", unchanged_then_rewritten)
    with pytest.raises(ShardError, match=r"shard-00000.arrow: checksum mismatch \(it was changed on disk since it was verified\)"):
        PackedIterableDataset(build.path)


def test_a_fifo_at_a_shards_name_is_refused_not_waited_on(build, tmp_path, monkeypatch, capsys):
    """Opening a FIFO waits for a writer for ever; every reader refuses one in one line naming it instead."""
    import threading

    from loaders.train.evaluate import packed_batches
    from pipeline import inspect

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    path = shard_file(build, 1)
    path.unlink()
    os.mkfifo(path)

    @contextlib.contextmanager
    def not_waited_on() -> Iterator[None]:
        waited = threading.Event()

        def unblock() -> None:  # a reader waiting on the FIFO goes on, and the test fails instead of hanging
            waited.set()
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

        timer = threading.Timer(20, unblock)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        assert not waited.is_set(), "the reader waited on the FIFO"

    refused = r"shard-00001.arrow: .*\(.*it is a FIFO, not a regular file"
    for read in (lambda: PackedIterableDataset(build.path), lambda: PackedIterableDataset(build.path, verify_checksum=False),
                 lambda: list(packed_batches(build.path, batch_rows=1))):
        with not_waited_on(), pytest.raises(ShardError, match=refused):
            read()
    with not_waited_on():
        assert inspect.main([str(build.path), "--rows", "20", "--ids"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(refused, line), line


def test_a_forged_rows_per_shard_is_one_line_naming_the_manifest(build):
    """A manifest re-laid-out with its digests recomputed (so only its bounds stop it) is refused naming the field,
    not deep in the shuffle with numpy's error."""
    from schemas.manifest import manifest_digest, shards_digest

    path = build.path / "manifest.json"
    data = json.loads(path.read_text())
    data["rows_per_shard"] = 2**62
    data["shards_digest"] = shards_digest(data["shards"])
    data["manifest_digest"] = manifest_digest(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"manifest.json: field rows_per_shard must be at most 2147483647, got 4611"):
        next(iter(PackedIterableDataset(build.path, batch_rows=1)))
