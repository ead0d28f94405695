"""``python -m pipeline.pack`` end to end on Beam: shards that hold exactly the encoded examples,
reuse, rebuilds, recovery, the multi-process runner, and one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loaders.shard_reader import open_shard
from pipeline import beam_pipeline
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.examples import Encoder
from pipeline.pack import main
from pipeline.read.readers import BatchRows
from pipeline.read.sources import resolve_source
from pipeline.read.synthetic import SHAPES, generate_block
from schemas import MANIFEST_NAME, read_manifest

REPO = Path(__file__).resolve().parents[1]
CHATS = [
    [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}]
    + ([{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"{4 * i}"}] if i % 3 == 0 else [])
    for i in range(60)
]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.pack", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def read_examples(out_dir: str | Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every example's tokens and loss mask, put back together from verified shards."""
    manifest = read_manifest(out_dir)
    chunks = defaultdict(list)
    for info in manifest.shards:
        shard = open_shard(Path(out_dir) / info.path, manifest.capacity, expected=info, verify_checksum=True)
        for i in range(shard.num_rows):
            row = shard.row(i)
            cu = row["cu_seqlens"]
            for j, (example, offset) in enumerate(zip(row["example_ids"].tolist(), row["example_offsets"].tolist())):
                chunks[example].append((offset, row["input_ids"][cu[j] : cu[j + 1]], row["loss_mask"][cu[j] : cu[j + 1]]))
    examples = {}
    for example, parts in chunks.items():
        parts.sort(key=lambda part: part[0])
        assert [p[0] for p in parts] == list(np.cumsum([0] + [len(p[1]) for p in parts[:-1]])), "chunks overlap or miss tokens"
        examples[example] = (np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]))
    return examples


def assert_holds_encoded_examples(out_dir: str | Path, config: PackConfig, table: pa.Table) -> None:
    """The shards hold each example of ``table`` once, token for token and mask for mask, as Encoder makes it."""
    plan = plan_build(config)
    encoder = Encoder(plan.tokenizer, plan.example_format, config.max_len, "split")
    batch = encoder.encode(table, BatchRows("expected"))
    examples = read_examples(out_dir)
    assert sorted(examples) == list(range(table.num_rows))
    ends = np.cumsum(batch.lengths)
    for i, (end, n) in enumerate(zip(ends.tolist(), batch.lengths.tolist())):
        tokens, mask = examples[i]
        assert np.array_equal(tokens, batch.tokens[end - n : end]) and np.array_equal(mask, batch.loss_mask[end - n : end]), i
    manifest = read_manifest(out_dir)
    assert manifest.stats.examples == table.num_rows and manifest.stats.tokens == int(batch.lengths.sum())


def test_default_run_packs_gsm8k_into_shards(quickstart):
    cwd, result = quickstart
    assert result.returncode == 0, result.stderr
    (out_dir,) = (cwd / "shards").iterdir()
    assert out_dir.name.startswith("gsm8k-")
    assert "wrote shards/gsm8k-" in result.stdout and "fill" in result.stdout and "examples/row" in result.stdout
    source = resolve_source(PackConfig())
    columns = {"question": pa.string(), "answer": pa.string()}
    table = pa.concat_tables([batch for task in source.tasks for _, batch in task.read(columns, 10_000)])
    assert_holds_encoded_examples(out_dir, PackConfig(), table)
    manifest = read_manifest(out_dir)
    assert manifest.fingerprint == out_dir.name.split("-")[-1] and manifest.stats.fill > 0.98


def build_files(cwd: Path) -> dict[str, tuple[int, int]]:
    """The shards and manifest of the builds under ``cwd/shards``: (inode, mtime) by path."""
    paths = [*cwd.glob("shards/*/shard-*.arrow"), *cwd.glob("shards/*/manifest.json")]
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def test_second_run_reuses_without_tokenizing(quickstart, monkeypatch, capsys):
    cwd, _ = quickstart
    before = build_files(cwd)
    result = run_cli(["--no-progress"], cwd)
    assert result.returncode == 0 and "reusing shards/gsm8k-" in result.stdout
    assert build_files(cwd) == before, "a reuse rewrote the build"
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(beam_pipeline, "run", lambda *a, **k: pytest.fail("a reuse must not run the pipeline"))
    assert main(["--no-progress"]) == 0
    assert "reusing" in capsys.readouterr().out
    assert build_files(cwd) == before


def test_a_new_seed_is_a_new_build_of_the_same_tokens(quickstart, tmp_path):
    cwd, _ = quickstart
    shutil.copytree(cwd / "shards", tmp_path / "shards")  # the other tests read the Quickstart's build as it is
    (first,) = (tmp_path / "shards").iterdir()
    result = build(PackConfig(out=str(tmp_path / "shards"), seed=1, progress=False))
    assert not result.reused and Path(result.out_dir) != first
    assert len(list((tmp_path / "shards").iterdir())) == 2
    old, new = read_examples(first), read_examples(result.out_dir)
    assert old.keys() == new.keys() and all(np.array_equal(old[k][0], new[k][0]) for k in old)
    assert read_manifest(first).shards[0].sha256 != read_manifest(result.out_dir).shards[0].sha256


def test_jsonl_prompt_response_after_an_interrupted_run(tmp_path):
    records = [{"q": f"What is {i} times {i}? " * (1 + i % 7), "a": f"The answer is {i * i}. " * (1 + i % 5)} for i in range(300)]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = PackConfig(dataset=str(data), out=str(tmp_path / "out"), max_len=128, prompt_column="q", response_column="a",
                        batch_size=64, rows_per_shard=16, progress=False)
    out_dir = Path(plan_build(config).out_dir)
    out_dir.mkdir(parents=True)  # what a killed run leaves: a shard, a half-written one, no manifest
    (out_dir / "shard-00000.arrow").write_bytes(b"partial")
    (out_dir / ".shard-00001.arrow.tmp-4242").write_bytes(b"partial")
    result = build(config)
    assert not result.reused and len(result.manifest.shards) > 3
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([MANIFEST_NAME] + [s.path for s in result.manifest.shards])
    assert_holds_encoded_examples(out_dir, config, pa.Table.from_pylist(records))
    assert result.manifest.stats.examples_split > 0


def test_parquet_chat_and_plain_text(tmp_path):
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "chat.parquet", row_group_size=25)
    chat = PackConfig(dataset=str(tmp_path / "chat.parquet"), out=str(tmp_path / "out"), max_len=256, progress=False)
    result = build(chat)
    assert result.manifest.inputs.loss_masking == "assistant_turns"
    assert_holds_encoded_examples(result.out_dir, chat, pa.table({"messages": CHATS}))
    texts = pa.table({"body": [f"Plain text number {i}. " * (i % 9 + 1) for i in range(200)]})
    pq.write_table(texts, tmp_path / "text.parquet")
    plain = PackConfig(dataset=str(tmp_path / "text.parquet"), out=str(tmp_path / "out"), text_column="body", max_len=64,
                       overflow="truncate", progress=False)
    result = build(plain)
    examples = read_examples(result.out_dir)
    assert len(examples) == 200 and max(len(t) for t, _ in examples.values()) == 64
    assert all(mask[0] == 0 and mask[1:].all() for _, mask in examples.values())
    assert result.manifest.stats.tokens_truncated > 0


def test_grouped_multi_process_run_writes_the_same_shards(tmp_path):
    table = generate_block(SHAPES["synthetic-orcamath"], 0, 700)
    pq.write_table(table, tmp_path / "orca.parquet", row_group_size=200)
    config = PackConfig(dataset=str(tmp_path / "orca.parquet"), out=str(tmp_path / "in_process"), max_len=1024,
                        batch_size=64, examples_per_group=250, rows_per_shard=20, progress=False)
    in_process = build(config)
    multi = build(
        dataclasses.replace(config, out=str(tmp_path / "multi"),
                            beam_args=("--direct_running_mode=multi_processing", "--direct_num_workers=2"))
    )
    assert in_process.manifest.fingerprint == multi.manifest.fingerprint
    assert len(in_process.manifest.shards) > 5
    assert [dataclasses.asdict(s) for s in in_process.manifest.shards] == [dataclasses.asdict(s) for s in multi.manifest.shards]
    assert in_process.manifest.stats == multi.manifest.stats
    assert_holds_encoded_examples(multi.out_dir, config, table)


def test_another_builds_directory_is_not_overwritten(quickstart, tmp_path, capsys):
    cwd, _ = quickstart
    source_dir = next((cwd / "shards").iterdir())
    config = PackConfig(out=str(tmp_path), num_examples=5, progress=False)
    out_dir = Path(plan_build(config).out_dir)
    out_dir.mkdir()
    for item in source_dir.iterdir():
        (out_dir / item.name).write_bytes(item.read_bytes())
    assert main(["--out", str(tmp_path), "--num-examples", "5", "--no-progress"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "holds the shards of another build" in error and "--force" in error
    assert main(["--out", str(tmp_path), "--num-examples", "5", "--no-progress", "--force"]) == 0
    assert read_manifest(out_dir).stats.examples == 5
    assert main(["--out", str(out_dir), "--no-progress"]) == 1
    assert "is itself a shard directory" in capsys.readouterr().err


BAD_INPUTS = {
    "unknown dataset": (["--dataset", "no-such-dataset"], "unknown dataset 'no-such-dataset'"),
    "missing column": (["--dataset", "{dir}/good.jsonl", "--text-column", "body"], "no column 'body'"),
    "null text": (["--dataset", "{dir}/null.jsonl"], "null.jsonl line 2: 'response' is null"),
    "non-string": (["--dataset", "{dir}/number.parquet"], "column 'response' holds int64 values"),
    "too long": (
        ["--dataset", "{dir}/good.jsonl", "--max-len", "8", "--overflow", "error"],
        r"good.jsonl line 1: \d+ tokens, more than --max-len 8",
    ),
    "unreadable file": (["--dataset", "{dir}/corrupt.parquet"], "corrupt.parquet: cannot be read"),
    "foreign files": (["--dataset", "{dir}/good.jsonl", "--out", "{dir}/out"], "holds files varpack did not write"),
    "multi-threading": (["--direct_running_mode=multi_threading"], "multi_threading loses elements"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_line_and_no_manifest(case, tmp_path):
    (tmp_path / "good.jsonl").write_text('{"prompt": "Hello there, my dear friend. How are you?", "response": "Fine, thanks."}\n')
    (tmp_path / "null.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": null}\n')
    pq.write_table(pa.table({"prompt": ["a"], "response": [3]}), tmp_path / "number.parquet")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    if case == "foreign files":
        out_dir = Path(plan_build(PackConfig(dataset=str(tmp_path / "good.jsonl"), out=str(tmp_path / "out"))).out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "notes.txt").write_text("mine")
    args, message = BAD_INPUTS[case]
    result = run_cli([a.format(dir=tmp_path) for a in args] + ["--no-progress"], tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("varpack: error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob(MANIFEST_NAME)) and not list(tmp_path.rglob("*.arrow"))
