"""``from pipeline import pack_dataset``: rows held in memory pack into the build the command line makes of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import pack_dataset
from pipeline.errors import ConfigError, InputError
from schemas import read_manifest

ROWS = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "Name a colour of the sky.", "answer": "Blue, on a clear day."},
    {"question": "How many legs has a spider?", "answer": "Eight"},
    {"question": "Spell cat backwards.", "answer": "tac"},
]
OPTIONS = {"max_len": 32, "seed": 3, "progress": False, "report": False}


def undated(manifest: bytes) -> dict:
    """A manifest without the time it was written (and the digest that covers that time)."""
    fields = json.loads(manifest)
    del fields["created_at"], fields["manifest_digest"]
    return fields


def files(build_dir: str) -> dict[str, bytes]:
    """Every file of a build, by name."""
    return {path.name: path.read_bytes() for path in sorted(Path(build_dir).iterdir()) if path.is_file()}


def test_a_dataset_packs_byte_identical_to_the_command_lines_build_of_the_same_rows(tmp_path):
    """A Dataset (a selection in another order, as users hold them) gives the shards and manifest that
    ``pack --dataset rows.parquet`` writes of the same table."""
    dataset = datasets.Dataset.from_list(ROWS).select([3, 0, 2, 1])
    ours = pack_dataset(dataset, out=str(tmp_path / "api"), name="rows", **OPTIONS)

    pq.write_table(pa.Table.from_pylist([ROWS[i] for i in (3, 0, 2, 1)]), tmp_path / "rows.parquet")
    cli = subprocess.run(
        [sys.executable, "-m", "pipeline.pack", "--dataset", str(tmp_path / "rows.parquet"), "--out", str(tmp_path / "cli"),
         "--max-len", "32", "--seed", "3", "--no-progress", "--no-report"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert cli.returncode == 0, cli.stderr
    (cli_dir,) = (tmp_path / "cli").iterdir()

    assert Path(ours).name == cli_dir.name
    manifest = read_manifest(ours)
    assert manifest.stats.examples == len(ROWS) and manifest.stats.source_files == ["rows.parquet"]
    ours_files, cli_files = files(ours), files(str(cli_dir))
    assert any(name.endswith(".arrow") for name in ours_files)
    assert ours_files.keys() == cli_files.keys()
    assert {name: data for name, data in ours_files.items() if name != "manifest.json"} == {
        name: data for name, data in cli_files.items() if name != "manifest.json"}
    assert undated(ours_files["manifest.json"]) == undated(cli_files["manifest.json"])


def test_a_table_and_a_list_of_dicts_give_the_datasets_build_and_leave_no_scratch_file(tmp_path):
    """The same rows as a Table or a list of dicts are the same build: the second and third calls reuse it,
    whatever fingerprint the Dataset carries."""
    before = set(os.listdir(tempfile.gettempdir()))
    first = pack_dataset(datasets.Dataset.from_list(ROWS).map(lambda row: row), out=str(tmp_path), **OPTIONS)
    assert pack_dataset(pa.Table.from_pylist(ROWS), out=str(tmp_path), **OPTIONS) == first
    assert pack_dataset(iter(ROWS), out=str(tmp_path), **OPTIONS) == first
    assert len(os.listdir(tmp_path)) == 1
    assert not [name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("varpack-rows-")]


@pytest.mark.parametrize(
    ("data", "options", "message"),
    [
        (ROWS, {"max_length": 32}, "unknown option 'max_length'"),
        ("rows.jsonl", {}, "not str; to pack a file"),
        ([{"question": "q"}, ["not", "a", "dict"]], {}, "row 1 is a list"),
        ([{"question": "q"}, {"question": 5}], {}, "do not make one table"),
        ([], {}, "^pack_dataset: no rows$"),
        (pa.table({"question": pa.array([], pa.string())}), {}, "^pack_dataset: no rows$"),
        (ROWS, {"beam_args": ["--direct_running_mode=multi_threading"]}, "loses elements"),
    ],
)
def test_bad_data_and_options_are_one_line_errors_and_write_nothing(tmp_path, data, options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        pack_dataset(data, out=str(tmp_path / "out"), **options)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_key_first_seen_in_a_later_dict_is_a_column(tmp_path):
    """The columns are the keys of every dict: row 1's ``input`` is read (Alpaca), as the command line reads it."""
    rows = [{"instruction": "Say hi", "output": "hi"}, {"instruction": "Translate", "input": "hello", "output": "bonjour"}]
    stats = read_manifest(pack_dataset(rows, out=str(tmp_path), **{**OPTIONS, "max_len": 256})).stats
    assert stats.source_columns_used == ["instruction", "input", "output"] and not stats.source_columns_unused


def test_a_bad_rows_error_names_the_data_passed_not_a_scratch_file(tmp_path):
    with pytest.raises(InputError, match=r"^pack_dataset data row 1: 'answer' is null") as caught:
        pack_dataset([ROWS[0], {"question": "q", "answer": None}], out=str(tmp_path / "out"), **OPTIONS)
    assert "varpack-rows-" not in str(caught.value) and not list((tmp_path / "out").glob("*/manifest.json"))


def test_a_name_that_is_not_a_file_name_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="name '../x'"):
        pack_dataset(ROWS, out=str(tmp_path), name="../x")
