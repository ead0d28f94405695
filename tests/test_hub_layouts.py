"""Hub datasets are read through their data files at a pinned revision, chosen by split the way
the Hub lays them out, whatever loading script sits beside them.

The Hub is reached through fsspec's ``hf://`` protocol. Offline, a local filesystem registered
for that protocol stands in for ``huggingface_hub.HfFileSystem``: it serves
``hf://datasets/OWNER/NAME@REVISION/...`` from ``ROOT/datasets/OWNER/NAME@REVISION/...``, so
the whole read path (listing, split choice, reading) is varpack's and datasets' real code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_implementations

from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.errors import HubUnreachableError, InputError
from pipeline.pack import main
from pipeline.read import repo_files
from pipeline.read.sources import resolve_source
from schemas import GroupCut, read_manifest
from tests.test_pipeline_e2e import assert_holds_encoded_examples

REVISION = "0123456789abcdef0123456789abcdef01234567"
FLAN_TASKS = ("anli_r1", "cosmos_qa", "glue_mrpc")


def make_flan_repo(root: Path) -> Path:
    """A repository laid out like Muennighoff/flan: a loading script, a card, and JSON lines by split."""
    root.mkdir(parents=True)
    (root / "flan.py").write_text("import datasets  # a loading script datasets >= 4 refuses to run\n")
    (root / "README.md").write_text("---\nlicense: apache-2.0\n---\n# FLAN\n")
    for split in ("train", "validation", "test"):
        (root / split).mkdir()
        for t, task in enumerate(FLAN_TASKS):
            records = [
                {"inputs": f"{split} {task} question {i}?", "targets": f"answer {t}.{i}", "task": task}
                for i in range(4 + t)
            ]
            (root / split / f"{task}_10templates_{split}.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return root


def make_orcamath_repo(root: Path) -> Path:
    """A repository laid out like microsoft/orca-math-word-problems-200k: Parquet named in the card's configs."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nlicense: mit\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/train-*\n---\n# Orca-Math\n"
    )
    table = pa.table({"question": [f"What is {i} + 1?" for i in range(30)], "answer": [f"{i + 1}" for i in range(30)]})
    pq.write_table(table, root / "data" / "train-00000-of-00001.parquet", row_group_size=8)
    return root


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local stand-in for the Hub's ``hf://`` filesystem, rooted at ``tmp_path / 'hub'``; returns that root."""
    root = tmp_path / "hub"

    class LocalHub(DirFileSystem):
        protocol = "hf"

        def __init__(self, *args, **storage_options):
            super().__init__(path=str(root), fs=LocalFileSystem())

    monkeypatch.setitem(fsspec_implementations, "hf", LocalHub)
    LocalHub.clear_instance_cache()
    return root


def flan_texts(root: Path, split: str) -> list[str]:
    return sorted(
        json.loads(line)["inputs"] for path in sorted((root / split).glob("*.jsonl")) for line in path.read_text().splitlines()
    )


def test_a_directory_laid_out_by_split_reads_one_split(tmp_path):
    root = make_flan_repo(tmp_path / "flan")
    train = resolve_source(PackConfig(dataset=str(root)))
    assert train.columns == ("inputs", "targets", "task") and train.known_examples == 4 + 5 + 6
    assert all("/train/" in task.origin for task in train.tasks)
    validation = resolve_source(PackConfig(dataset=str(root), split="validation"))
    assert all("/validation/" in task.origin for task in validation.tasks)
    assert validation.inputs.content_hash != train.inputs.content_hash
    with pytest.raises(InputError, match=r"no split 'dev' \(its splits are train, validation, test: pass --split NAME\)"):
        resolve_source(PackConfig(dataset=str(root), split="dev"))


def test_files_naming_no_split_all_belong_to_train(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    assert repo_files.split_files(str(tmp_path), "train").files == (str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty: no split 'train' \\(it holds no .jsonl"):
        repo_files.split_files(str(tmp_path / "empty"), "train")


def test_flan_is_read_through_its_data_files_ignoring_the_script(hub, tmp_path, capsys):
    repo = make_flan_repo(hub / "datasets" / "Muennighoff" / f"flan@{REVISION}")
    source = resolve_source(PackConfig(dataset="flan", revision=REVISION))
    assert source.notes == ("Muennighoff/flan: ignoring its loading script flan.py; reading its train data files",)
    assert source.inputs.revision == REVISION and source.inputs.id == "Muennighoff/flan"
    assert [t.origin for t in source.tasks] == [
        f"hf://datasets/Muennighoff/flan@{REVISION}/train/{task}_10templates_train.jsonl" for task in FLAN_TASKS
    ]
    columns = {"inputs": pa.string(), "targets": pa.string()}
    texts = [s for task in source.tasks for _, batch in task.read(columns, 3) for s in batch["inputs"].to_pylist()]
    assert sorted(texts) == flan_texts(repo, "train")
    test_split = resolve_source(PackConfig(dataset="flan", revision=REVISION, split="test"))
    assert test_split.inputs.content_hash != source.inputs.content_hash

    config = PackConfig(dataset="flan", revision=REVISION, out=str(tmp_path / "out"), max_len=64, progress=False)
    result = build(config)
    assert "ignoring its loading script flan.py" in capsys.readouterr().err
    assert result.manifest.inputs.dataset.revision == REVISION
    rows = [json.loads(line) for path in sorted((repo / "train").glob("*.jsonl")) for line in path.read_text().splitlines()]
    assert_holds_encoded_examples(result.out_dir, config, pa.Table.from_pylist(rows))


def test_the_revision_is_pinned_into_the_fingerprint(hub, tmp_path):
    other = "f" * 40
    make_flan_repo(hub / "datasets" / "Muennighoff" / f"flan@{REVISION}")
    make_flan_repo(hub / "datasets" / "Muennighoff" / f"flan@{other}")
    first = resolve_source(PackConfig(dataset="flan", revision=REVISION)).inputs
    second = resolve_source(PackConfig(dataset="flan", revision=other)).inputs
    assert first.content_hash != second.content_hash and second.revision == other
    with pytest.raises(InputError, match=r"dataset Muennighoff/flan: no split 'train'"):
        resolve_source(PackConfig(dataset="flan", revision="0" * 40))


def test_orcamath_reads_the_files_its_card_names(hub):
    make_orcamath_repo(hub / "datasets" / "microsoft" / f"orca-math-word-problems-200k@{REVISION}")
    source = resolve_source(PackConfig(dataset="orcamath", revision=REVISION))
    assert source.notes == () and source.known_examples == 30 and len(source.tasks) == 4  # one task per row group
    assert source.default_format.columns == ("question", "answer")
    limited = resolve_source(PackConfig(dataset="orcamath", revision=REVISION, num_examples=10))
    columns = {"question": pa.string()}
    assert [q for t in limited.tasks for _, b in t.read(columns, 4) for q in b["question"].to_pylist()] == [
        f"What is {i} + 1?" for i in range(10)
    ]
    with pytest.raises(InputError, match=r"no split 'test' \(its splits are train: pass --split NAME\)"):
        resolve_source(PackConfig(dataset="orcamath", revision=REVISION, split="test"))


def test_hub_repos_without_a_revision_fail_fast_offline():
    with pytest.raises(HubUnreachableError, match=r"HF_HUB_OFFLINE is set.*hf download --repo-type dataset .* --dataset DIR"):
        resolve_source(PackConfig(dataset="hf:owner/name"))


def test_hub_files_read_without_a_count_record_the_group_cut_unless_num_examples_bounds_them(hub):
    """The one exception to one-group builds keeping their fingerprints: rows not counted before reading (the Hub's
    JSON-lines files) may be any number of groups, so the build records ``inputs.group_cut``; Parquet is counted."""
    make_flan_repo(hub / "datasets" / "Muennighoff" / f"flan@{REVISION}")
    make_orcamath_repo(hub / "datasets" / "microsoft" / f"orca-math-word-problems-200k@{REVISION}")
    assert plan_build(PackConfig(dataset="flan", revision=REVISION)).inputs.group_cut == GroupCut.EXAMPLE
    assert plan_build(PackConfig(dataset="flan", revision=REVISION, num_examples=15, examples_per_group=15)).inputs.group_cut is None
    assert plan_build(PackConfig(dataset="orcamath", revision=REVISION)).inputs.group_cut is None


def test_a_hub_dataset_builds_under_strict_with_no_column_called_unread(hub, tmp_path, capsys):
    """A Hub dataset's columns are columns, not files left unread: no "not read" warning, so --strict builds it."""
    repo = hub / "datasets" / "owner" / f"data@{REVISION}"
    repo.mkdir(parents=True)
    (repo / "train-a.jsonl").write_text("".join(json.dumps({"text": f"row {i} words"}) + "\n" for i in range(4)))
    args = ["--dataset", "hf:owner/data", "--revision", REVISION, "--text-column", "text", "--max-len", "64",
            "--no-progress", "--no-report", "--strict", "--out", str(tmp_path / "out")]
    assert main(args) == 0, capsys.readouterr().err
    assert "not read" not in capsys.readouterr().err


def test_bad_rows_past_num_examples_are_not_part_of_the_build_fresh_or_reused(hub, tmp_path, capsys):
    """Hub JSON lines are not counted before reading, so rows past --num-examples may be read; the build is the first N
    rows read all the same: bad rows past them are neither held to --max-bad-rows nor listed, and the same command run
    again reuses the build it wrote (the bound over the same rows), where a tighter bound refuses it."""
    repo = hub / "datasets" / "owner" / f"data@{REVISION}"
    repo.mkdir(parents=True)
    rows = [{"text": f"row {i} some words"} for i in range(16)]
    rows[3], rows[9], rows[13], rows[15] = {"text": ""}, {"text": None}, {"text": ""}, {"text": None}
    for name, part in (("train-a.jsonl", rows[:8]), ("train-b.jsonl", rows[8:])):
        (repo / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    out = tmp_path / "out"
    args = ["--dataset", "hf:owner/data", "--revision", REVISION, "--text-column", "text", "--num-examples", "10",
            "--max-len", "64", "--on-bad-row", "skip", "--no-progress", "--no-report", "--out", str(out)]
    for run in ("fresh", "reused"):
        assert main([*args, "--max-bad-rows", "0.2"]) == 0, f"{run}: {capsys.readouterr().err}"
    (build_dir,) = [path for path in out.iterdir() if path.is_dir()]
    manifest = read_manifest(build_dir)
    assert (manifest.stats.num_example_ids, manifest.rejected.rows) == (10, 2)
    listed = [json.loads(line)["where"] for line in (build_dir / "rejected.jsonl").read_text().splitlines()]
    assert [where.rsplit("/", 1)[-1] for where in listed] == ["train-a.jsonl line 4", "train-b.jsonl line 2"]
    capsys.readouterr()
    assert main([*args, "--max-bad-rows", "0.1"]) == 1
    assert "left out 2 bad rows of 10 read, more than --max-bad-rows 0.1" in capsys.readouterr().err
    shutil.rmtree(out)
    assert main([*args, "--max-bad-rows", "1"]) == 1
    assert "2 of 10 rows read are bad, more than --max-bad-rows 1 (first: " in capsys.readouterr().err
