"""A shared ``--out`` or cache directory is hostile: no file varpack writes there follows a link it did not make.

Each test plants a link (or a file) at a name varpack uses in a shared place, pointing at a
victim file of the user's, and checks that varpack leaves the victim as it was and refuses in
one line naming the planted path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loaders import PackedIterableDataset
from pipeline import pack, storage
from pipeline.build import plan_build
from pipeline.config import PackConfig
from pipeline.write.lock import lock_path
from schemas import LinkError, WriteError, atomic_output
from schemas.verified import record_path
from tests.test_faults import ARGS, RECORDS

VICTIM_TEXT = "the user's own file, which nothing may change\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:300]))
    return path


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def build_dir(data: Path, out: Path) -> Path:
    """The build directory ``pack`` uses for ``data`` in ``out``: its name, and so its lock's, is predictable."""
    config = PackConfig(dataset=str(data), out=str(out), prompt_column="prompt", response_column="answer", max_len=256,
                        batch_size=256, progress=False)
    return Path(plan_build(config).out_dir)


def pack_error(data: Path, out: Path, capsys) -> str:
    """Run pack into ``out``; it must fail in one line, which is returned."""
    assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_planted_at_the_lock_path_is_refused_and_its_target_left_alone(data, tmp_path, victim, capsys, link):
    out = tmp_path / "shared-out"
    out.mkdir()
    lock = lock_path(str(build_dir(data, out)))
    (os.symlink if link == "symbolic" else os.link)(victim, lock)
    line = pack_error(data, out, capsys)
    assert line.startswith(f"varpack: error: {lock}: is a {link} link, which varpack did not make"), line
    assert victim.read_text() == VICTIM_TEXT
    assert not build_dir(data, out).exists() or not any(build_dir(data, out).iterdir())


def test_a_build_directory_planted_as_a_link_is_refused_and_its_target_left_alone(data, tmp_path, victim, capsys):
    out = tmp_path / "shared-out"
    out.mkdir()
    elsewhere = tmp_path / "users-empty-directory"
    elsewhere.mkdir()
    os.symlink(elsewhere, build_dir(data, out))
    line = pack_error(data, out, capsys)
    assert line.startswith(f"varpack: error: {build_dir(data, out)}: is a symbolic link, which varpack did not make")
    assert list(elsewhere.iterdir()) == [], "nothing may be written where the link points"


def test_a_temporary_file_is_made_new_so_a_link_at_its_name_is_not_followed(tmp_path, victim, monkeypatch):
    # Temporary names are random; were one guessed, the link planted there is refused, not written through.
    planted = tmp_path / ".shard-00000.arrow.tmp-1-guessed"
    os.symlink(victim, planted)
    monkeypatch.setattr("schemas.io.temporary_name", lambda path: planted)
    with pytest.raises(WriteError, match=r"shard-00000.arrow: could not be written \(File exists\)"):
        with atomic_output(tmp_path / "shard-00000.arrow") as tmp:
            tmp.write_text("shard bytes")
    assert victim.read_text() == VICTIM_TEXT
    assert not (tmp_path / "shard-00000.arrow").exists()


def test_scratch_files_are_written_only_in_a_directory_of_the_users_alone(tmp_path, victim):
    spill_dir = tmp_path / ".spill-0123456789ab"
    spill_dir.mkdir(mode=0o700)
    os.symlink(victim, spill_dir / "batch-0.arrow")
    with pytest.raises(LinkError, match=r"batch-0.arrow: is a symbolic link, which varpack did not make"):
        storage.write_scratch(str(spill_dir / "batch-0.arrow"), lambda local: Path(local).write_text("tokens"))

    open_dir = tmp_path / ".spill-open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(LinkError, match=r"\.spill-open: is not a directory of this user's alone"):
        storage.write_scratch(str(open_dir / "batch-0.arrow"), lambda local: Path(local).write_text("tokens"))

    linked_dir = tmp_path / ".spill-linked"
    os.symlink(tmp_path, linked_dir)
    with pytest.raises(LinkError, match=r"\.spill-linked: is a symbolic link"):
        storage.write_scratch(str(linked_dir / "victim.txt"), lambda local: Path(local).write_text("tokens"))
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("planted", ["record", "lock"])
def test_a_link_planted_at_the_verification_record_is_refused(tmp_path, victim, monkeypatch, planted):
    from shard_factory import build_shard_dir

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    build = build_shard_dir(tmp_path / "build", [10, 20, 30, 40], capacity=64)
    path = record_path(build.manifest)
    path = path if planted == "record" else path.with_suffix(".lock")
    path.parent.mkdir(parents=True)
    os.symlink(victim, path)
    with pytest.raises(LinkError, match=f"{path}: is a symbolic link, which varpack did not make"):
        PackedIterableDataset(build.path)
    assert victim.read_text() == VICTIM_TEXT


def test_links_planted_in_the_cache_of_remote_builds_are_neither_served_nor_written_through(tmp_path, victim):
    import fsspec
    import torch
    from shard_factory import build_shard_dir

    from loaders.remote import cache_name

    build = build_shard_dir(tmp_path / "build", [10, 20, 30, 40] * 4, capacity=64, rows_per_shard=2)
    url = f"memory://build-{tmp_path.name}"
    for path in build.path.iterdir():
        fsspec.filesystem("memory").pipe_file(f"{url.removeprefix('memory://')}/{path.name}", path.read_bytes())
    expected = [b["input_ids"] for b in PackedIterableDataset(build.path, batch_rows=2, seed=3)]
    cache = tmp_path / "cache"
    shard = build.manifest.shards[0]
    other = tmp_path / "same-size-other-bytes.arrow"
    other.write_bytes(bytes(shard.bytes))
    (cache / cache_name(build.manifest)).mkdir(parents=True)
    os.symlink(other, cache / cache_name(build.manifest) / shard.path)
    got = [b["input_ids"] for b in PackedIterableDataset(url, batch_rows=2, seed=3, cache_dir=cache, verify_checksum=False)]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert other.read_bytes() == bytes(shard.bytes)

    linked = tmp_path / "linked-cache"
    linked.mkdir()
    os.symlink(victim.parent, linked / cache_name(build.manifest))
    with pytest.raises(LinkError, match=f"{linked / cache_name(build.manifest)}: is a symbolic link"):
        PackedIterableDataset(url, cache_dir=linked)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
