"""Input as users have it and output they can read: BOM-prefixed JSON arrays, lone surrogates named
by line, dictionary-encoded and nested Parquet columns, truncation that leaves nothing to train,
plurals, progress bars that clean up after themselves, and a quiet multi-process run."""

from __future__ import annotations

import codecs
import dataclasses
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import pack
from pipeline.report import progress
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.errors import InputError
from pipeline.report.summary import format_report
from schemas import PackingStats
from tests.test_bad_rows import transformers_tokens
from tests.test_pipeline_e2e import read_examples, run_cli

RECORDS = [{"prompt": f"What is {i} times {i}?", "response": f"It is {i * i}."} for i in range(20)]


def config(path, tmp_path, **changes) -> PackConfig:
    return PackConfig(dataset=str(path), out=str(tmp_path / "out"), max_len=64, progress=False, **changes)


def packed_tokens(result) -> list[list[int]]:
    examples = read_examples(result.out_dir)
    return [examples[i][0].tolist() for i in sorted(examples)]


def test_a_json_array_with_a_byte_order_mark_is_read(tmp_path):
    plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
    plain.write_text(json.dumps(RECORDS), encoding="utf-8")
    marked.write_bytes(codecs.BOM_UTF8 + json.dumps(RECORDS, indent=1).encode())
    lines = tmp_path / "marked.jsonl"
    lines.write_bytes(codecs.BOM_UTF8 + "".join(json.dumps(r) + "\n" for r in RECORDS).encode())
    expected = packed_tokens(build(config(plain, tmp_path)))
    assert packed_tokens(build(config(marked, tmp_path))) == expected
    assert packed_tokens(build(config(lines, tmp_path))) == expected


def test_a_lone_surrogate_is_named_by_line_or_row(tmp_path):
    lines = [json.dumps(r) for r in RECORDS[:4]]
    lines[2] = '{"prompt": "broken \\ud800 text", "response": "ok"}'
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text("\n\n".join(lines) + "\n")  # blank lines between records: record 2 is line 5
    with pytest.raises(InputError, match=rf"^{jsonl} line 5: column 'prompt' holds a lone surrogate"):
        build(config(jsonl, tmp_path))
    array = tmp_path / "s.json"
    array.write_text("[" + ",".join(lines) + "]")
    with pytest.raises(InputError, match=rf"^{array} row 2: column 'prompt' holds a lone surrogate"):
        build(config(array, tmp_path))
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps(RECORDS[0]) + '\n{"prompt": "a", "response": "b", "note": "\\udc00"}\n')
    with pytest.raises(InputError, match=rf"^{elsewhere} line 2: holds a lone surrogate"):
        build(config(elsewhere, tmp_path))


@pytest.mark.parametrize("bad_line, message", [
    (b'{"prompt": "caf\xff", "response": "ok"}', "not UTF-8 text (byte 0xff at byte 15 of the line)"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "response": "ok"}', "not valid JSON (nested too deeply to read)"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON (nested too deeply to read)"),
    (b"null", "not a JSON object; fix or remove it, or pass --on-bad-row skip"),
])
@pytest.mark.parametrize("at_line", [1, 3])
def test_a_bad_json_line_is_one_line_naming_the_file_and_line(tmp_path, capsys, bad_line, message, at_line):
    lines = [json.dumps(r).encode() for r in RECORDS[:4]]
    lines.insert(at_line - 1, bad_line)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert pack.main(["--dataset", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("varpack: packing")]
    assert len(errors) == 1 and errors[0].startswith(f"varpack: error: {path} line {at_line}: {message}"), errors
    assert not list((tmp_path / "out").rglob("*.*"))


def test_dictionary_encoded_and_nested_parquet_columns_are_read(tmp_path):
    flat = pa.Table.from_pylist(RECORDS)
    pq.write_table(flat, tmp_path / "flat.parquet")
    expected = packed_tokens(build(config(tmp_path / "flat.parquet", tmp_path)))
    pq.write_table(flat.cast(pa.schema([(n, pa.dictionary(pa.int32(), pa.string())) for n in flat.column_names])),
                   tmp_path / "categorical.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "categorical.parquet").field("prompt").type)
    assert packed_tokens(build(config(tmp_path / "categorical.parquet", tmp_path))) == expected
    nested = pa.table({"data": pa.StructArray.from_arrays([flat["prompt"].combine_chunks(), flat["response"].combine_chunks()],
                                                          names=["question", "answer"]), "id": list(range(20))})
    pq.write_table(nested, tmp_path / "nested.parquet")
    (tmp_path / "nested.jsonl").write_text("".join(json.dumps(r) + "\n" for r in nested.to_pylist()))
    for name in ("nested.parquet", "nested.jsonl"):
        result = build(config(tmp_path / name, tmp_path, prompt_column="data.question", response_column="data.answer"))
        assert packed_tokens(result) == expected, name
    with pytest.raises(InputError, match=r"column 'data' has no field 'title' \(fields: question, answer\)"):
        build(config(tmp_path / "nested.parquet", tmp_path, prompt_column="data.title", response_column="data.answer"))


def test_truncation_drops_examples_with_nothing_left_to_train(tmp_path):
    records = [{"prompt": "Short question?", "response": "Short answer."},
               {"prompt": "A very long question. " * 30, "response": "Never reached."}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = build(config(path, tmp_path, overflow="truncate"))
    stats = result.manifest.stats
    assert stats.examples == 1 and stats.examples_untrained == 1 and stats.tokens_untrained > 64
    assert len(read_examples(result.out_dir)) == 1
    report = format_report(stats, 64, 1, result.out_dir, 0.1, False, result.manifest.rejected)
    assert "1 example (" in report and "dropped with no trained token left after truncation" in report
    assert "1 row of 64 tokens in 1 shard\n" in report


def test_report_plurals():
    stats = PackingStats(examples=3, segments=3, tokens=30, rows=2, capacity_tokens=128, segments_per_row={"1": 1, "2": 1})
    assert "2 rows of 64 tokens in 3 shards" in format_report(stats, 64, 3, "out", 1.0, False)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_are_drawn_one_at_a_time_and_cleared(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("COLUMNS", "100")
    progress.enable()
    try:
        for _ in range(4):
            progress.advance("examples tokenized", 25, 100, "ex")
        for _ in range(2):
            progress.advance("rows written", 5, 10, "rows")
    finally:
        progress.close()
    output = terminal.getvalue()
    assert "examples tokenized" in output and "rows written" in output
    assert "\x1b[A" not in output and "\n" not in output  # no second line, so no cursor moved up into later output
    assert output.endswith("\r")  # the last bar's line is cleared


def test_a_multi_process_run_prints_only_its_own_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    result = run_cli(["--dataset", str(path), "--direct_running_mode=multi_processing", "--direct_num_workers=2",
                      "--no-progress"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line.split(" ", 2)[:2] for line in result.stderr.splitlines()] == [["varpack:", "packing"]], result.stderr
    assert np.all([line.startswith(("varpack: wrote", "  ")) for line in result.stdout.splitlines()])


def test_long_conversations_are_truncated_by_default_never_split_into_chunks_that_start_mid_conversation(tmp_path, capsys):
    long_chat = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"Turn {k}: " + "words " * 12} for k in range(8)]
    short_chat = long_chat[:2]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in (long_chat, short_chat)))
    result = build(config(path, tmp_path))
    stats = result.manifest.stats
    assert result.manifest.inputs.overflow == "truncate"
    assert stats.examples == 2 and stats.examples_truncated == 1 and stats.segments == 2 and stats.examples_split == 0
    whole = build(dataclasses.replace(config(path, tmp_path), max_len=1024))
    assert whole.manifest.inputs.overflow == "truncate" and whole.manifest.stats.examples_truncated == 0
    complete = read_examples(whole.out_dir)
    assert complete[0][0].tolist() == transformers_tokens(plan_build(config(path, tmp_path)), long_chat)
    for i, (tokens, mask) in read_examples(result.out_dir).items():  # each example is the start of its conversation
        assert np.array_equal(tokens, complete[i][0][:64]) and np.array_equal(mask, complete[i][1][:64])
    split = build(config(path, tmp_path, overflow="split"))
    assert split.manifest.inputs.overflow == "split" and split.manifest.stats.examples_split == 1
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "words " * 100}) + "\n")
    assert build(config(text, tmp_path)).manifest.inputs.overflow == "split"  # text data splits, as before


def test_tool_calls_and_reasoning_are_read_alike_from_json_lines_json_and_parquet(tmp_path):
    """A message's tool_calls (arguments an object, or OpenAI's JSON text), tool_call_id and reasoning_content are
    read from every format and reach the chat template the same way: the same tokens from each file."""
    from tests.test_chat_templates import TOOLS_SPECIALS, TOOLS_TEMPLATE, byte_level_directory

    directory = byte_level_directory(tmp_path / "tok", TOOLS_SPECIALS, {"eos_token": "<|im_end|>"})
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    chats = [
        [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "content": "4", "tool_call_id": "call_1"},
         {"role": "assistant", "content": "It is 4.", "reasoning_content": "The tool said 4."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    ]
    as_text = json.loads(json.dumps(chats))
    as_text[0][1]["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 2}'
    files = {"object.jsonl": chats, "text.jsonl": as_text}
    for name, rows in files.items():
        (tmp_path / name).write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in rows))
    (tmp_path / "array.json").write_text(json.dumps([{"messages": chat} for chat in chats]))
    pq.write_table(pa.Table.from_pylist([{"messages": chat} for chat in as_text]), tmp_path / "table.parquet")
    tokens = []
    for name in ("object.jsonl", "text.jsonl", "array.json", "table.parquet"):
        result = build(PackConfig(dataset=str(tmp_path / name), out=str(tmp_path / name.replace(".", "-")), max_len=256,
                                  progress=False, tokenizer=str(directory), chat_template=TOOLS_TEMPLATE))
        tokens.append(packed_tokens(result))
        assert result.manifest.stats.chat_turns["tool"] == {"read": 1, "used": 1, "unwritten.tool_call_id": 1}
        assert result.manifest.stats.chat_turns["assistant"] == {"read": 3, "used": 3, "unwritten.reasoning_content": 1}
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
