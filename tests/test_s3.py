"""Builds on an S3-protocol server (``moto_server`` in its own process, started by ``conftest.s3_server``).

``pack --out s3://...`` publishes a build atomically (its shards under an attempt prefix of its own,
the manifest last, in one conditional upload) and reuses it; the loader streams it through its local
cache, verified, and resumes exactly. Faults (the server gone in the middle of a read, refused
credentials, a missing bucket, a missing s3fs) are retried where they may pass, and otherwise one
line naming the fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loaders import PackedIterableDataset
from loaders.remote import cache_name
from schemas import MANIFEST_NAME, Manifest, ManifestError, ShardError, read_manifest
from schemas.storage import StorageError
from tests.conftest import S3Server, start_s3_server, stop_s3_server

REPO = Path(__file__).resolve().parents[1]
RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i * 7}?", "answer": f"The sum is {i + i * 7}. " * (1 + i % 4)}
           for i in range(240)]
ARGS = ["--prompt-column", "prompt", "--response-column", "answer", "--max-len", "128", "--rows-per-shard", "8",
        "--no-progress", "--no-report"]
# Few, short pauses: a fault test ends in seconds.
RETRIES = {"VARPACK_IO_ATTEMPTS": "3", "VARPACK_IO_BACKOFF_S": "0.2"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def pack(data: Path, out: str, env: dict[str, str], *extra: str, code: str = "pass") -> subprocess.CompletedProcess:
    """``python -m pipeline.pack`` of ``data`` into ``out`` with ``env`` added (``code`` run first, in the process)."""
    argv = ["--dataset", str(data), "--out", out, *ARGS, *extra]
    script = f"import sys; {code}; from pipeline.pack import main; sys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def one_line(result: subprocess.CompletedProcess) -> str:
    """The error line of a failed run, checked to be its only line on stderr, without a traceback."""
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def s3fs_of(server: S3Server):
    import s3fs

    return s3fs.S3FileSystem(key=server.key_id, secret=server.secret, endpoint_url=server.endpoint,
                             skip_instance_cache=True)


@pytest.fixture(scope="module")
def s3_packing(s3_server, data) -> tuple[str, list[tuple[int, int]]]:
    """A build packed once into a bucket of the session's server (tests read it, and leave it as it is): its URL, and
    what a reader polling the bucket while it was packed saw each time it found a manifest (the number of shards the
    manifest names, the number of them there, whole)."""
    fs = s3fs_of(s3_server)
    fs.mkdir("packed")
    sightings: list[tuple[int, int]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set() and len(sightings) < 5:
            fs.invalidate_cache()
            for manifest_path in fs.glob(f"packed/builds/*/{MANIFEST_NAME}"):
                manifest = Manifest.from_json(fs.cat_file(manifest_path).decode(), manifest_path)
                root = manifest_path.rsplit("/", 1)[0]
                whole = [s for s in manifest.shards if fs.exists(f"{root}/{s.path}") and fs.size(f"{root}/{s.path}") == s.bytes]
                sightings.append((len(manifest.shards), len(whole)))
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    result = pack(data, "s3://packed/builds", s3_server.env())
    done.set()
    poller.join()
    assert result.returncode == 0, result.stderr
    (build,) = fs.ls("packed/builds")
    return f"s3://{build}", sightings


@pytest.fixture(scope="module")
def s3_build(s3_packing) -> str:
    return s3_packing[0]


def batches(source: str, **kwargs) -> list[dict[str, torch.Tensor]]:
    return list(PackedIterableDataset(source, batch_rows=2, seed=5, **kwargs))


def assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor))


def test_a_build_packed_to_s3_has_its_shards_under_an_attempt_prefix_and_the_manifest_beside_them(s3, s3_server, s3_build):
    fs = s3fs_of(s3_server)
    root = s3_build.removeprefix("s3://")
    manifest = read_manifest(f"{s3_build}/{MANIFEST_NAME}")
    assert len(manifest.shards) > 1
    (attempt,) = {shard.path.split("/")[0] for shard in manifest.shards}
    assert attempt.startswith("attempt-")
    assert sorted(fs.find(root)) == sorted([f"{root}/{MANIFEST_NAME}", *(f"{root}/{s.path}" for s in manifest.shards)])
    for shard in manifest.shards:
        assert fs.size(f"{root}/{shard.path}") == shard.bytes


def test_the_same_inputs_packed_again_to_s3_reuse_the_build(s3_server, s3_build, data):
    before = sorted(s3fs_of(s3_server).find(s3_build.removeprefix("s3://")))
    result = pack(data, "s3://packed/builds", s3_server.env())
    assert result.returncode == 0, result.stderr
    assert f"varpack: reusing {s3_build}" in result.stdout
    assert sorted(s3fs_of(s3_server).find(s3_build.removeprefix("s3://"))) == before


def test_the_reuse_check_reads_no_shard_from_a_thread_of_pyarrow(s3, s3_build, monkeypatch):
    """Handed a Python file object, pyarrow reads it from its own I/O threads, which then hold it and take the GIL to
    let go of it: when that fell on the interpreter's exit, a pack that had printed its report ended with SIGABRT
    ("terminate called without an active exception"). The reuse check reads every shard in its own thread."""
    from fsspec.spec import AbstractBufferedFile

    from pipeline.write.build_dir import reuse_problem

    readers: set[int] = set()
    read = AbstractBufferedFile.read

    def recorded(self, *args, **kwargs):
        readers.add(threading.get_ident())
        return read(self, *args, **kwargs)

    monkeypatch.setattr(AbstractBufferedFile, "read", recorded)
    assert reuse_problem(read_manifest(f"{s3_build}/{MANIFEST_NAME}"), s3_build) is None
    assert readers <= {threading.get_ident()}


def test_the_loader_streams_a_build_on_s3_through_its_cache_and_resumes_exactly(s3, s3_build, tmp_path):
    cache = tmp_path / "cache"
    streamed = batches(s3_build, cache_dir=cache)
    manifest = read_manifest(f"{s3_build}/{MANIFEST_NAME}")
    copies = cache / cache_name(manifest)
    assert_same(batches(str(copies)), streamed)  # the verified copies are the build
    assert_same(batches(f"{s3_build}/{MANIFEST_NAME}", cache_dir=cache), streamed)

    dataset = PackedIterableDataset(s3_build, batch_rows=2, seed=5, cache_dir=cache)
    head = []
    for batch in dataset:
        head.append(batch)
        if len(head) == 3:
            break
    resumed = PackedIterableDataset(s3_build, batch_rows=2, seed=5, cache_dir=cache)
    resumed.load_state_dict(dataset.state_dict())
    assert_same(head + list(resumed), streamed)


def test_a_reader_polling_while_a_build_is_packed_to_s3_sees_no_build_or_a_whole_one(s3_packing):
    """The manifest is the commit point: whenever a reader finds one, every shard it names is there, whole."""
    _, sightings = s3_packing
    assert sightings, "the reader never saw the published build"
    assert all(present == named for named, present in sightings), sightings


def test_a_build_on_s3_whose_shard_was_changed_is_refused_by_the_loader_and_not_reused_by_pack(s3, s3_server, s3_build,
                                                                                               data, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem()
    src = s3_build.removeprefix("s3://")
    dest = f"{s3.removeprefix('s3://')}/builds/{src.rsplit('/', 1)[1]}"
    fs.copy(src, dest, recursive=True)
    manifest = read_manifest(f"{s3_build}/{MANIFEST_NAME}")
    victim = f"{dest}/{manifest.shards[1].path}"
    damaged = bytearray(fs.cat_file(victim))
    damaged[len(damaged) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(damaged))

    with pytest.raises(ShardError, match="the copy does not match the manifest"):
        batches(f"s3://{dest}", cache_dir=tmp_path)
    kept = [p.name for p in (tmp_path / cache_name(manifest)).rglob("*") if p.is_file()]
    assert kept == [Path(manifest.shards[0].path).name], "neither the damaged copy nor a temporary is kept"
    line = one_line(pack(data, f"{s3}/builds", {}))
    assert line.startswith(f"varpack: error: s3://{dest} cannot be reused: {manifest.shards[1].path} fails its checksum")
    assert line.endswith("pass --force to build it again")


def test_a_prefix_with_shards_but_no_manifest_is_no_build_to_the_loader(s3, s3_build, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem()
    manifest = read_manifest(f"{s3_build}/{MANIFEST_NAME}")
    half = f"{s3.removeprefix('s3://')}/half"
    fs.pipe_file(f"{half}/{manifest.shards[0].path}", fs.cat_file(f"{s3_build.removeprefix('s3://')}/{manifest.shards[0].path}"))
    with pytest.raises(ManifestError, match=f"s3://{half}/{MANIFEST_NAME}: no manifest; the build is missing or was interrupted"):
        PackedIterableDataset(f"s3://{half}", cache_dir=tmp_path)


class CuttingProxy:
    """A TCP proxy in front of the S3 server that, once armed, cuts the connection carrying a shard part way through
    its bytes (after Arrow's magic and 64 bytes more), and then lets no connection through for ``down_s`` seconds,
    calling ``on_cut`` first: from the client's side, the server went away in the middle of a read. With ``stall``, it
    stays armed and holds each such connection open, sending nothing more: a server gone silent mid-read."""

    MARKER = b"ARROW1"

    def __init__(self, upstream: str, down_s: float, on_cut=None, stall: bool = False) -> None:
        self.upstream_port = int(upstream.rsplit(":", 1)[1])
        self.down_s, self.on_cut, self.stall = down_s, on_cut, stall
        self.armed, self.cuts, self.down_until = False, 0, 0.0
        self.held: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                if time.monotonic() < self.down_until:
                    raise ConnectionRefusedError
                server = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, dest: socket.socket, response: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                at = data.find(self.MARKER) if response and self.armed else -1
                if at >= 0:
                    self.armed, self.cuts = self.stall, self.cuts + 1
                    self.down_until = time.monotonic() + self.down_s
                    if self.on_cut is not None:
                        self.on_cut()
                    dest.sendall(data[:at + len(self.MARKER) + 64])
                    if self.stall:
                        self.held += [source, dest]
                        return
                    break
                dest.sendall(data)
        except OSError:
            pass
        for end in (source, dest):
            # shutdown first: a bare close() leaves the peer waiting while the other pump is blocked reading it.
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.listener.close()
        for end in self.held:
            end.close()


@pytest.fixture
def build_copy(s3_server, s3_build, tmp_path) -> Path:
    """The session's S3 build downloaded into a local directory, to upload to another server."""
    local = tmp_path / "build"
    s3fs_of(s3_server).get(s3_build.removeprefix("s3://") + "/", str(local), recursive=True)
    return local


def upload(server: S3Server, local: Path, bucket: str) -> str:
    fs = s3fs_of(server)
    fs.mkdir(bucket)
    fs.put(str(local) + "/", f"{bucket}/build", recursive=True)
    return f"s3://{bucket}/build"


def client_of(endpoint: str, server: S3Server, monkeypatch) -> None:
    """This process's S3 client settings pointed at ``endpoint`` with ``server``'s key, and few, short retries."""
    import s3fs

    for name, value in server.env(AWS_ENDPOINT_URL=endpoint, **RETRIES).items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def behind_a_proxy(server: S3Server, local: Path, bucket: str, monkeypatch, **proxy_options) -> Iterator[tuple[str, CuttingProxy]]:
    """``local`` uploaded to ``bucket`` of ``server``, and this process's client pointed at an armed CuttingProxy (made
    with ``proxy_options``) in front of the server, with few, short retries: the upload's URL and the proxy, closed
    at the end."""
    url = upload(server, local, bucket)
    proxy = CuttingProxy(server.endpoint, **proxy_options)
    try:
        client_of(proxy.endpoint, server, monkeypatch)
        proxy.armed = True
        yield url, proxy
    finally:
        proxy.close()


def test_a_read_cut_off_by_the_server_going_away_is_retried_and_gives_the_same_batches(s3_server, s3_build, build_copy,
                                                                                        tmp_path, monkeypatch):
    expected = batches(str(build_copy))
    bucket = f"cut-{tmp_path.name[-8:].lower().replace('_', '-')}"
    with behind_a_proxy(s3_server, build_copy, bucket, monkeypatch, down_s=1.0) as (url, proxy):
        monkeypatch.setenv("VARPACK_IO_BACKOFF_S", "0.4")  # pauses of 0.4 s and 0.8 s outlast the 1 s it is away
        started = time.monotonic()
        streamed = batches(url, cache_dir=tmp_path / "cache")
        assert proxy.cuts == 1 and time.monotonic() - started >= 1.0  # it waited for the server to come back
    assert_same(streamed, expected)


def test_the_server_stopped_in_the_middle_of_a_read_is_one_line_after_retries_and_leaves_no_copy(build_copy, tmp_path,
                                                                                                 monkeypatch):
    server = start_s3_server()
    try:
        with behind_a_proxy(server, build_copy, "stopping", monkeypatch, down_s=float("inf"),
                            on_cut=lambda: stop_s3_server(server)) as (url, proxy):
            started = time.monotonic()
            with pytest.raises(StorageError) as raised:
                batches(url, cache_dir=tmp_path / "cache")
            elapsed = time.monotonic() - started
    finally:
        stop_s3_server(server)
    message = str(raised.value)
    assert proxy.cuts == 1 and "\n" not in message
    assert message.startswith(f"{url}/attempt-") and "could not be read after 3 tries" in message
    assert message.endswith("check that the store is up and reachable (for s3://, AWS_ENDPOINT_URL), then run again")
    assert elapsed >= 0.2 + 0.4  # two pauses, doubling
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [], "a cut copy is never kept"


def test_a_store_that_stalls_in_the_middle_of_a_read_is_retried_then_one_line_within_the_timeouts(s3_server, build_copy,
                                                                                                  tmp_path, monkeypatch):
    bucket = f"stall-{tmp_path.name[-8:].lower().replace('_', '-')}"
    with behind_a_proxy(s3_server, build_copy, bucket, monkeypatch, down_s=0.0, stall=True) as (url, proxy):
        monkeypatch.setenv("VARPACK_IO_TIMEOUT_S", "1")
        started = time.monotonic()
        with pytest.raises(StorageError) as raised:
            batches(url, cache_dir=tmp_path / "cache")
        elapsed = time.monotonic() - started
    message = str(raised.value)
    assert proxy.cuts == 3 and "\n" not in message  # each of the 3 tries stalled
    assert "could not be read after 3 tries (timed out: the store sent nothing for the read timeout, " \
           "VARPACK_IO_TIMEOUT_S)" in message
    assert elapsed < 15, elapsed  # 3 waits of 1 s and the pauses, not botocore's 60 s per read
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [], "a stalled copy is never kept"


def test_a_store_that_stalls_while_pack_checks_a_build_for_reuse_is_one_line_after_retries(s3_server, s3_build, data):
    proxy = CuttingProxy(s3_server.endpoint, down_s=0.0, stall=True)
    try:
        proxy.armed = True
        result = pack(data, s3_build.rsplit("/", 1)[0], s3_server.env(AWS_ENDPOINT_URL=proxy.endpoint, VARPACK_IO_TIMEOUT_S="1",
                                                                     **RETRIES))
    finally:
        proxy.close()
    line = one_line(result)
    assert proxy.cuts == 3 and line.startswith(f"varpack: error: {s3_build}/attempt-")
    assert "could not be read after 3 tries (timed out: " in line


def test_a_request_the_store_refuses_with_a_4xx_is_one_line_at_once_not_retried(s3, monkeypatch):
    import s3fs

    from schemas import storage

    monkeypatch.setenv("VARPACK_IO_BACKOFF_S", "2")
    s3fs.S3FileSystem().pipe_file(f"{s3.removeprefix('s3://')}/x", b"abc")
    tries = []

    def past_the_end() -> bytes:
        tries.append(1)
        return s3fs.S3FileSystem().cat_file(f"{s3.removeprefix('s3://')}/x", start=10, end=20)

    with pytest.raises(StorageError, match=r"^s3://.*/x: could not be read: the store refused the request \(HTTP 416: "):
        storage.retried(f"{s3}/x", past_the_end)
    assert tries == [1]


@pytest.mark.parametrize(("name", "value"), [("VARPACK_IO_ATTEMPTS", "abc"), ("VARPACK_IO_ATTEMPTS", "0"),
                                             ("VARPACK_IO_BACKOFF_S", "-1"), ("VARPACK_IO_TIMEOUT_S", "nan")])
def test_a_bad_io_setting_is_one_line_naming_the_variable(s3, data, name, value):
    line = one_line(pack(data, f"{s3}/builds", {name: value}))
    assert line.startswith(f"varpack: error: {name}={value!r}: not a number of at least ")
    assert line.endswith("; set it to one or unset it")


@pytest.mark.parametrize("out", ["s3://", "gs://", "s3:///prefix"])
def test_out_at_a_url_with_no_bucket_is_one_line_naming_out_and_writes_nothing(data, tmp_path, out):
    result = subprocess.run([sys.executable, "-m", "pipeline.pack", "--dataset", str(data), "--out", out, *ARGS],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    line = one_line(result)
    scheme = out.split("://")[0]
    assert line == f"varpack: error: --out {out}: the URL names no bucket; write {scheme}://BUCKET/PREFIX"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_manifest_over_64_mib_is_refused_in_one_line_naming_it(s3_server, build_copy, tmp_path, monkeypatch, where):
    manifest = build_copy / MANIFEST_NAME
    text = manifest.read_bytes()
    manifest.write_bytes(text[:-1] + b" " * (64 << 20) + text[-1:])  # still valid JSON, and the same manifest
    path = str(manifest)
    if where == "s3":
        bucket = "big-" + tmp_path.name[-8:].lower().replace("_", "-")
        path = f"{upload(s3_server, build_copy, bucket)}/{MANIFEST_NAME}"
        client_of(s3_server.endpoint, s3_server, monkeypatch)
    with pytest.raises(ManifestError, match=f"^{path}: the manifest is over 64 MiB, larger than any build writes; "):
        read_manifest(path)


def test_inspect_of_a_file_url_reads_the_local_path_and_refuses_a_fifo_manifest_at_once(tmp_path):
    os.mkfifo(tmp_path / MANIFEST_NAME)
    for build in (str(tmp_path), f"file://{tmp_path}"):
        result = subprocess.run([sys.executable, "-m", "pipeline.inspect", build], capture_output=True, text=True,
                                timeout=20, env={**os.environ, "PYTHONPATH": str(REPO)})
        line = one_line(result)
        assert line.startswith(f"varpack: error: {tmp_path / MANIFEST_NAME}: the manifest could not be read (")
        assert "it is a FIFO, not a regular file" in line


def test_wrong_credentials_are_one_line_naming_the_variables(s3, data):
    line = one_line(pack(data, f"{s3}/builds", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}))
    assert line.startswith(f"varpack: error: {s3}/builds/")
    assert "the store refused the credentials" in line and "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line


def test_wrong_credentials_are_one_line_to_the_loader(s3, s3_build, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEYOFTHISONE")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(StorageError, match=r"the store refused the credentials .*; set AWS_ACCESS_KEY_ID and "):
        PackedIterableDataset(s3_build, cache_dir=tmp_path)


def test_a_missing_bucket_is_one_line_saying_to_create_it(s3, data):
    line = one_line(pack(data, "s3://no-such-bucket-here/builds", {}))
    assert line.startswith("varpack: error: s3://no-such-bucket-here/builds/sums-")
    assert line.endswith("the bucket 'no-such-bucket-here' does not exist; create it (aws s3 mb s3://no-such-bucket-here) "
                         "or fix the URL, then run again")


def test_a_missing_s3fs_is_one_line_naming_the_extra(s3, data):
    line = one_line(pack(data, f"{s3}/builds", {}, code="sys.modules['s3fs'] = None"))
    assert line == (f"varpack: error: {s3}/builds/{MANIFEST_NAME}: opening s3:// URLs needs a package that is not "
                    "installed; pip install 'varpack[s3]' (s3fs)")
