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


@pytest.mark.parametrize("planted_by", ["another user", "the user, open to all"])
def test_a_build_directory_another_user_made_or_others_can_write_is_refused(data, tmp_path, capsys, planted_by):
    """Its name is predictable: whoever made it first may replace any file in it, the temporary file between its
    creation and its write included, sticky ``--out`` or not. So pack writes only into a directory of its user's
    that nobody else can write into."""
    if planted_by == "another user" and os.getuid() != 0:
        pytest.skip("making a directory of another user's needs root")
    out = tmp_path / "shared-out"
    out.mkdir()
    out.chmod(0o1777)
    planted = build_dir(data, out)
    planted.mkdir()
    planted.chmod(0o777)
    if planted_by == "another user":
        os.chown(planted, 65534, 65534)
    line = pack_error(data, out, capsys)
    whose = "another user's" if planted_by == "another user" else "one others can write into"
    assert line.startswith(f"varpack: error: {planted}: is not a directory of this user's alone ({whose})"), line
    assert list(planted.iterdir()) == []


def test_a_temporary_file_swapped_for_a_link_is_not_written_through(tmp_path, victim, monkeypatch):
    """A shard is written and hashed through the descriptor that made its temporary file new, never reopened by
    name; one swapped for a link meanwhile (by whoever may replace files in the directory) is refused."""
    import contextlib

    import pyarrow as pa

    from pipeline.write import shard_writer
    from schemas import ROW_SCHEMA
    from schemas.shard_identity import ShardIdentity

    real_atomic_file = shard_writer.atomic_file

    @contextlib.contextmanager
    def swapped(path):
        with real_atomic_file(path) as file:
            (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".shard-00000.arrow.tmp-")]
            tmp.unlink()
            os.symlink(victim, tmp)  # just after its creation, before anything is written
            yield file

    monkeypatch.setattr(shard_writer, "atomic_file", swapped)
    row = {"input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]], "cu_seqlens": [[0, 3]], "max_seqlen": [3],
           "num_tokens": [3], "example_ids": [[0]], "example_offsets": [[0]]}
    table = pa.Table.from_pydict(row, ROW_SCHEMA)
    with pytest.raises(LinkError, match=r"\.shard-00000\.arrow\.tmp-\S+: is no longer the temporary file varpack made"):
        shard_writer.write_shard(table, tmp_path, "shard-00000.arrow", 8, ShardIdentity("0" * 16, 0, True))
    assert victim.read_text() == VICTIM_TEXT
    assert not (tmp_path / "shard-00000.arrow").exists()


def test_a_link_planted_at_the_build_directory_after_the_lock_is_taken_is_refused(data, tmp_path, capsys, monkeypatch):
    """Nothing is deleted or written through a link planted at the build directory once the lock is held: the
    directory is checked (made, if missing) just before the first file in it is removed or written."""
    import pipeline.build

    out = tmp_path / "shared-out"
    out.mkdir()
    out.chmod(0o1777)
    elsewhere = tmp_path / "victims-directory"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("the manifest of another project\n")
    (elsewhere / "shard-00000.arrow").write_text("a shard of another project\n")
    real_check_output = pipeline.build.check_output

    def planted_then_checked(plan, log):
        if not os.path.lexists(plan.out_dir):
            os.symlink(elsewhere, plan.out_dir)  # another user, right after the lock was taken
        return real_check_output(plan, log)

    monkeypatch.setattr(pipeline.build, "check_output", planted_then_checked)
    line = pack_error(data, out, capsys)
    assert line.startswith(f"varpack: error: {build_dir(data, out)}: is a symbolic link, which varpack did not make")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["manifest.json", "shard-00000.arrow"]
    assert (elsewhere / "manifest.json").read_text() == "the manifest of another project\n"
    assert (elsewhere / "shard-00000.arrow").read_text() == "a shard of another project\n"


def test_a_link_planted_on_a_shards_subdirectory_in_the_cache_of_remote_builds_is_not_written_through(tmp_path, victim):
    import fsspec
    from shard_factory import build_shard_dir

    from loaders.remote import cache_name
    from schemas.manifest import manifest_digest, shards_digest

    build = build_shard_dir(tmp_path / "build", [10, 20, 30, 40], capacity=64)
    manifest = json.loads((build.path / "manifest.json").read_text())
    manifest["shards"][0]["path"] = f"sub/{victim.name}"  # the schema allows a directory part
    manifest["shards_digest"] = shards_digest(manifest["shards"])
    manifest["manifest_digest"] = manifest_digest(manifest)
    url = f"memory://build-{tmp_path.name}"
    memory = fsspec.filesystem("memory")
    memory.pipe_file(f"{url.removeprefix('memory://')}/manifest.json", json.dumps(manifest).encode())
    memory.pipe_file(f"{url.removeprefix('memory://')}/sub/{victim.name}", (build.path / build.manifest.shards[0].path).read_bytes())
    from loaders.remote import locate

    cache = tmp_path / "shared-cache" / cache_name(locate(url).read_manifest())
    cache.mkdir(parents=True)
    os.symlink(victim.parent, cache / "sub")
    with pytest.raises(LinkError, match=f"{cache / 'sub'}: is a symbolic link, which varpack did not make"):
        PackedIterableDataset(url, cache_dir=tmp_path / "shared-cache")
    assert victim.read_text() == VICTIM_TEXT
    memory.rm(url.removeprefix("memory://"), recursive=True)


def test_a_write_stopped_by_a_planted_link_names_the_link(tmp_path):
    from schemas.io import fsync_path, write_error

    planted = tmp_path / "build"
    os.symlink(tmp_path, planted)
    with pytest.raises(OSError) as stopped:
        fsync_path(planted)  # as the atomic write does to the directory it wrote into
    error = write_error(planted / "shard-00000.arrow", stopped.value)
    assert isinstance(error, LinkError)
    assert str(error).startswith(f"{planted}: is a symbolic link, which varpack did not make"), error
