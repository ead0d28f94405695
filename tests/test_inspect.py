"""``python -m pipeline.inspect`` and the report figure pack writes: what a user sees of a build before training.

Builds come from the real pack command (GSM8K, the default tokenizer) and from ShardWriter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pytest

from loaders import PackedIterableDataset
from loaders.shard_reader import open_shard
from pipeline import cli
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.inspect import format_rows, main
from pipeline.pack import main as pack_main
from pipeline.report.figures import REPORT_NAME
from pipeline.write.random_build import random_token_build
from schemas import MANIFEST_NAME, BuildInputs, ManifestError, compute_fingerprint, read_manifest
from schemas.manifest import manifest_digest, shards_digest

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PACK_ARGS = ["--num-examples", "120", "--max-len", "512", "--no-progress"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GSM8K build written by the pack command, with its report figure."""
    out = tmp_path_factory.mktemp("packed")
    assert pack_main([*PACK_ARGS, "--out", str(out)]) == 0
    (build_dir,) = out.iterdir()
    return build_dir


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, from its header."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_pack_writes_the_report_beside_the_manifest_and_the_build_stays_the_same(packed: Path, tmp_path: Path, capsys) -> None:
    width, height = png_size(packed / REPORT_NAME)
    assert width > 1200 and height > 400
    # The figure changes nothing the loader, reuse or the fingerprint rely on.
    plain = tmp_path / "plain"
    assert pack_main([*PACK_ARGS, "--out", str(plain), "--no-report"]) == 0
    (plain_dir,) = plain.iterdir()
    assert plain_dir.name == packed.name and not (plain_dir / REPORT_NAME).exists()
    assert sorted(p.name for p in packed.iterdir()) == sorted([MANIFEST_NAME, REPORT_NAME, "shard-00000.arrow"])
    assert (packed / "shard-00000.arrow").read_bytes() == (plain_dir / "shard-00000.arrow").read_bytes()
    capsys.readouterr()
    assert pack_main([*PACK_ARGS, "--out", str(packed.parent)]) == 0
    assert "reusing" in capsys.readouterr().out
    batches = list(PackedIterableDataset(packed, batch_rows=1, verify_checksum=True))
    assert sum(int(b["cu_seq_lens_q"][-1]) for b in batches) == read_manifest(packed).num_tokens
    # A build made with --no-report gets its figure when a later run reuses it.
    assert pack_main([*PACK_ARGS, "--out", str(plain)]) == 0
    assert "reusing" in capsys.readouterr().out and png_size(plain_dir / REPORT_NAME)[0] > 1200


def test_pack_without_matplotlib_says_once_that_the_figure_was_skipped(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ImportError("No module named 'matplotlib'")
        sys.meta_path.insert(0, Blocker())
        from pipeline.pack import main
        sys.exit(main({[*PACK_ARGS, "--num-examples", "20", "--out", str(tmp_path)]!r}))
        """
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if "report figure" in line]
    assert skipped == [
        "varpack: report figure skipped: matplotlib is not installed; pip install 'varpack[plot]' (or pass --no-report)"
    ]
    (build_dir,) = tmp_path.iterdir()
    assert (build_dir / MANIFEST_NAME).exists() and not (build_dir / REPORT_NAME).exists()


def test_summary_names_the_inputs_and_the_packing(packed: Path, capsys) -> None:
    assert main([str(packed.parent)]) == 0  # the directory holding the one build
    out = capsys.readouterr().out
    manifest = read_manifest(packed)
    fields = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", out, re.MULTILINE))
    assert fields["build"] == str(packed)
    assert fields["fingerprint"].startswith(manifest.fingerprint)
    assert fields["dataset"].startswith("gsm8k, split test")
    assert fields["tokenizer"].startswith("mistral-7b-v0.1 (vocabulary 32,000")
    assert fields["special ids"] == "BOS 1, EOS 2" and fields["loss on"] == "response_and_eos"
    assert fields["fill"] == f"{100 * manifest.stats.fill:.3f}%"
    assert fields["examples"] == f"{manifest.stats.examples:,} read, {manifest.stats.examples:,} kept, 0 dropped"
    assert fields["segments"].startswith(f"{manifest.stats.segments:,} of the {manifest.stats.examples:,} examples kept; ")
    assert fields["bad rows"] == "none (--on-bad-row error)"


def test_summary_counts_the_bad_rows_left_out(tmp_path: Path, capsys) -> None:
    rows = [{"text": "a fine row"}, {"text": ""}, {"text": "another"}, {"text": None}, {"text": "and a third"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = ["--dataset", str(data), "--out", str(out), "--on-bad-row", "skip", "--max-bad-rows", "0.5", "--no-progress"]
    assert pack_main(args) == 0
    (build_dir,) = out.iterdir()
    assert sorted(p.name for p in build_dir.iterdir()) == [MANIFEST_NAME, "rejected.jsonl", REPORT_NAME, "shard-00000.arrow"]
    capsys.readouterr()
    assert pack_main(args) == 0 and "reusing" in capsys.readouterr().out
    assert main([str(build_dir)]) == 0
    (bad_rows,) = re.findall(r"^  bad rows\s+(.+)$", capsys.readouterr().out, re.MULTILINE)
    assert bad_rows == "2 rows (1 empty_text, 1 null), listed in rejected.jsonl (--on-bad-row skip)"


def test_json_summary_is_the_manifest_figures(packed: Path, capsys) -> None:
    assert main([str(packed), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = read_manifest(packed)
    assert summary["fingerprint"] == manifest.fingerprint and summary["inputs"] == manifest.inputs.to_dict()
    assert summary["stats"] == manifest.stats.to_dict() and summary["shards"] == len(manifest.shards)
    assert summary["rejected"] == {"rows": 0, "by_reason": {}}
    assert summary["examples_per_row"]["max"] == max(int(k) for k in manifest.stats.segments_per_row)


def test_rows_piped_mark_examples_and_trained_spans_in_plain_text(packed: Path, capsys) -> None:
    assert main([str(packed), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "\033[" not in out
    manifest = read_manifest(packed)
    shard = open_shard(packed / manifest.shards[0].path, manifest.capacity)
    rows = [shard.row(i) for i in range(2)]
    headers = re.findall(r"^row (\d+) \(shard-00000.arrow row \d+\): (\d+) examples?, ", out, re.MULTILINE)
    assert headers == [(str(i), str(len(r["cu_seqlens"]) - 1)) for i, r in enumerate(rows)]
    examples = re.findall(r"^  -- example (\d+): ", out, re.MULTILINE)
    assert examples == [str(e) for r in rows for e in r["example_ids"].tolist()]
    # Each example is [bos] prompt, then its trained response and EOS: one marked span ending in </s>.
    trained = re.findall(r"«(.*?)»", out, re.DOTALL)
    assert len(trained) == len(examples) and all(span.endswith("</s>") for span in trained)
    tokenizer = load_tokenizer().backend()
    first = rows[0]
    a, b = first["cu_seqlens"][:2]
    ids, mask = first["input_ids"][a:b], first["loss_mask"][a:b]
    response = tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert trained[0].replace("\n    ", "\n").strip() == response.strip()


def test_rows_on_a_terminal_are_coloured(packed: Path) -> None:
    manifest = read_manifest(packed)
    lines = list(format_rows(str(packed), manifest, 1, lambda ids: " ".join(map(str, ids.tolist())), color=True))
    assert lines[0].startswith("\033[1mrow 0 ") and "«" not in "".join(lines)
    assert any("\033[32m" in line for line in lines)


def test_split_examples_shown_as_ids_with_their_chunks(tmp_path: Path, capsys) -> None:
    manifest, tokens, loss_mask = random_token_build(tmp_path, [40, 5, 7], capacity=16, vocab_size=50, seed=1)
    assert main([str(tmp_path), "--rows", "10", "--ids"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  overflow\s+40 tokens split \(1 examples\)", out, re.MULTILINE)
    assert len(re.findall(r"from token (16|32) \(a later chunk of a split example\)", out)) == 2
    # Every token of every example appears once: the ids printed are the build's tokens.
    printed = sorted(int(t) for line in out.splitlines() if line.startswith("    ")
                     for t in line.replace("«", " ").replace("»", " ").split())
    assert printed == sorted(tokens.tolist())


@pytest.mark.parametrize("lengths", [np.random.default_rng(0).integers(1, 100, 300), [64]], ids=["many", "one full row"])
def test_plot_writes_the_figure_where_asked(tmp_path: Path, capsys, lengths) -> None:
    random_token_build(tmp_path / "build", lengths, capacity=64)
    assert main([str(tmp_path / "build"), "--plot", str(tmp_path / "figures")]) == 0
    assert png_size(tmp_path / "figures" / REPORT_NAME)[0] > 1200
    assert f"wrote {tmp_path / 'figures' / REPORT_NAME}" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory maps (Linux)")
def test_the_report_reads_a_build_one_shard_at_a_time(tmp_path: Path, monkeypatch) -> None:
    # Every shard stayed mapped until the last was read, and the pages the check touched (a byte per token) with
    # it: the pack command's memory grew with the build's tokens.
    from pipeline.report import profile

    manifest, _, _ = random_token_build(tmp_path, np.random.default_rng(0).integers(1, 100, 400), capacity=64,
                                        rows_per_shard=40)
    read_shard_table, mapped_before = profile.read_shard_table, []

    def reading(build_dir: str, info, capacity: int) -> pa.Table:
        maps = Path("/proc/self/maps").read_text()
        mapped_before.append(sum(str(tmp_path / shard.path) in maps for shard in manifest.shards))
        return read_shard_table(build_dir, info, capacity)

    monkeypatch.setattr(profile, "read_shard_table", reading)
    read = profile.read_profile(str(tmp_path), manifest)
    assert len(manifest.shards) >= 4 and mapped_before == [0] * len(manifest.shards)
    assert int(read.segment_lengths.sum()) == manifest.stats.tokens and read.row_tokens.size == manifest.stats.rows


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", r"^varpack: error: .*/missing: no such directory$"),
        ("empty", r"^varpack: error: .*/empty: no manifest.json; the build is missing or was interrupted"),
        ("two", r"^varpack: error: .*/two holds 2 builds \(a, b\); pass one of them$"),
        ("corrupt", r"^varpack: error: .*/corrupt/shard-00000.arrow: is missing or not a readable Arrow IPC file"),
        ("tokenizer", r"^varpack: error: cannot load tokenizer synthetic to decode the rows .*; pass --tokenizer PATH, "
                      r"or --ids to print token ids$"),
    ],
)
def test_bad_builds_fail_in_one_line(tmp_path: Path, capsys, setup: str, message: str) -> None:
    target, args = tmp_path / setup, []
    if setup == "empty":
        target.mkdir()
    elif setup == "two":
        for name in ("a", "b"):
            random_token_build(target / name, [3, 4], capacity=8)
    elif setup == "corrupt":
        random_token_build(target, [3, 4], capacity=8)
        (target / "shard-00000.arrow").write_bytes(b"not arrow")
        args = ["--rows", "1", "--ids"]
    elif setup == "tokenizer":
        random_token_build(target, [3, 4], capacity=8)
        args = ["--rows", "1"]
    assert main([str(target), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(message, err[0]), err


def forged(build: Path, edit) -> Path:
    """``build`` with its manifest edited by ``edit`` and every digest recomputed, as a forger would."""
    path = build / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    data["fingerprint"] = compute_fingerprint(BuildInputs.from_dict(data["inputs"]))
    data["shards_digest"] = shards_digest(data["shards"])
    del data["manifest_digest"]
    data["manifest_digest"] = manifest_digest(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda data: data.update(rows_per_shard=2**62), "field rows_per_shard must be at most 2147483647, got"),
        (lambda data: data["inputs"]["tokenizer"].update(name="gpt\x002"), "field inputs.tokenizer.name holds a NUL"),
        (lambda data: data["shards"][0].update(path="shard\x00-00000.arrow"), r"field shards\[0\].path holds a NUL"),
        (lambda data: data["stats"].update(segments_per_row={"many": 2}),
         "field stats.segments_per_row has key 'many', which must match"),
        (lambda data: data["shards"][0].update(bytes=10**30), r"field shards\[0\].bytes must be at most 9223372036854775807"),
        (lambda data: data.update(created_at="2026-01-01\n  rows 999,999 rows\x1b[31m"), "field created_at must match"),
    ],
    ids=["rows-per-shard-2**62", "nul-in-tokenizer-name", "nul-in-shard-path", "segments-key-not-a-number",
         "shard-bytes-10**30", "control-characters-in-created-at"],
)
def test_a_forged_manifest_is_one_line_naming_the_file_and_field(tmp_path: Path, capsys, edit, field: str) -> None:
    """A manifest whose digests were recomputed after an edit is refused by inspect and the loader alike."""
    build = tmp_path / "build"
    random_token_build(build, [3, 4, 5], capacity=8)
    path = forged(build, edit)
    message = rf"{re.escape(str(path))}: {field}"
    for args in ([], ["--rows", "1"]):
        assert main([str(build), *args]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.match(rf"^varpack: error: {message}", err[0]), err
    with pytest.raises(ManifestError, match=message):
        next(iter(PackedIterableDataset(build)))


def test_inspect_escapes_the_control_characters_of_a_manifests_strings(tmp_path: Path, capsys) -> None:
    """Names the schema cannot restrict (a dataset id, a tokenizer name) reach the terminal escaped: no line of
    inspect's output comes from a manifest's newline, and no escape sequence colours it."""
    build = tmp_path / "build"
    random_token_build(build, [3, 4, 5], capacity=8)

    def edit(data):
        data["inputs"]["dataset"]["id"] = "gsm8k\n  rows         999,999 rows\x1b[31m"
        data["inputs"]["tokenizer"]["name"] = "tok\r\x9b2J"
        data["shards"][0]["bytes"] = 2**63 - 1

    forged(build, edit)
    assert main([str(build)]) == 0
    out = capsys.readouterr().out
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", out)
    assert not any(line.lstrip().startswith("rows         999") for line in out.splitlines())
    assert "gsm8k\\x0a  rows         999,999 rows\\x1b[31m" in out and "tok\\x0d\\x9b2J" in out
    assert "9,223,372,036.9 GB" in out  # the largest size the schema allows


def test_inspect_routes_by_the_file_it_names_whatever_the_options_before_it(packed: Path, tmp_path: Path,
                                                                             capsys) -> None:
    """A mixture file after options is a mixture; a manifest, by its content, is a build."""
    for name in ("a", "b"):
        random_token_build(tmp_path / name, [3, 4, 5], capacity=8)
    mixture = tmp_path / "mixture.json"
    mixture.write_text(json.dumps({"sources": {"a": "a", "b": "b"}, "weights": {"a": 1, "b": 1}}))
    for args in (["--steps", "5", str(mixture)], ["--step=5", "--batch-rows", "1", str(mixture)], ["--", str(mixture)]):
        assert cli.main(["inspect", *args]) == 0, args
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["name"] for r in records] == ["a", "b"], args
    assert cli.main(["inspect", "--json", str(packed / MANIFEST_NAME)]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"] == read_manifest(packed).fingerprint


@pytest.mark.parametrize(("option", "value"), [("--steps", "-1"), ("--steps", "0"), ("--batch-rows", "0")])
def test_inspect_of_a_mixture_names_a_bad_option(tmp_path: Path, capsys, option: str, value: str) -> None:
    for name in ("a", "b"):
        random_token_build(tmp_path / name, [3, 4, 5], capacity=8)
    mixture = tmp_path / "mixture.json"
    mixture.write_text(json.dumps({"sources": {"a": "a", "b": "b"}, "weights": {"a": 1, "b": 1}}))
    assert cli.main(["inspect", str(mixture), option, value]) == 1
    assert capsys.readouterr().err == f"varpack inspect: error: {option} must be a positive integer, got {value}\n"


def test_varpack_dispatches_to_the_commands(packed: Path, capsys) -> None:
    assert cli.main(["inspect", str(packed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"] == read_manifest(packed).fingerprint
    assert cli.main(["--help"]) == 0 and "pack" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert capsys.readouterr().err.strip() == "varpack: error: unknown command 'frobnicate'; choose one of pack, inspect, check"
    for command in ("pack", "inspect"):  # the help names the command as typed
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert capsys.readouterr().out.startswith(f"usage: varpack {command} ")


def test_varpack_check_needs_no_beam(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("apache_beam", "datasets", "tokenizers", "transformers"):
                    raise ImportError(name + " is not installed on a GPU box")
        sys.meta_path.insert(0, Blocker())
        from pipeline.cli import main
        sys.exit(main(["check", "--help"]))
        """
    )
    result = run_python(code, tmp_path)
    if importlib.util.find_spec("loaders.check") is None:
        assert result.returncode == 1
        assert result.stderr.strip() == (
            "varpack: error: varpack check is not in this installation (no module loaders.check); install a varpack that has it"
        )
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: varpack check ")


def example_ids_in(build_dir: Path) -> set[int]:
    """The example ids the build's shards hold."""
    ids: set[int] = set()
    for shard in read_manifest(build_dir).shards:
        table = pa.ipc.open_file(pa.memory_map(str(build_dir / shard.path))).read_all()
        ids.update(pa.compute.list_flatten(table.column("example_ids")).to_pylist())
    return ids


LONG_PROMPT = {"prompt": "A question that runs on and on. " * 60, "response": "An answer truncation never reaches."}


@pytest.mark.parametrize(
    ("overflow", "key", "reason"),
    [("drop", "too_long", "longer than --max-len 256 (--overflow drop)"),
     ("truncate", "untrained", "with no trained token within --max-len 256 (--overflow truncate)")],
)
def test_examples_read_kept_and_dropped_agree_in_the_report_the_manifest_and_inspect(
    tmp_path: Path, capsys, overflow: str, key: str, reason: str
) -> None:
    rows = [{"prompt": f"Question {i}?", "response": f"Answer {i}."} if i % 3 else LONG_PROMPT for i in range(30)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = ["--dataset", str(data), "--out", str(out), "--max-len", "256", "--overflow", overflow, "--no-progress", "--no-report"]
    assert pack_main(args) == 0
    report = capsys.readouterr().out
    (build_dir,) = out.iterdir()
    kept = len(example_ids_in(build_dir))
    assert kept == 20
    line = f"30 read, 20 kept, 10 dropped: 10 {reason}"
    assert re.search(rf"^  examples\s+{re.escape(line)}$", report, re.MULTILINE), report
    stats = read_manifest(build_dir).stats
    assert (stats.examples_read, stats.examples_kept) == (30, 20)
    assert main([str(build_dir)]) == 0
    assert re.search(rf"^  examples\s+{re.escape(line)}$", capsys.readouterr().out, re.MULTILINE)
    assert main([str(build_dir), "--json"]) == 0
    examples = json.loads(capsys.readouterr().out)["examples"]
    assert examples == {"read": 30, "kept": 20, "dropped": {key: 10}}
