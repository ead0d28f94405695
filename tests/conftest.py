"""Test-wide settings: no test may reach the network. The Quickstart's build, packed once per session; the cache of the
GGUF conversions; the resume tests' build of whole examples; an S3-protocol server on 127.0.0.1 for the tests of builds
on an object store."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Registers a Beam filesystem when imported; collecting its doctests would import (and register) it twice.
collect_ignore = ["url_filesystem.py"]


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python -m pipeline.pack`` with no arguments, run in an empty directory as the Quickstart's step 1:
    the directory (its ``shards/`` holds the embedded GSM8K test set's build) and the finished command.
    Tests read it and leave it as it is."""
    cwd = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return cwd, subprocess.run([sys.executable, "-m", "pipeline.pack", "--no-progress"], cwd=cwd, env=env,
                               capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory) -> Path:
    """A ``$VARPACK_CACHE_DIR`` for the GGUF files of ``tests/data/llama-cpp-vocab``, one for the session: each file is
    converted (transformers reads its whole vocabulary, tens of seconds for Falcon's) by the first test to load it, and
    read from here by the later ones. Tests keep other tokenizers out of it."""
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="session")
def resume_build(tmp_path_factory):
    """The build test_resume.py and test_resume_epoch_end.py read (and leave as it is): 60 whole examples (none longer
    than a row of 32 tokens) of random tokens from a vocabulary of 30,000, so a segment's tokens name its example; 36
    rows, 5 to a shard (36 is no multiple of 5: a batch of 5 rows drops a tail at the epoch's end)."""
    import numpy as np
    from shard_factory import build_shard_dir

    lengths = np.random.default_rng(12).integers(3, 33, 60)
    return build_shard_dir(tmp_path_factory.mktemp("resume"), lengths, capacity=32, rows_per_shard=5, vocab_size=30000)


@pytest.fixture(scope="session")
def resume_example_of(resume_build) -> dict[tuple[int, ...], int]:
    """``resume_build``'s example id by the tuple of its tokens."""
    return {tuple(resume_build.example(i)[0].tolist()): i for i in range(resume_build.lengths.size)}


@dataclass(frozen=True)
class S3Server:
    """A moto S3-protocol server in its own process: its endpoint, and an access key it accepts (it refuses others)."""

    endpoint: str
    key_id: str
    secret: str
    process: subprocess.Popen

    def env(self, **changes: str) -> dict[str, str]:
        """The settings a client of this server reads (AWS_ENDPOINT_URL, the key, the region), with ``changes``."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1", **changes}


def start_s3_server() -> S3Server:
    """``moto_server`` on a free port of 127.0.0.1, answering, with an IAM user's key and authentication on.

    botocore's own retries are turned off (AWS_MAX_ATTEMPTS=1), so the retries a test sees are varpack's.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto_server did not answer at {endpoint}") from None
            time.sleep(0.1)
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    iam.create_user(UserName="varpack")
    iam.put_user_policy(UserName="varpack", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="varpack")["AccessKey"]
    # From here on every request must be signed with a key the server knows, as on AWS.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                                  headers={"Content-Type": "text/plain"})).close()
    return S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], process)


def stop_s3_server(server: S3Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3-protocol server for the session (``moto_server``, not an in-process mock); stopped at the end."""
    server = start_s3_server()
    yield server
    stop_s3_server(server)


@pytest.fixture
def s3(s3_server, monkeypatch) -> str:
    """A fresh bucket on the session's server, with this test's environment pointing at the server; its URL."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint or key is not reused
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}"
