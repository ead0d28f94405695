"""The cache of converted tokenizers (``$VARPACK_CACHE_DIR/tokenizers``): a corrupt entry is converted again,
naming the file, and a cache that cannot be written still lets a build be packed or reused, with a line that says so."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.build import build
from pipeline.config import PackConfig
from pipeline.encode.tokenizer import load_tokenizer


def test_a_corrupt_cached_tokenizer_is_named_and_converted_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    first = load_tokenizer()
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json")
    whole = cached.read_bytes()
    cached.write_bytes(whole[: len(whole) // 2])  # "EOF while parsing", naming nothing, before
    capsys.readouterr()
    again = load_tokenizer()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"varpack: {cached}: the cached tokenizer cannot be read (")
    assert line.endswith("); converting it again")
    assert cached.read_bytes() == whole
    assert again.content_hash == first.content_hash


def test_an_altered_cached_tokenizer_is_named_and_converted_again(tmp_path, monkeypatch, capsys):
    """A cached tokenizer.json that is still JSON but altered (two vocabulary ids swapped) was used as is, giving
    other token ids for the same text: its sha256, recorded beside it when written, no longer matches."""
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    first = load_tokenizer()
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json")
    whole = cached.read_bytes()
    altered = json.loads(whole)
    vocab = altered["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    cached.write_text(json.dumps(altered))
    capsys.readouterr()
    again = load_tokenizer()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"varpack: {cached}: the cached tokenizer is not the one converted there (sha256 ")
    assert line.endswith("); converting it again")
    assert cached.read_bytes() == whole
    assert again.content_hash == first.content_hash
    load_tokenizer()
    assert capsys.readouterr().err == ""  # the reconverted entry is used as it is


def test_a_cache_that_cannot_be_written_still_reuses_a_build(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}"}) + "\n"
                            for i in range(10)))
    config = PackConfig(dataset=str(data), out=str(tmp_path / "out"), max_len=64, progress=False)
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))
    first = build(config)
    (tmp_path / "not-a-directory").write_text("")
    unwritable = tmp_path / "not-a-directory" / "cache"  # mkdir fails there, for root too
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(unwritable))
    capsys.readouterr()
    reused = build(config)
    assert reused.reused and reused.out_dir == first.out_dir
    lines = [line for line in capsys.readouterr().err.splitlines() if "tokenizer cache" in line]
    assert len(lines) == 1 and lines[0].startswith(f"varpack: the tokenizer cache {unwritable / 'tokenizers'} cannot "
                                                   "be written (")
    assert lines[0].endswith("for this run; point $VARPACK_CACHE_DIR at a writable directory to keep it")
    assert not Path(unwritable).exists()
