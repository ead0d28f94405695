"""Faults a careful user meets: concurrent runs of one build, Ctrl-C, kill -9, a full disk, a
corrupted shard, a reordered manifest. Each test is bounded in time; the runs are real pack
commands on a small JSON lines file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from loaders import PackedIterableDataset
from pipeline import pack
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.errors import OutputDirError
from pipeline.write.lock import build_lock, lock_path
from schemas import MANIFEST_NAME, ManifestError, ShardError, WriteError, read_manifest
from schemas.manifest import manifest_digest, shards_digest
from tests.test_pipeline_e2e import REPO
from tests.url_filesystem import PREFIX

RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i * 7}?", "answer": f"The sum is {i + i * 7}. " * (1 + i % 5)}
           for i in range(3000)]
ARGS = ["--prompt-column", "prompt", "--response-column", "answer", "--max-len", "256", "--batch-size", "256",
        "--no-progress"]
# Exit status 130, or an end by SIGINT, which a shell reports as 130 too: the interpreter sometimes ends
# that way after pack has printed "interrupted" and returned 130.
INTERRUPTED = (130, -signal.SIGINT)
INTERRUPTED_LINE = "varpack: interrupted; the next run starts the build again"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def config(data: Path, out: Path | str, **changes) -> PackConfig:
    return PackConfig(dataset=str(data), out=str(out), prompt_column="prompt", response_column="answer", max_len=256,
                      batch_size=256, progress=False, **changes)


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> Callable[..., Path]:
    """``finished(out, **changes)``: the build of ``config(data, out, **changes)`` finished in ``out``, as ``build``
    leaves it; a copy of one packed once per module for each set of changes, since the tests damage theirs."""
    packed: dict[tuple, Path] = {}

    def copy(out: Path, **changes) -> Path:
        key = tuple(sorted(changes.items()))
        if key not in packed:
            packed[key] = Path(build(config(data, tmp_path_factory.mktemp("finished"), **changes)).out_dir)
        out_dir = out / packed[key].name
        shutil.copytree(packed[key], out_dir)
        return out_dir

    return copy


class Run:
    """A ``python -m pipeline.pack`` process, its stdout and stderr in files."""

    def __init__(self, data: Path, out: Path, name: str, *extra: str, max_file_bytes: int | None = None,
                 own_group: bool = False):
        self.stdout, self.stderr = out.parent / f"{name}.out", out.parent / f"{name}.err"
        limit = None if max_file_bytes is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes,) * 2)
        with open(self.stdout, "w") as stdout, open(self.stderr, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.pack", "--dataset", str(data), "--out", str(out), *ARGS, *extra],
                cwd=out.parent, env=ENV, stdout=stdout, stderr=stderr, preexec_fn=limit, start_new_session=own_group,
            )

    def err(self) -> str:
        return self.stderr.read_text()

    def out(self) -> str:
        return self.stdout.read_text()

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout)


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def holds_lock(out: Path, run: Run) -> bool:
    return any(f'"pid": {run.proc.pid}' in p.read_text() for p in out.glob(".*.lock"))


def shard_bytes(out_dir: str | Path) -> list[bytes]:
    manifest = read_manifest(out_dir)
    return [(Path(out_dir) / s.path).read_bytes() for s in manifest.shards]


def assert_verified(out_dir: str | Path) -> None:
    """The build is complete: every shard passes its checksum through the loader."""
    dataset = PackedIterableDataset(out_dir, batch_rows=1, verify_checksum=True)
    assert len(list(dataset)) == dataset.manifest.num_rows


def test_two_runs_started_together_build_once_and_both_succeed(data, tmp_path):
    out = tmp_path / "out"
    runs = [Run(data, out, "a"), Run(data, out, "b")]
    assert [r.wait() for r in runs] == [0, 0], [r.err() for r in runs]
    verbs = sorted(r.out().split()[1] for r in runs)
    assert verbs == ["reusing", "wrote"], [r.out() for r in runs]
    (build_dir,) = [p for p in out.iterdir() if p.is_dir()]
    assert_verified(build_dir)
    assert sorted(p.name for p in out.iterdir()) == [build_dir.name]  # no lock left behind


def test_a_second_run_waits_for_a_stopped_first_then_reuses_its_build(data, tmp_path):
    out = tmp_path / "out"
    first = Run(data, out, "first")
    wait_for(lambda: holds_lock(out, first), "the first run to take the lock")
    first.proc.send_signal(signal.SIGSTOP)
    try:
        second = Run(data, out, "second")
        wait_for(lambda: "waiting for" in second.err(), "the second run to wait")
        assert f"pid {first.proc.pid} on " in second.err()
        time.sleep(1)
        assert second.proc.poll() is None, second.err()  # still waiting: it deleted nothing
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert first.wait() == 0, first.err()
    assert second.wait() == 0, second.err()
    assert first.out().startswith("varpack: wrote") and second.out().startswith("varpack: reusing")
    assert_verified(plan_build(config(data, out)).out_dir)


def test_a_waiting_run_gives_up_naming_the_owner(data, tmp_path):
    out = tmp_path / "out"
    out_dir = plan_build(config(data, out)).out_dir
    with build_lock(out_dir, None, lambda _: None):
        run = Run(data, out, "late", "--lock-timeout", "0.5")
        assert run.wait() == 1
    (line,) = run.err().splitlines()[-1:]
    assert line.startswith(f"varpack: error: {out_dir} is being built by pid {os.getpid()} on ")
    assert "raise --lock-timeout" in line


def test_runs_checking_a_finished_build_share_the_lock(data, finished, tmp_path):
    out = tmp_path / "out"
    out_dir = str(finished(out))
    Path(lock_path(out_dir)).write_text("")  # the lock file exists while runs come and go
    with build_lock(out_dir, None, lambda _: None, shared=True):  # another run checking it for reuse
        assert build(config(data, out, lock_timeout=0.5)).reused  # checks it alongside
        with pytest.raises(OutputDirError, match=f"^{out_dir} is being built by another run"):
            build(config(data, out, lock_timeout=0.5, force=True))  # a rebuild waits for the readers


def test_a_lock_left_by_a_killed_run_is_taken_over(data, tmp_path):
    out = tmp_path / "out"
    out_dir = plan_build(config(data, out)).out_dir
    out.mkdir()
    Path(lock_path(out_dir)).write_text('{"host": "node-7", "pid": 999999, "started_at": "2026-01-01T00:00:00+00:00"}\n')
    messages: list[str] = []
    result = build(config(data, out), log=messages.append)
    assert not result.reused
    assert any("taking over" in m and "pid 999999 on node-7" in m for m in messages), messages
    assert not Path(lock_path(out_dir)).exists()


def test_an_interrupted_second_run_keeps_the_finished_first(data, finished, tmp_path):
    out = tmp_path / "out"
    out_dir = str(finished(out))
    expected = shard_bytes(out_dir)
    # A run that waits for the lock, and one that rebuilds in place with --force, both stopped by Ctrl-C.
    with build_lock(out_dir, None, lambda _: None):
        waiting = Run(data, out, "waiting")
        wait_for(lambda: "waiting for" in waiting.err(), "the run to wait")
        waiting.proc.send_signal(signal.SIGINT)
        assert waiting.wait() in INTERRUPTED
        assert "varpack: interrupted" in waiting.err()
    forced = Run(data, out, "forced", "--force")
    wait_for(lambda: "packing" in forced.err(), "the forced run to start packing")
    forced.proc.send_signal(signal.SIGINT)
    # On a loaded machine the run may finish before the signal lands; it then exits as usual.
    assert forced.wait() in INTERRUPTED or forced.out().startswith("varpack: wrote"), (forced.err(), forced.out())
    assert shard_bytes(out_dir) == expected
    messages: list[str] = []
    assert build(config(data, out), log=messages.append).reused, messages


def test_sigint_exits_130_saying_interrupted_and_leaves_nothing(data, tmp_path):
    out = tmp_path / "out"
    run = Run(data, out, "run")
    wait_for(lambda: "packing" in run.err(), "the run to start packing")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() in INTERRUPTED
    lines = run.err().splitlines()
    assert lines[-1] == INTERRUPTED_LINE, run.err()
    assert not any("Traceback" in line for line in lines)
    assert [p.name for p in out.iterdir()] == []


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches the libraries the process loads through /proc")
def test_sigint_while_starting_up_is_one_line_and_exits_130(data, tmp_path):
    out = tmp_path / "out"
    run = Run(data, out, "starting")
    maps = Path(f"/proc/{run.proc.pid}/maps")
    wait_for(lambda: "libarrow" in maps.read_text(), "the run to load pyarrow", timeout=30)  # still importing
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.err()
    assert run.err().splitlines() == [INTERRUPTED_LINE]
    assert not out.exists() or list(out.iterdir()) == []


def test_ctrl_c_in_a_terminal_stops_a_multi_process_run_in_one_line(data, tmp_path):
    """A terminal sends Ctrl-C to the whole process group: the workers too, which Beam then reports."""
    out = tmp_path / "out"
    run = Run(data, out, "group", "--direct_running_mode=multi_processing", "--direct_num_workers=2", own_group=True)
    wait_for(lambda: any(out.glob("*/.spill-*/*.arrow")), "the workers to write", timeout=120)
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.wait() == 130, run.err()
    assert run.err().splitlines()[1:] == [INTERRUPTED_LINE], run.err()
    assert [p.name for p in out.iterdir()] == []


def test_kill_9_then_a_rerun_gives_the_same_shards(data, finished, tmp_path):
    clean = finished(tmp_path / "clean")
    out = tmp_path / "out"
    run = Run(data, out, "killed")
    wait_for(lambda: "packing" in run.err(), "the run to start packing")
    run.proc.kill()
    run.wait()
    rerun = build(config(data, out))
    assert shard_bytes(rerun.out_dir) == shard_bytes(clean)
    assert sorted(p.name for p in Path(rerun.out_dir).iterdir()) == sorted(
        [MANIFEST_NAME] + [s.path for s in rerun.manifest.shards]
    )


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker processes through /proc")
def test_workers_exit_when_the_main_process_is_killed(data, tmp_path):
    out = tmp_path / "out"
    run = Run(data, out, "multi", "--direct_running_mode=multi_processing", "--direct_num_workers=2")
    wait_for(lambda: any(out.glob("*/.spill-*/*.arrow")), "the workers to write", timeout=120)
    time.sleep(0.5)  # into the later steps too, which no step of varpack's own starts
    workers = children(run.proc.pid)
    workers += [worker for shell in workers for worker in children(shell)]  # Beam starts them through a shell
    assert len(workers) >= 2
    run.proc.kill()
    run.wait()
    wait_for(lambda: not any(alive(w) for w in workers), "the orphaned workers to exit", timeout=1)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker process through /proc")
def test_a_worker_ends_with_the_command_from_its_first_import(tmp_path):
    """Beam may first give a worker a step with no varpack code of its own to run: importing pipeline
    is enough for it to end with the command."""
    command, worker = tmp_path / "command.py", tmp_path / "worker.py"
    command.write_text("import os, subprocess, sys, time\n"
                       "os.environ['VARPACK_PACK_PID'] = str(os.getpid())\n"
                       "subprocess.Popen(f'{sys.executable} {sys.argv[1]}', shell=True)  # through a shell, as Beam does\n"
                       "time.sleep(60)\n")
    worker.write_text("import time\nimport pipeline\nprint('ready', flush=True)\ntime.sleep(60)\n")
    run = subprocess.Popen([sys.executable, str(command), str(worker)], env=ENV, stdout=subprocess.PIPE, text=True)
    started = []
    try:
        assert run.stdout.readline() == "ready\n"
        started = [w for shell in children(run.pid) for w in [shell, *children(shell)]]
        run.kill()
        run.wait()
        wait_for(lambda: not any(alive(w) for w in started), "the worker to end with the command", timeout=1)
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_corrupted_shard_is_rebuilt_on_reuse(data, finished, tmp_path):
    out_dir = finished(tmp_path / "out", rows_per_shard=40)
    shard = out_dir / read_manifest(out_dir).shards[1].path
    expected = shard.read_bytes()
    corrupt = bytearray(expected)
    corrupt[len(corrupt) // 2] ^= 0xFF
    shard.write_bytes(bytes(corrupt))
    with pytest.raises(ShardError, match=r"checksum mismatch: .* \(run the pack command that made it again\)"):
        PackedIterableDataset(out_dir, batch_rows=1)
    messages: list[str] = []
    again = build(config(data, tmp_path / "out", rows_per_shard=40), log=messages.append)
    assert not again.reused
    assert f"rebuilding {out_dir}: {shard.name} fails its checksum (the file is corrupt)" in messages
    assert shard.read_bytes() == expected
    assert build(config(data, tmp_path / "out", rows_per_shard=40)).reused


def test_reuse_hashes_a_build_once_per_host_and_the_loader_shares_the_record(data, finished, tmp_path, monkeypatch):
    """Every node of a job runs pack before training: only the first check of a build on a host hashes it;
    a shard rewritten since (even with the same bytes) is hashed again, and a corrupt one still caught."""
    from pipeline.write import build_dir
    from loaders.verify import verify_build

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    hashed: list[int] = []
    real_sha256 = build_dir.stream_sha256
    monkeypatch.setattr(build_dir, "stream_sha256", lambda f: hashed.append(1) or real_sha256(f))

    def reuse() -> int:
        hashed.clear()
        assert build(config(data, tmp_path / "out", rows_per_shard=40)).reused
        return len(hashed)

    out_dir = finished(tmp_path / "out", rows_per_shard=40)
    manifest = read_manifest(out_dir)
    shards = [out_dir / info.path for info in manifest.shards]
    assert len(shards) > 2
    assert reuse() == len(shards)
    assert reuse() == 0
    assert verify_build(manifest, shards).hashed == 0  # the loader finds pack's record
    shards[1].write_bytes(shards[1].read_bytes())
    assert reuse() == 1
    corrupt = bytearray(shards[2].read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    shards[2].write_bytes(bytes(corrupt))
    messages: list[str] = []
    assert not build(config(data, tmp_path / "out", rows_per_shard=40), log=messages.append).reused
    assert f"rebuilding {out_dir}: {shards[2].name} fails its checksum (the file is corrupt)" in messages


def test_a_shard_rewritten_while_pack_hashes_it_is_never_recorded_as_verified(data, finished, tmp_path, monkeypatch):
    """Pack's reuse check takes a shard's identity before hashing it: a rewrite landing once the hash has read the
    bytes fails the check (and the build is rebuilt), instead of being recorded, and then served, as verified."""
    from pipeline.write import build_dir
    from tests.test_loader_errors import rewrite_first_token

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    out_dir = finished(tmp_path / "out", rows_per_shard=40)
    shard = out_dir / read_manifest(out_dir).shards[0].path
    expected = shard.read_bytes()
    real_sha256 = build_dir.stream_sha256
    rewritten: list[int] = []

    def hash_then_rewritten(f) -> str:
        digest = real_sha256(f)
        if not rewritten and os.fstat(f.fileno()).st_ino == shard.stat().st_ino:
            rewritten.append(rewrite_first_token(shard))  # another process, once the hash has read the bytes
        return digest

    monkeypatch.setattr(build_dir, "stream_sha256", hash_then_rewritten)
    messages: list[str] = []
    assert not build(config(data, tmp_path / "out", rows_per_shard=40), log=messages.append).reused
    # The check that met the rewrite refused it (and so the next one finds the rewritten bytes failing the checksum).
    assert rewritten and f"rebuilding {out_dir}: {shard.name} fails its checksum (the file is corrupt)" in messages
    assert shard.read_bytes() == expected
    monkeypatch.setattr(build_dir, "stream_sha256", real_sha256)
    assert int(next(iter(PackedIterableDataset(out_dir, batch_rows=1, shuffle=False)))["input_ids"][0, 0]) == rewritten[0]


def test_swapped_manifest_entries_are_refused(data, finished, tmp_path):
    out_dir = finished(tmp_path / "out", rows_per_shard=40)
    path = out_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["shards"][0], manifest["shards"][1] = manifest["shards"][1], manifest["shards"][0]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="the shard list does not match shards_digest"):
        PackedIterableDataset(out_dir, batch_rows=1)
    manifest["shards"][1] = manifest["shards"][0]  # one shard twice, the stats made to agree
    manifest["stats"]["rows"] = sum(s["rows"] for s in manifest["shards"])
    manifest["stats"]["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="the shard list does not match shards_digest"):
        PackedIterableDataset(out_dir, batch_rows=1)
    messages: list[str] = []
    assert not build(config(data, tmp_path / "out", rows_per_shard=40), log=messages.append).reused
    assert any("its manifest is unreadable" in m for m in messages), messages


def test_a_full_disk_while_writing_the_manifest_names_it_and_leaves_nothing(data, tmp_path, monkeypatch, capsys):
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(dst) == MANIFEST_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    out_dir = plan_build(config(data, out)).out_dir
    with pytest.raises(WriteError, match=rf"^{out_dir}/{MANIFEST_NAME}: could not be written \(No space left on device\)"):
        build(config(data, out))
    assert list(out.iterdir()) == []
    code = pack.main(["--dataset", str(data), "--out", str(out), *ARGS])
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    assert code == 1
    assert line.startswith(f"varpack: error: {out_dir}/{MANIFEST_NAME}: could not be written (No space left on device)")
    assert list(out.iterdir()) == []


def test_writing_into_a_missing_directory_names_the_directory_not_the_disk(tmp_path):
    """A file written into a directory that does not exist is refused naming that directory, not as a full disk."""
    from schemas import atomic_output, atomic_write

    missing = tmp_path / "removed" / "build"
    refused = rf"^{missing}/{MANIFEST_NAME}: could not be written: the directory {missing} does not exist; make it or " \
              r"write elsewhere, then run again$"
    with pytest.raises(WriteError, match=refused):
        atomic_write(missing / MANIFEST_NAME, "{}")
    with pytest.raises(WriteError, match=refused), atomic_output(missing / MANIFEST_NAME, directory=True):
        pass
    assert list(tmp_path.iterdir()) == []


def test_an_out_through_a_dangling_link_names_the_link_and_its_target(data, tmp_path, capsys):
    """--out at, or under, a symbolic link to a directory that is gone: one line naming the link and its target, not
    a missing directory to make or a full disk; nothing is made at the target."""
    target = tmp_path / "moved-away"
    (tmp_path / "link").symlink_to("moved-away")  # relative: the target is read from the link's directory
    (tmp_path / "chain").symlink_to("link")  # a link to the dangling link: the message names where the chain ends
    for out, link in ((tmp_path / "link" / "builds", "link"), (tmp_path / "link", "link"), (tmp_path / "chain", "chain")):
        assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 1
        (line,) = capsys.readouterr().err.splitlines()[-1:]
        assert line.startswith(f"varpack: error: {out}"), line
        assert line.endswith(f"could not be written: {tmp_path / link} is a dangling symbolic link, leading to {target}, "
                             f"which does not exist; make {target} or point the link elsewhere, then run again"), line
    assert not target.exists()
    (tmp_path / "loop").symlink_to("loop")
    assert pack.main(["--dataset", str(data), "--out", str(tmp_path / "loop"), *ARGS]) == 1
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"{tmp_path / 'loop'} is a symbolic link loop; remove it or point it at a directory, then run again")


def test_an_out_going_up_through_a_link_is_locked_where_the_build_is(data, tmp_path, monkeypatch):
    """--out LINK/../x builds beside the link's target, as the filesystem resolves '..'; its lock is taken there
    too, so a run naming the real directory waits on the same lock, and no directory is made where the path reads."""
    (tmp_path / "real" / "dir").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    Path("dl").symlink_to("real/dir")
    assert pack.main(["--dataset", str(data), "--out", "dl/../x", *ARGS]) == 0
    (build,) = [path for path in (tmp_path / "real" / "x").iterdir() if path.is_dir()]
    assert Path(lock_path(f"dl/../x/{build.name}")).resolve() == Path(lock_path(str(build))).resolve()
    assert not (tmp_path / "x").exists()


def test_an_out_under_a_link_loop_names_the_loop(data, tmp_path, capsys):
    """--out at, or under, a chain of links that leads back into itself: one line naming the loop, whichever link of
    it --out names, never a link varpack refuses to write through."""
    (tmp_path / "la").symlink_to("lb")
    (tmp_path / "lb").symlink_to("la")
    for out in (tmp_path / "la", tmp_path / "la" / "sub", tmp_path / "lb" / "sub" / "deeper"):
        assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 1
        (line,) = capsys.readouterr().err.splitlines()[-1:]
        assert line == (f"varpack: error: {out}: could not be written: {tmp_path / out.relative_to(tmp_path).parts[0]} is a "
                        "symbolic link loop; remove it or point it at a directory, then run again"), line
    assert sorted(p.name for p in tmp_path.iterdir() if p != data) == ["la", "lb"]


def test_an_out_that_is_or_is_under_a_file_says_so(data, tmp_path, capsys):
    """--out naming a file, a link to a file or a path under a file: one line saying it is a file, not a directory,
    never a full disk or permissions; the file is left as it was."""
    (tmp_path / "afile").write_text("kept\n")
    (tmp_path / "tofile").symlink_to("afile")
    for out, *what in ((tmp_path / "afile", tmp_path / "afile", "a file"),
                      (tmp_path / "tofile", tmp_path / "tofile", f"a symbolic link to the file {tmp_path / 'afile'}"),
                      (tmp_path / "afile" / "sub", tmp_path / "afile", "a file"),
                      (tmp_path / "tofile" / "sub", tmp_path / "tofile", f"a symbolic link to the file {tmp_path / 'afile'}")):
        assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 1
        (line,) = capsys.readouterr().err.splitlines()[-1:]
        assert line == (f"varpack: error: {out}: could not be written: {what[0]} is {what[1]}, not a directory; write "
                        "elsewhere, or move it away, then run again"), line
    assert (tmp_path / "afile").read_text() == "kept\n"


def test_a_full_disk_in_a_worker_process_is_one_line_naming_the_file(data, tmp_path):
    out = tmp_path / "out"
    # Files over 100 KB cannot be written (EFBIG): a worker's spill or shard file fails.
    run = Run(data, out, "limited", "--direct_running_mode=multi_processing", "--direct_num_workers=2",
              max_file_bytes=100_000)
    assert run.wait() == 1
    lines = run.err().splitlines()
    assert len(lines) == 2 and lines[0].startswith("varpack: packing"), run.err()
    assert lines[1].startswith(f"varpack: error: {plan_build(config(data, out)).out_dir}/"), lines[1]
    assert "could not be written (" in lines[1] and "File too large" in lines[1]
    assert [p.name for p in out.iterdir()] == []


def test_runs_at_a_url_write_attempt_directories_and_the_first_manifest_wins(data, tmp_path):
    url = f"{PREFIX}{tmp_path / 'bucket'}"
    code = ("import sys, tests.url_filesystem; from pipeline.pack import main; "
            f"sys.exit(main({['--dataset', str(data), '--out', url, *ARGS]!r}))")
    runs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    (build_dir,) = (tmp_path / "bucket").iterdir()
    manifest = read_manifest(build_dir)
    (attempt,) = {s.path.split("/")[0] for s in manifest.shards}
    assert attempt.startswith("attempt-") and not (build_dir / f".{build_dir.name}.lock").exists()
    # A run that found another's manifest published first removed its own attempt directory.
    losers = sum("another run published" in err for _, err in outputs)
    # A run that lost says it uses the other's build, never that it wrote one.
    assert all(out.startswith("varpack: reusing ") for out, err in outputs if "another run published" in err), outputs
    # A store has no directories: a prefix is there only while it holds files.
    written = [p.name for p in build_dir.glob("attempt-*") if any(f.is_file() for f in p.rglob("*"))]
    assert attempt in written and len(written) == 2 - losers, (written, outputs)
    assert_verified(build_dir)
    again = build(config(data, url))  # a later run reuses the published build
    assert again.reused and again.manifest.shards == manifest.shards



def test_a_reused_build_is_left_as_clean_as_a_fresh_one(data, finished, tmp_path):
    """A run killed just after its manifest appeared leaves its spill directory, a killed --force run its
    temporary shards; the next run that reuses the build removes them, holding the build's lock alone."""
    out = tmp_path / "out"
    out_dir = finished(out)
    fresh = sorted(p.name for p in out_dir.iterdir())
    spill = out_dir / ".spill-0123456789ab"
    spill.mkdir()
    (spill / "0-0.arrow").write_bytes(b"\0" * 4096)
    (out_dir / ".shard-00000.arrow.tmp-4242-0badc0de").write_bytes(b"half a shard")
    (out_dir / ".manifest.json.tmp-4242-0badc0de").write_text("{")
    Path(lock_path(str(out_dir))).write_text("")  # the lock file exists while runs come and go
    with build_lock(str(out_dir), None, lambda _: None, shared=True):  # another run checking it for reuse
        with pytest.raises(OutputDirError, match="is being built by"):
            build(config(data, out, lock_timeout=0.5))  # waits to remove them, removing nothing meanwhile
        assert spill.is_dir() and len(list(out_dir.iterdir())) == len(fresh) + 3
    messages: list[str] = []
    assert build(config(data, out), log=messages.append).reused
    assert sorted(p.name for p in out_dir.iterdir()) == fresh
    assert f"removing 3 leftover files of interrupted runs from {out_dir}" in messages, messages
    assert build(config(data, out), log=messages.append).reused  # a clean build is reused under the shared lock
    assert sorted(p.name for p in out.iterdir()) == [out_dir.name]


def test_a_shard_overwritten_in_place_with_its_mtime_put_back_is_hashed_again(tmp_path, monkeypatch):
    """The per-host record of verified shards is not fooled by ``touch -r``: the change time moves on any write."""
    from tests.shard_factory import build_shard_dir

    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    written = build_shard_dir(tmp_path / "build", [40] * 60, capacity=64, rows_per_shard=8)
    PackedIterableDataset(written.path, batch_rows=1)  # the first open hashes every shard and records it
    shard = written.path / written.manifest.shards[1].path
    before = shard.stat()
    corrupt = bytearray(shard.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x01  # a token id in the middle of the shard
    with open(shard, "r+b") as f:  # in place: the same inode and size
        f.write(corrupt)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(ShardError, match=f"^{shard}: checksum mismatch"):
        PackedIterableDataset(written.path, batch_rows=1)


def rewritten_as_format_2(manifest: dict, edit: str) -> dict:
    """``manifest`` rewritten as format version 2 (no digests), with its shard list edited and its stats made to agree."""
    old = {key: value for key, value in manifest.items() if not key.endswith("_digest")}
    old["format_version"] = 2
    shards = old["shards"]
    if edit == "drop":
        del shards[1]
    elif edit == "repeat":
        shards.insert(1, shards[0])
    elif edit == "reorder":
        shards[0], shards[1] = shards[1], shards[0]
    old["stats"]["rows"] = sum(s["rows"] for s in shards)
    old["stats"]["tokens"] = sum(s["tokens"] for s in shards)
    return old


@pytest.mark.parametrize("edit", ["drop", "repeat", "reorder"])
def test_a_manifest_rewritten_as_an_older_format_cannot_change_the_shard_list(tmp_path, edit):
    """Each shard carries its place in its build: the loader and interop refuse a shard list that lost,
    repeated or reordered shards, whatever format the manifest claims."""
    from loaders.interop import arrow_dataset
    from tests.shard_factory import build_shard_dir

    written = build_shard_dir(tmp_path / "build", [40] * 60, capacity=64, rows_per_shard=8)
    path = written.path / MANIFEST_NAME
    path.write_text(json.dumps(rewritten_as_format_2(json.loads(path.read_text()), edit)))
    read_manifest(path)  # a valid format 2 manifest on its own
    for verify_checksum in (True, False):
        with pytest.raises(ShardError, match="the manifest was rewritten"):
            PackedIterableDataset(written.path, batch_rows=1, verify_checksum=verify_checksum)
        with pytest.raises(ShardError, match="the manifest was rewritten"):
            arrow_dataset(written.path, verify_checksum=verify_checksum)


def test_pack_does_not_reuse_a_build_whose_manifest_was_rewritten_as_an_older_format(data, finished, tmp_path):
    out_dir = finished(tmp_path / "out", rows_per_shard=40)
    first = read_manifest(out_dir)
    path = out_dir / MANIFEST_NAME
    original = json.loads(path.read_text())
    path.write_text(json.dumps(rewritten_as_format_2(original, "drop")))
    messages: list[str] = []
    again = build(config(data, tmp_path / "out", rows_per_shard=40), log=messages.append)
    assert not again.reused
    assert any(m.startswith(f"rebuilding {out_dir}: ") and "the manifest was rewritten" in m for m in messages)
    assert again.manifest.shards == first.shards


@pytest.mark.parametrize(("field", "value"), [(("stats", "examples"), 1), (("created_at",), "2020-01-01T00:00:00+00:00")])
def test_an_edited_manifest_field_is_refused(tmp_path, field, value):
    """Every field of the manifest is covered by its digest; rewritten as an older format without one, the
    shards refuse it."""
    from tests.shard_factory import build_shard_dir

    written = build_shard_dir(tmp_path / "build", [40] * 60, capacity=64, rows_per_shard=8)
    path = written.path / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    where = manifest
    for key in field[:-1]:
        where = where[key]
    where[field[-1]] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=f"^{path}: the manifest does not match its manifest_digest"):
        PackedIterableDataset(written.path, batch_rows=1)
    path.write_text(json.dumps(rewritten_as_format_2(manifest, "none")))
    with pytest.raises(ShardError, match="the manifest was rewritten"):
        PackedIterableDataset(written.path, batch_rows=1)


def test_a_run_removing_leftovers_leaves_the_report_figure_another_run_is_writing(data, finished, tmp_path, monkeypatch):
    """pack writes report.png holding the build's lock, so a run cleaning the directory meanwhile waits."""
    import pipeline.report.figures
    from pipeline import storage

    out = tmp_path / "out"
    out_dir = finished(out)  # without its figure
    other_runs: list[Run] = []

    def write_report(profile, manifest, directory):
        with storage.output(storage.join(directory, pipeline.report.figures.REPORT_NAME)) as tmp:
            Path(tmp).write_bytes(b"\x89PNG half a figure")
            other = Run(data, out, "other", "--no-report")
            other_runs.append(other)
            wait_for(lambda: other.proc.poll() is not None or "waiting for" in other.err(), "the other run to go by")
            assert Path(tmp).exists(), other.err()
        return storage.join(directory, pipeline.report.figures.REPORT_NAME)

    monkeypatch.setattr(pipeline.report.figures, "write_report", write_report)
    assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 0
    (other,) = other_runs
    assert other.wait() == 0, other.err()
    assert other.out().startswith("varpack: reusing")
    assert sorted(p.name for p in Path(out_dir).iterdir()) == sorted(
        [MANIFEST_NAME, pipeline.report.figures.REPORT_NAME] + [s.path for s in read_manifest(out_dir).shards]
    )


def test_a_build_of_format_4_whose_shards_carry_no_identity_is_still_read(tmp_path):
    from loaders.interop import arrow_dataset
    from schemas import ROW_SCHEMA, file_sha256
    from tests.shard_factory import build_shard_dir

    written = build_shard_dir(tmp_path / "build", [40] * 60, capacity=64, rows_per_shard=8)
    path = written.path / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for entry in manifest["shards"]:  # each shard as format 4 wrote it: the row schema's metadata alone
        shard = written.path / entry["path"]
        table = pa.ipc.open_file(str(shard)).read_all().replace_schema_metadata(ROW_SCHEMA.metadata)
        with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
            writer.write_table(table, max_chunksize=table.num_rows)
        entry.update(sha256=file_sha256(shard), bytes=shard.stat().st_size)
    old = {key: value for key, value in manifest.items() if key != "manifest_digest"}
    old["format_version"] = 4
    old["shards_digest"] = shards_digest(old["shards"])
    path.write_text(json.dumps(old))
    dataset = PackedIterableDataset(written.path, batch_rows=1, shuffle=False)
    assert len(list(dataset)) == written.manifest.num_rows
    assert arrow_dataset(written.path, verify_checksum=True).count_rows() == written.manifest.num_rows
    new = {**old, "format_version": 5}  # a format 5 manifest promises that every shard names its place
    new["manifest_digest"] = manifest_digest(new)
    path.write_text(json.dumps(new))
    with pytest.raises(ShardError, match="carries no build identity"):
        PackedIterableDataset(written.path, batch_rows=1)


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """An empty directory nothing can be written in: read-only by its mode, or for root a read-only mount."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root without the right to mount a read-only filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_home_caches_in_a_temporary_directory(data, tmp_path, read_only_dir, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(read_only_dir))
    monkeypatch.delenv("VARPACK_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    out = tmp_path / "out"
    assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS, "--no-report"]) == 0, capsys.readouterr().err
    fallback = tmp_path / "tmp" / f"varpack-cache-{os.getuid()}"
    notes = [line for line in capsys.readouterr().err.splitlines() if "cache directory" in line]
    assert notes == [f"varpack: note: cache directory {read_only_dir}/.cache/varpack cannot be used "
                     f"({os.strerror(errno.EROFS if os.geteuid() == 0 else errno.EACCES)}); caching in {fallback} instead "
                     "(set VARPACK_CACHE_DIR to keep a cache elsewhere)"]
    assert fallback.stat().st_mode & 0o777 == 0o700
    assert_verified(plan_build(config(data, out)).out_dir)


def test_a_read_only_out_is_one_line_saying_it_could_not_be_written(data, read_only_dir, capsys):
    for out in (read_only_dir, read_only_dir / "builds"):
        assert pack.main(["--dataset", str(data), "--out", str(out), *ARGS]) == 1
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"varpack: error: {out}"), line
        assert ": could not be written (" in line and line.endswith("fix the directory's permissions, then run again")



def started_by(pid: int) -> list[int]:
    """The live processes whose environment names ``pid`` as their pack command: its Beam workers and their shells,
    found whoever their parent is now."""
    marker = f"VARPACK_PACK_PID={pid}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return [p for p in found if alive(p)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker processes through /proc")
def test_workers_killed_with_the_command_before_their_first_import_exit_at_once(data, tmp_path):
    """``kill -9`` of pack the moment its first worker process appears, before it could import Beam or varpack:
    no worker stays (they used to wait about 2 minutes for the runner that was gone)."""
    run = Run(data, tmp_path / "out", "early", "--direct_running_mode=multi_processing", "--direct_num_workers=2")
    try:
        wait_for(lambda: started_by(run.proc.pid), "the first worker process", timeout=120)
        run.proc.kill()
        run.wait()
        wait_for(lambda: not started_by(run.proc.pid), "the workers to exit", timeout=3)
    finally:
        for pid in started_by(run.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
