"""The same build on other Beam runners, and the spill files that keep a build's memory bounded.

- Beam's DaskRunner on a real ``dask.distributed`` cluster of two worker processes, and the
  PortableRunner with its embedded job server, write shards byte-identical to the default
  in-process runner's.
- Tokens wait in spill files while the dataset is packed; no spill file outlives its run,
  whether the run succeeds, fails, or was killed before its cleanup.
- A build's memory grows with its data, not with ``--max-len``, which is bounded by what a row's
  int32 counts can hold.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.build import build
from pipeline.config import PackConfig
from pipeline.errors import InputError
from pipeline.pack import parse_args
from pipeline.packing.spill import SPILL_PREFIX
from schemas import read_manifest

REPO = Path(__file__).resolve().parents[1]
GROUPS_AND_SHARDS = {"examples_per_group": 700, "rows_per_shard": 25}


def shard_bytes(out_dir: str) -> list[bytes]:
    return [(Path(out_dir) / s.path).read_bytes() for s in read_manifest(out_dir).shards]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The default in-process runner's build: several packing groups and shards."""
    out = tmp_path_factory.mktemp("in-process")
    config = PackConfig(dataset="synthetic-orcamath", num_examples=2000, max_len=1024, batch_size=300, out=str(out), progress=False,
                        **GROUPS_AND_SHARDS)
    result = build(config)
    assert len(result.manifest.shards) > 3
    return config, result


def test_dask_cluster_writes_the_same_shards(reference, tmp_path):
    distributed = pytest.importorskip("distributed")
    config, expected = reference
    # The workers import varpack from this checkout, whichever the interpreter would find first.
    env = {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None, env=env) as cluster:
        args = ["--runner", "DaskRunner", f"--dask_client_address={cluster.scheduler_address}"]
        beam_args = parse_args(args).beam_args
        result = build(dataclasses.replace(config, out=str(tmp_path), beam_args=beam_args))
    assert result.manifest.fingerprint == expected.manifest.fingerprint
    assert shard_bytes(result.out_dir) == shard_bytes(expected.out_dir)
    assert result.manifest.stats == expected.manifest.stats


def test_portable_runner_writes_the_same_shards(reference, tmp_path):
    config, expected = reference
    beam_args = ("--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK")
    result = build(dataclasses.replace(config, out=str(tmp_path), beam_args=beam_args))
    assert shard_bytes(result.out_dir) == shard_bytes(expected.out_dir)


def test_runner_options_pass_through():
    assert parse_args(["--runner", "DaskRunner", "--dask_client_address", "tcp://h:1"]).beam_args == (
        "--runner", "apache_beam.runners.dask.dask_runner.DaskRunner", "--dask_client_address", "tcp://h:1",
    )
    assert parse_args(["--runner=FlinkRunner", "--flink_master=h:8081", "--environment_type=PROCESS"]).beam_args[0] == (
        "--runner=FlinkRunner"
    )


def spills(*dirs: Path) -> list[str]:
    return [name for d in dirs if d.is_dir() for name in os.listdir(d) if name.startswith((SPILL_PREFIX, "varpack-spill-"))]


def test_spill_files_never_outlive_their_run(reference, tmp_path):
    config, expected = reference
    out_dir = Path(expected.out_dir)
    assert spills(out_dir) == []
    # A run killed before its cleanup left its spill directory behind: the next build removes it.
    fresh = dataclasses.replace(config, out=str(tmp_path / "out"))
    build_dir = tmp_path / "out" / out_dir.name
    (build_dir / f"{SPILL_PREFIX}killed").mkdir(parents=True)
    (build_dir / f"{SPILL_PREFIX}killed" / "000000-000000.arrow").write_bytes(b"partial")
    assert shard_bytes(build(fresh).out_dir) == shard_bytes(expected.out_dir)
    assert spills(build_dir) == []
    # On a cluster, workers spill under --temp_location; it is emptied when the run fails too.
    temp = tmp_path / "temp"
    temp.mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 50 + '{"text": null}\n')
    failing = PackConfig(dataset=str(bad), out=str(tmp_path / "failed"), progress=False, batch_size=16,
                         beam_args=(f"--temp_location={temp}",))
    with pytest.raises(Exception, match="'text' is null") as raised:
        build(failing)
    assert raised.type is InputError or "InputError" in str(raised.value)
    assert spills(temp, tmp_path / "failed") == [] and not any((tmp_path / "failed").glob("*/*"))
    succeeded = dataclasses.replace(failing, dataset=str(tmp_path / "good.jsonl"))
    (tmp_path / "good.jsonl").write_text('{"text": "fine"}\n' * 50)
    build(succeeded)
    assert spills(temp) == [] and os.listdir(temp) == []


# The peak memory of the pack command it runs, from a process of its own so that no other child counts.
MEASURED = """
import resource, subprocess, sys
returncode = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(returncode)
"""


def pack_peak_memory(data: Path, out: Path, max_len: int) -> int:
    """The peak resident memory of a pack of ``data`` at ``max_len``, in bytes, under a 4 GB address space limit."""
    four_gb = 4 << 30  # rather than let a packer that grows with --max-len take the machine (24 GB at 2**31)
    run = subprocess.run(
        [sys.executable, "-c", MEASURED, sys.executable, "-m", "pipeline.pack", "--dataset", str(data), "--out", str(out),
         "--max-len", str(max_len), "--no-progress", "--no-report"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (four_gb, four_gb)),
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout.splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and ru_maxrss in kilobytes are Linux's")
def test_the_largest_max_len_packs_two_examples_in_the_memory_of_a_small_one(tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text('{"prompt": "What is 2 + 2?", "response": "4"}\n{"prompt": "Name a colour.", "response": "Blue"}\n')
    small = pack_peak_memory(data, tmp_path / "small", 64)
    largest = pack_peak_memory(data, tmp_path / "largest", 2**31 - 1)
    assert largest < small + (64 << 20)
    (build_dir,) = (tmp_path / "largest").iterdir()
    manifest = read_manifest(build_dir)
    assert (manifest.capacity, manifest.stats.examples, manifest.num_rows) == (2**31 - 1, 2, 1)


def test_a_max_len_past_what_a_row_can_hold_is_one_line_and_writes_nothing(tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n')
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.pack", "--dataset", str(data), "--out", str(tmp_path / "out"), "--max-len", str(2**31)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode != 0
    assert run.stderr.splitlines() == [
        "varpack: error: --max-len must be at most 2,147,483,647 (a row's token counts are int32), got 2,147,483,648"
    ]
    assert not (tmp_path / "out").exists()
