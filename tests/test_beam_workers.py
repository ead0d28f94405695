"""What each Beam worker is given: the tokenizer as a file it reads once, not inside every pickled step, and its
share of the cores for tokenizing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from apache_beam.internal import pickler

from pipeline import beam_pipeline
from pipeline.beam_pipeline import ReadAndEncode, ship_tokenizer, tokenizer_threads
from pipeline.build import plan_build
from pipeline.config import PackConfig
from pipeline.encode import tokenizer as tokenizer_module
from pipeline.encode.tokenizer import WrongTokenizerError


@pytest.fixture
def plan(tmp_path):
    return plan_build(PackConfig(dataset="synthetic-flan", num_examples=50, out=str(tmp_path / "out"), progress=False))


def fresh_worker(monkeypatch) -> None:
    """This process as a new worker: no tokenizer text or backend cached yet."""
    monkeypatch.setattr(tokenizer_module, "_TEXTS", {})
    monkeypatch.setattr(tokenizer_module, "_BACKENDS", {})


def test_the_read_step_pickles_without_the_tokenizer_and_a_worker_reads_it_once(plan, tmp_path, monkeypatch):
    """Beam pickled, compressed and unpickled the 1.8 MB tokenizer with the step several times a build (about
    1.3 s of a 200-example build's 3 s); the step now holds a path, and a new worker tokenizes as the plan does."""
    spill_dir = str(tmp_path / "spill")
    step = ReadAndEncode(plan, ship_tokenizer(plan.tokenizer, spill_dir), spill_dir, os.getpid())
    pickled = pickler.dumps(step)
    assert len(pickled) < 20_000 < len(plan.tokenizer.serialized) // 50
    texts = ["Write a haiku about packing.", "Three lines, seventeen syllables."]
    expected = [e.ids for e in plan.tokenizer.backend().encode_batch(texts, add_special_tokens=False)]
    fresh_worker(monkeypatch)
    worker = pickler.loads(pickled)
    worker.setup()
    try:
        assert tokenizer_module._TEXTS == {plan.tokenizer.content_hash: plan.tokenizer.serialized}  # read from the file
        backend = worker.encoder.tokenizer.backend()
        assert [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)] == expected
    finally:
        worker.teardown()


def test_a_worker_refuses_a_tokenizer_file_that_is_not_the_planned_one(plan, tmp_path, monkeypatch):
    """Tokens are never made with another tokenizer than the one the fingerprint names: the text read back is
    checked against the content hash."""
    spill_dir = str(tmp_path / "spill")
    path = ship_tokenizer(plan.tokenizer, spill_dir)
    altered = json.loads(Path(path).read_text())
    vocab = altered["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    Path(path).write_text(json.dumps(altered))
    worker = pickler.loads(pickler.dumps(ReadAndEncode(plan, path, spill_dir, os.getpid())))
    fresh_worker(monkeypatch)
    with pytest.raises(WrongTokenizerError, match=f"content hash {plan.tokenizer.content_hash[:16]}"):
        worker.setup()
    worker.teardown()


@pytest.mark.parametrize(("workers", "threads"), [(1, "16"), (4, "4"), (16, "1"), (32, "1"), (0, "1")])
def test_local_workers_share_the_cores_for_tokenizing(workers, threads, monkeypatch):
    """16 workers on 16 cores each started a tokenizer thread per core: 256 threads contending for 16 cores."""
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setattr(beam_pipeline.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert tokenizer_threads(workers) == {"RAYON_NUM_THREADS": threads}


def test_a_tokenizer_thread_count_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert tokenizer_threads(16) == {}
