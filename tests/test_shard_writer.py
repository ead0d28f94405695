"""ShardWriter: a build written from token arrays at hand, with the guarantees of pack, and without Beam."""

from __future__ import annotations

import dataclasses
import doctest
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from loaders import PackedIterableDataset
from loaders.shard_reader import open_shard
from pipeline.errors import OutputDirError
from pipeline.write.shard_writer import ShardWriter
from schemas import (
    BuildInputs,
    DatasetInputs,
    ShardError,
    TokenizerInputs,
    compute_fingerprint,
    read_manifest,
)

ROOT = Path(__file__).resolve().parents[1]
CAPACITY = 16


def inputs(capacity: int = CAPACITY, packing: str = "best_fit_decreasing", num_examples: int | None = None) -> BuildInputs:
    return BuildInputs(
        dataset=DatasetInputs(id="corpus", split="train", content_hash="ab", num_examples=num_examples),
        tokenizer=TokenizerInputs(name="tok", content_hash="cd", vocab_size=100),
        template="none", loss_masking="given", max_len=capacity, overflow="split", packing=packing,
        seed=0, package_version="0.1.0",
    )


def stored_rows(directory: Path) -> list[dict]:
    """Every row of a build, in shard order, read through the loader's shard reader with checksums verified."""
    manifest = read_manifest(directory)
    rows = []
    for info in manifest.shards:
        shard = open_shard(directory / info.path, manifest.capacity, info, verify_checksum=True)
        rows += [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in shard.row(i).items()}
                 for i in range(shard.num_rows)]
    return rows


def test_the_documented_example_runs_and_the_loader_reads_the_build() -> None:
    (example,) = doctest.DocTestFinder(recurse=False).find(ShardWriter, "ShardWriter", globs={"ShardWriter": ShardWriter})
    runner = doctest.DocTestRunner()
    runner.run(example, clear_globs=False)
    assert runner.summarize(verbose=False).failed == 0
    directory = Path(example.globs["directory"])
    manifest = read_manifest(directory)
    assert manifest.fingerprint == compute_fingerprint(manifest.inputs)
    first = stored_rows(directory)[0]
    assert first["input_ids"] == [5, 6, 7, 8, 9] and first["cu_seqlens"] == [0, 3, 5] and first["loss_mask"] == [0, 1, 1, 0, 1]
    batches = list(PackedIterableDataset(directory, batch_rows=3, shuffle=False))
    assert sum(int(b["cu_seq_lens_q"][-1]) for b in batches) == 15


def test_rows_come_back_as_written_across_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    written = []
    with ShardWriter(tmp_path, inputs(num_examples=200), rows_per_shard=3) as writer:  # ids 100, 101, ... of 200
        for _ in range(10):
            cu = np.unique(np.concatenate(([0], rng.integers(1, 12, 2), [12])))
            row = {"input_ids": rng.integers(0, 100, 12).tolist(), "loss_mask": rng.integers(0, 2, 12).tolist(),
                   "cu_seqlens": cu.tolist(), "example_ids": list(range(100, 100 + cu.size - 1)),
                   "example_offsets": [0] * (cu.size - 1)}
            writer.write_row(**row)
            written.append(row)
    assert [s.rows for s in writer.manifest.shards] == [3, 3, 3, 1]
    rows = stored_rows(tmp_path)
    assert [{k: r[k] for k in written[0]} for r in rows] == written
    assert writer.manifest.stats.segments == sum(len(r["cu_seqlens"]) - 1 for r in written)


def test_examples_are_packed_by_the_inputs_policies_with_running_ids(tmp_path: Path) -> None:
    lengths = np.array([5, 20, 3, 9, 16])
    tokens = np.arange(1, lengths.sum() + 1)
    with ShardWriter(tmp_path, inputs(packing="sequential"), rows_per_shard=2) as writer:
        writer.write_examples(tokens[:25], lengths[:2])
        writer.write_examples(tokens[25:], lengths[2:])
    stats = writer.manifest.stats
    assert (stats.examples, stats.examples_split, stats.tokens, stats.rows) == (5, 1, 53, 5)
    placed = {}
    for row in stored_rows(tmp_path):
        for j, (example, offset) in enumerate(zip(row["example_ids"], row["example_offsets"])):
            placed[(example, offset)] = row["input_ids"][row["cu_seqlens"][j] : row["cu_seqlens"][j + 1]]
    starts = np.cumsum(lengths) - lengths
    for example, (start, length) in enumerate(zip(starts, lengths)):
        pieces = [placed.pop((example, offset)) for offset in range(0, length, CAPACITY)]
        assert sum(pieces, []) == tokens[start : start + length].tolist()
    assert not placed


def test_an_exception_inside_the_block_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="upstream failed"):
        with ShardWriter(tmp_path / "build", inputs(), rows_per_shard=1) as writer:
            writer.write_row([1, 2, 3])
            writer.write_row([4, 5])
            writer.write_row([6])
            assert len(list((tmp_path / "build").iterdir())) == 2  # the last shard waits for finish()
            raise RuntimeError("upstream failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"input_ids": list(range(17))}, r"^row 1: holds 17 tokens, more than the capacity of 16$"),
        ({"input_ids": [1, 2, 3], "cu_seqlens": [0, 2]}, r"^row 1: cu_seqlens must rise strictly from 0 to the row's 3 tokens"),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, r"^row 1: loss_mask has 2 entries for 3 tokens$"),
        ({"input_ids": [1, -2, 3]}, r"^row 1: input_ids: token ids must lie in \[0, 2\*\*31 - 1\]$"),
        ({"input_ids": [1, 2], "cu_seqlens": [0, 1, 2], "example_ids": [7]}, r"^row 1: example_ids and example_offsets"),
    ],
)
def test_a_bad_row_is_named_and_nothing_is_left(tmp_path: Path, row: dict, message: str) -> None:
    with pytest.raises(ShardError, match=message):
        with ShardWriter(tmp_path / "build", inputs(), rows_per_shard=1) as writer:
            writer.write_row([1, 2, 3])
            writer.write_row(**row)
    assert list(tmp_path.iterdir()) == []


def test_example_ids_outside_the_declared_count_are_refused_and_nothing_is_left(tmp_path: Path) -> None:
    """Ids may skip source rows; the build records one past the highest, or the count the writer declares."""
    with pytest.raises(ValueError, match=r"example id 5 is outside \[0, 5\), the build's example ids"):
        with ShardWriter(tmp_path / "build", inputs(num_examples=5), rows_per_shard=1) as writer:
            writer.write_examples(np.arange(1, 11), [2, 2, 2, 2, 2], example_ids=[0, 1, 2, 3, 5])
    assert list(tmp_path.iterdir()) == []
    with ShardWriter(tmp_path / "undeclared", inputs(), rows_per_shard=1) as writer:
        writer.write_examples(np.arange(1, 11), [2, 2, 2, 2, 2], example_ids=[0, 1, 2, 3, 5])
    assert writer.manifest.num_example_ids == 6
    with ShardWriter(tmp_path / "declared", inputs(num_examples=8), rows_per_shard=1) as writer:
        writer.write_examples(np.arange(1, 11), [2, 2, 2, 2, 2], example_ids=[0, 1, 2, 3, 5])
    assert writer.manifest.num_example_ids == 8


def test_a_directory_with_files_is_refused_and_a_build_needs_rows(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match=r"is not empty \(it holds notes.txt\); write a build into a new directory"):
        ShardWriter(tmp_path, inputs())
    with pytest.raises(ValueError, match="no rows were written"):
        with ShardWriter(tmp_path / "empty", inputs()):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    ("field", "value"), [("loss_masking", "all"), ("overflow", "wrap"), ("packing", "worst_fit_increasing")]
)
def test_an_unknown_policy_is_refused_before_anything_is_written(tmp_path: Path, field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"inputs.{field} must be one of .*, got {value!r}"):
        ShardWriter(tmp_path / "build", dataclasses.replace(inputs(), **{field: value}))
    assert list(tmp_path.iterdir()) == []


def test_the_writer_needs_no_beam_nor_datasets(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("apache_beam", "datasets", "transformers", "tokenizers"):
                    raise ImportError(name + " is not installed")
        sys.meta_path.insert(0, Blocker())
        from pipeline.write.shard_writer import ShardWriter
        from schemas import BuildInputs, DatasetInputs, TokenizerInputs
        inputs = BuildInputs(DatasetInputs("d", "train", "00"), TokenizerInputs("t", "11", 10), "none", "given", 8,
                             "split", "best_fit_decreasing", 0, "0.1.0")
        with ShardWriter({str(tmp_path / "build")!r}, inputs) as writer:
            writer.write_examples([1, 2, 3, 4, 5], [2, 3])
        print(writer.manifest.fingerprint)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "build").fingerprint == result.stdout.strip()
