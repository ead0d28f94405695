"""Input as users have it and output they can read: BOM-prefixed JSON arrays, lone surrogates named
by line, dictionary-encoded and nested Parquet columns, truncation that leaves nothing to train,
plurals, progress bars that clean up after themselves, and a quiet multi-process run."""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import pack
from pipeline.report import progress
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.bad_rows import REJECTED_NAME, Reason, RowProblem
from pipeline.encode.chat import conversation
from pipeline.errors import InputError
from pipeline.pack import main
from pipeline.report.summary import format_report
from schemas import PackingStats, read_manifest
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


def sharegpt_turns(*turns: tuple[str, str | None]) -> list[dict]:
    return [{"from": speaker, "value": value} for speaker, value in turns]


# The shapes the first 400 conversations of ShareGPT_V3_unfiltered_cleaned_split hold, and a few more of
# their kind, each with the messages a build trains on (None: left out whole) and the kinds of turns dropped.
SPLIT_DUMP = [
    (sharegpt_turns(("gpt", "...and so on."), ("human", "Go on"), ("gpt", "Then this."), ("human", ""), ("gpt", "Lost answer."),
                    ("human", "Thanks"), ("gpt", "Welcome.")),
     [("user", "Go on"), ("assistant", "Then this."), ("user", "Thanks"), ("assistant", "Welcome.")],
     ["leading_assistant", "empty_user", "answer_to_empty_user"]),
    (sharegpt_turns(("human", "Hi"), ("gpt", "Hello!"), ("human", "Thanks"), ("human", "Will do"), ("gpt", "Bye!")),
     [("user", "Hi"), ("assistant", "Hello!"), ("user", "Will do"), ("assistant", "Bye!")], ["unanswered_user"]),
    (sharegpt_turns(("system", " "), ("human", "Q1"), ("gpt", None), ("human", "Q2"), ("gpt", "A2"), ("human", "Q3")),
     [("user", "Q2"), ("assistant", "A2")], ["empty_system", "unanswered_user", "empty_assistant", "trailing_user"]),
    (sharegpt_turns(("system", "Be brief."), ("human", "  "), ("gpt", "Sure."), ("human", "2 + 2?"), ("gpt", "4")),
     [("system", "Be brief."), ("user", "2 + 2?"), ("assistant", "4")], ["empty_user", "answer_to_empty_user"]),
    ([], None, []),
    (sharegpt_turns(("system", "*This chat conversation is shared from TypingMind.com*")), None, []),
    (sharegpt_turns(("gpt", "orphan")), None, ["leading_assistant"]),
]


def test_a_split_chat_dump_packs_with_the_defaults_and_trains_on_exactly_the_assistant_turns_left(tmp_path, capsys):
    """Empty turns, a user turn answered by another, empty or system-only conversations: what a real ShareGPT
    dump holds packs with the defaults; each turn dropped is counted by kind, conversations with nothing left
    are listed in rejected.jsonl, and the loss covers exactly the assistant turns that remain."""
    path = tmp_path / "dump.jsonl"
    path.write_text("".join(json.dumps({"id": k, "conversations": value}) + "\n" for k, (value, _, _) in enumerate(SPLIT_DUMP)))
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + eos_token }}{% endfor %}"
    out = tmp_path / "out"
    assert main(["--dataset", str(path), "--chat-template", template, "--out", str(out), "--max-len", "256", "--no-progress"]) == 0
    report = capsys.readouterr().out
    assert re.search(r"rejected +3 rows \(2 no_chat_turns, 1 only_dangling_turns\), listed in rejected.jsonl", report), report
    assert re.search(
        r"trimmed +dropped 1 leading assistant turn, 1 trailing user turn, 2 unanswered user turns, 1 empty system turn, "
        r"2 empty user turns, 2 turns answering an empty user turn and 1 empty assistant turn in 4 conversations", report
    ), report
    (build_dir,) = out.iterdir()
    manifest = read_manifest(build_dir)
    # The turns of a conversation left out whole are not counted: it is listed in rejected.jsonl as it is.
    dropped = [kind for _, messages, kinds in SPLIT_DUMP if messages is not None for kind in kinds]
    assert manifest.stats.dangling_turns_dropped == {kind: dropped.count(kind) for kind in set(dropped)}
    assert manifest.stats.conversations_trimmed == 4 and manifest.rejected.rows == 3
    assert manifest.stats.chat_turns["assistant"] == {"read": 10, "used": 6}
    kept = {k: [{"role": role, "content": text} for role, text in messages]
            for k, (_, messages, _) in enumerate(SPLIT_DUMP) if messages is not None}
    plan = plan_build(PackConfig(dataset=str(path), chat_template=template))
    backend = plan.tokenizer.backend()
    examples = read_examples(build_dir)
    assert sorted(examples) == sorted(kept)
    for k, messages in kept.items():
        tokens, mask = examples[k]
        assert tokens.tolist() == transformers_tokens(plan, messages, template)
        trained = backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
        assert trained == "".join(f"assistant: {m['content']}</s>" for m in messages if m["role"] == "assistant")
    records = [json.loads(line) for line in (build_dir / REJECTED_NAME).read_text().splitlines()]
    assert [(r["where"], r["reason"], r["row"]["conversations"]) for r in records] == [
        (f"{path} line {k + 1}", reason, SPLIT_DUMP[k][0])
        for k, reason in [(4, "no_chat_turns"), (5, "no_chat_turns"), (6, "only_dangling_turns")]
    ]


def test_messages_data_refuses_empty_turns_unless_asked_to_drop_them(tmp_path):
    """``{role, content}`` data keeps its rules: an empty turn is a bad row naming it, unless --drop-dangling-turns;
    --keep-dangling-turns refuses it in ShareGPT data too."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Yes"}]
    with pytest.raises(RowProblem, match=r"^turn 2 \(assistant\) is empty$") as refused:
        conversation(messages)
    assert refused.value.reason == Reason.EMPTY_TURN
    chat = conversation(messages, drop_dangling_turns=True)
    assert chat.messages == messages[2:] and chat.dropped == ("unanswered_user", "empty_assistant")
    shared = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in messages]
    assert conversation(shared).messages == messages[2:]
    with pytest.raises(RowProblem, match=r"^turn 2 \(assistant\) is empty$"):
        conversation(shared, drop_dangling_turns=False)
    for value in ([], [{"role": "system", "content": "Be brief."}]):
        with pytest.raises(RowProblem) as refused:
            conversation(value, drop_dangling_turns=False)
        assert refused.value.reason in (Reason.NOT_A_CONVERSATION, Reason.NO_ASSISTANT_TURN)
    with pytest.raises(RowProblem) as refused:
        conversation([{"role": "system", "content": "Be brief."}])
    assert refused.value.reason == Reason.NO_ASSISTANT_TURN


EMPTY_VALUES = st.sampled_from([None, "", " ", "\n\t"])


@st.composite
def split_conversations(draw):
    """A well-formed ShareGPT conversation (an optional system turn, exchanges of a user turn and an answer,
    some answers calling a tool), with turns emptied and user turns whose answer is missing put in anywhere."""
    turns = [("system", draw(st.sampled_from(["Be brief.", None, ""])))] if draw(st.booleans()) else []
    for k in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 4)) == 0:
            turns.append(("human", f"unanswered {k}"))
        answer = [("gpt", f"answer {k}")]
        if draw(st.booleans()):
            answer = [("function_call", json.dumps({"name": "add", "arguments": {"a": k}})), ("observation", f"{k}"), *answer]
        turns += [("human", f"question {k}"), *answer]
    emptied = draw(st.sets(st.integers(0, max(len(turns) - 1, 0)), max_size=3))
    return [(speaker, draw(EMPTY_VALUES) if k in emptied else text) for k, (speaker, text) in enumerate(turns)]


def expected_exchanges(turns: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """The turns of ``turns`` a build trains on: the system turn when it says something, and each exchange
    (a user turn and the answer up to the next user turn) none of whose turns is empty."""
    def said(text):
        return text is not None and text.strip()

    roles = {"system": "system", "human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    kept = [("system", text) for speaker, text in turns[:1] if speaker == "system" and said(text)]
    starts = [k for k, (speaker, _) in enumerate(turns) if speaker == "human"] + [len(turns)]
    for start, end in zip(starts, starts[1:]):
        exchange = turns[start:end]
        if len(exchange) > 1 and all(said(text) for _, text in exchange):
            kept += [(roles[speaker], text) for speaker, text in exchange]
    return kept


@settings(max_examples=300, deadline=None)
@given(split_conversations())
def test_empty_turns_in_any_role_and_place_drop_exactly_the_exchanges_that_hold_them(turns):
    value = sharegpt_turns(*turns)
    expected = expected_exchanges(turns)
    try:
        chat = conversation(value)
    except RowProblem as problem:
        assert not any(role == "assistant" for role, _ in expected), problem
        assert problem.reason in (Reason.EMPTY_TURN, Reason.NO_CHAT_TURNS, Reason.NO_ASSISTANT_TURN,
                                  Reason.ONLY_DANGLING_TURNS)
        return
    assert [(m["role"], m["content"]) for m in chat.messages if not m.get("tool_calls")] == [
        (role, text) for role, text in expected if not text.startswith("{")
    ]
    assert len(chat.messages) + len(chat.dropped) == len(value)
    assert chat.dropped.count("empty_system") == sum(s == "system" and not (t or "").strip() for s, t in turns)
    if chat.dropped:  # --keep-dangling-turns refuses what the default drops
        with pytest.raises(RowProblem):
            conversation(value, drop_dangling_turns=False)
    else:
        assert conversation(value, drop_dangling_turns=False) == chat


def test_an_empty_or_null_function_call_turn_is_dropped_with_its_exchange(tmp_path, capsys):
    """A ShareGPT ``function_call`` turn holding null or nothing is an empty assistant turn: its exchange is
    dropped and counted, the build goes on; ``--keep-dangling-turns`` refuses it as an empty turn."""
    call = json.dumps({"name": "add", "arguments": {"a": 1}})
    for empty in (None, "", "  "):
        value = sharegpt_turns(("human", "Add 1"), ("function_call", empty), ("observation", "2"), ("gpt", "2"),
                               ("human", "Thanks"), ("gpt", "Welcome"), ("human", "Again"), ("function_call", call),
                               ("observation", "3"), ("gpt", "3"))
        chat = conversation(value)
        assert [m["content"] for m in chat.messages] == ["Thanks", "Welcome", "Again", "", "3", "3"]
        assert chat.dropped == ("unanswered_user", "empty_assistant", "rest_of_empty_answer", "rest_of_empty_answer")
        with pytest.raises(RowProblem, match=r"^turn 2 \(assistant\) is empty$"):
            conversation(value, drop_dangling_turns=False)
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"conversations": value}) + "\n")
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
                "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    assert main(["--dataset", str(path), "--chat-template", template, "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert "1 empty assistant turn" in capsys.readouterr().out


def test_a_rejected_chat_row_keeps_the_null_texts_the_source_holds(tmp_path):
    """rejected.jsonl holds a chat row as the source wrote it: a turn's ``"value": null`` stays; the fields
    reading gave every message (``role`` and ``content`` of a ShareGPT turn) do not appear."""
    rows = [sharegpt_turns(("human", "Hi"), ("gpt", "Hello")), sharegpt_turns(("human", None), ("gpt", "Lost"))]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"conversations": value}) + "\n" for value in rows))
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + eos_token }}{% endfor %}"
    out = tmp_path / "out"
    assert main(["--dataset", str(path), "--chat-template", template, "--out", str(out), "--on-bad-row", "skip",
                 "--max-bad-rows", "1", "--no-progress", "--no-report"]) == 0
    (build_dir,) = out.iterdir()
    (record,) = [json.loads(line) for line in (build_dir / REJECTED_NAME).read_text().splitlines()]
    assert record["reason"] == "empty_turn" and record["row"] == {"conversations": rows[1]}


def test_a_user_turn_none_of_whose_text_is_kept_is_not_counted_as_used(tokenizer_and_template):
    """Truncation that keeps the template's ``[INST]`` of a user turn but none of its text leaves it unused."""
    from pipeline.encode.examples import Encoder
    from pipeline.read.formats import ExampleFormat
    from pipeline.read.readers import MESSAGES_TYPE, BatchRows
    from schemas import ExampleKind

    tokenizer, template = tokenizer_and_template
    conv = sharegpt_turns(("human", "Hi"), ("gpt", "Hello there."), ("human", "Tell me a long story about dragons please."),
                          ("gpt", "No."))
    messages = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in conv]
    fmt = ExampleFormat(ExampleKind.CHAT, ("conversations",), chat_template=template)
    text, _ = Encoder(tokenizer, fmt, 4096, "truncate")._apply_template(messages)
    encoding = tokenizer.backend().encode(text, add_special_tokens=False)
    end = text.index("</s>") + len("</s>")
    max_len = next(i for i, (start, _) in enumerate(encoding.offsets) if start >= end) + 1  # one template token past </s>
    assert encoding.offsets[max_len][0] <= text.index(conv[2]["value"])
    table = pa.table({"conversations": pa.array([conv], MESSAGES_TYPE)})
    for length, used in ((max_len, 1), (len(encoding.ids), 2)):
        batch = Encoder(tokenizer, fmt, length, "truncate").encode(table, BatchRows("t", 0))
        assert (batch.turns["user.read"], batch.turns["user.used"]) == (2, used), length


@pytest.fixture(scope="module")
def tokenizer_and_template():
    plan = plan_build(PackConfig(dataset="synthetic-flan"))
    from pipeline.encode.chat_templates import MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE

    return plan.tokenizer, MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE


def test_a_turn_of_weight_0_is_not_trained_on_and_another_weight_is_a_bad_row(tmp_path, capsys):
    """axolotl's ShareGPT ``weight``: an assistant turn of weight 0 stays in the tokens as context, untrained and
    counted; weight 1 (or none) is trained on; 0.5, or weight 1 on a user turn, is a bad row naming the turn."""
    rows = [
        sharegpt_turns(("human", "Hi"), ("gpt", "Bad answer"), ("human", "Again"), ("gpt", "Good answer")),
        sharegpt_turns(("human", "Hi"), ("gpt", "Fine")),
        sharegpt_turns(("human", "Hi"), ("gpt", "Fine")),
        sharegpt_turns(("human", "Hi"), ("gpt", "Fine")),
    ]
    rows[0][1]["weight"], rows[0][3]["weight"], rows[1][0]["weight"] = 0, 1, 0
    rows[2][1]["weight"], rows[3][0]["weight"] = 0.5, 1
    path = tmp_path / "weights.jsonl"
    path.write_text("".join(json.dumps({"conversations": value}) + "\n" for value in rows))
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + eos_token }}{% endfor %}"
    out = tmp_path / "out"
    args = ["--dataset", str(path), "--chat-template", template, "--out", str(out), "--no-progress", "--no-report"]
    assert main(args) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"varpack: error: {path} line 3: 'conversations': turn 2 (assistant) has weight 0.5; a weight is 0 (an assistant "
        "turn not trained on) or 1"
    )
    assert main([*args, "--on-bad-row", "skip", "--max-bad-rows", "2"]) == 0
    assert "turns         3 user, 3 assistant (1 of weight 0, not trained on)" in capsys.readouterr().out
    (build_dir,) = out.iterdir()
    assert read_manifest(build_dir).stats.chat_turns["assistant"] == {"read": 3, "used": 3, "untrained": 1}
    rejected = [json.loads(line) for line in (build_dir / REJECTED_NAME).read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in rejected] == [(f"{path} line 3", "bad_weight"), (f"{path} line 4", "bad_weight")]
    backend = plan_build(PackConfig(dataset=str(path), chat_template=template)).tokenizer.backend()
    examples = read_examples(build_dir)
    assert {k: backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False) for k, (tokens, mask) in examples.items()} == {
        0: "assistant: Good answer</s>", 1: "assistant: Fine</s>"
    }
    assert "Bad answer" in backend.decode(examples[0][0].tolist())
    with pytest.raises(RowProblem, match="every assistant turn has weight 0") as refused:
        conversation([{**rows[1][0], "weight": None}, {**rows[1][1], "weight": 0}])
    assert refused.value.reason == Reason.NO_ASSISTANT_TURN
