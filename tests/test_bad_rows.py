"""Chat data as it exists: ShareGPT ``{from, value}`` turns, broken rows stopped or skipped under
``--on-bad-row``, listed in ``rejected.jsonl``, counted in the report and the manifest, bounded by
``--max-bad-rows``, and named as the user finds them (JSON-lines line, Parquet row)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import PackedIterableDataset
from pipeline.encode.bad_rows import REJECTED_NAME
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.bad_rows import Reason, RowProblem
from pipeline.encode.chat import conversation
from pipeline.encode.examples import Encoder
from pipeline.pack import main
from pipeline.read.readers import BatchRows
from schemas import MANIFEST_NAME, read_manifest
from tests.test_pipeline_e2e import read_examples


def transformers_tokens(plan, messages: list[dict], template: str | None = None) -> list[int]:
    """The tokens of transformers' own ``apply_chat_template(messages, tokenize=True)`` with the build's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=plan.tokenizer.backend(), bos_token="<s>", eos_token="</s>")
    encoded = tokenizer.apply_chat_template(messages, chat_template=template or plan.example_format.chat_template, tokenize=True)
    return list(encoded["input_ids"])


def sharegpt(*turns: tuple[str | None, str | None]) -> list[dict]:
    return [{"from": speaker, "value": value} for speaker, value in turns]


GOOD = [
    sharegpt(("human", f"What is {i} + {i}?"), ("gpt", f"It is {2 * i}."))
    + (sharegpt(("human", "And doubled?"), ("gpt", f"{4 * i}")) if i % 2 else [])
    for i in range(12)
]
# (line in the file, the row's conversations, the reason it is bad or None); line 4 is blank.
ROWS = [
    (1, GOOD[0], None),
    (2, GOOD[1], None),
    (3, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
    (5, sharegpt(("gpt", "I speak first"), ("human", "Hi")), "only_dangling_turns"),  # dropped whole, not broken
    (6, sharegpt(("human", "Hi"), ("gpt", "")), "empty_turn"),
    (7, sharegpt(("human", "Hi"), ("gpt", "Hello?"), ("gpt", "Yes")), "roles_not_alternating"),
    (8, None, "null"),
    (9, sharegpt(("human", "Hi"), ("gpt", None)), "empty_turn"),
    (10, sharegpt(("narrator", "Once"), ("gpt", "upon")), "unknown_role"),
    (11, sharegpt(("system", "Be brief"), ("human", "Hi"), ("gpt", "Yo")), None),  # merged: Mistral's template has no system
    (12, sharegpt(("human", "Only a question")), "no_assistant_turn"),
] + [(13 + i, GOOD[i], None) for i in range(2, 12)]


@pytest.fixture
def chats(tmp_path):
    lines = [json.dumps({"id": line, "conversations": value}) for line, value, _ in ROWS]
    lines.insert(3, "   ")
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sharegpt_turns_become_messages():
    assert conversation(sharegpt(("system", "s"), ("human", "q"), ("gpt", "a"))).messages == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    ]


def test_skip_leaves_out_bad_rows_and_lists_them(chats, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--dataset", str(chats), "--out", str(out), "--on-bad-row", "skip", "--max-bad-rows", "0.5", "--no-progress"]
    assert main(args) == 0
    report = capsys.readouterr().out
    (build_dir,) = out.iterdir()
    manifest = read_manifest(build_dir)
    bad = [(line, reason) for line, _, reason in ROWS if reason]
    assert manifest.rejected.rows == len(bad) == 7 and manifest.inputs.on_bad_row == "skip"
    assert manifest.rejected.by_reason == {"empty_turn": 2, "no_assistant_turn": 1, "null": 1, "only_dangling_turns": 1,
                                           "roles_not_alternating": 1, "unknown_role": 1}
    assert re.search(r"rejected +7 rows \(2 empty_turn, 1 no_assistant_turn, 1 null, .*\), listed in rejected.jsonl", report)
    records = [json.loads(line) for line in (build_dir / REJECTED_NAME).read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in records] == [(f"{chats} line {line}", reason) for line, reason in bad]
    assert records[0]["row"] == {"conversations": ROWS[3][1]}  # the row as the file holds it
    good = [[{"role": t.get("role") or {"human": "user", "gpt": "assistant"}[t["from"]], "content": t.get("content") or t["value"]}
             for t in value if t.get("from") != "system"] for _, value, reason in ROWS if reason is None]
    # Mistral's template has no system turn: the system prompt goes into the first user turn, as Gemma's template does.
    assert good[3] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    good[3][0]["content"] = "Be brief\n\nHi"
    plan = plan_build(PackConfig(dataset=str(chats)))
    expected = Encoder(plan.tokenizer, plan.example_format, 4096, "split").encode(
        pa.table({"conversations": good}), BatchRows("expected")
    )
    examples = read_examples(build_dir)
    ends = np.cumsum(expected.lengths)
    # An example's id is its source row number: ids skip the rows left out.
    source_rows = [row for row, (_, _, reason) in enumerate(ROWS) if reason is None]
    assert sorted(examples) == source_rows and manifest.stats.num_example_ids == len(ROWS)
    for row, end, n, messages in zip(source_rows, ends.tolist(), expected.lengths.tolist(), good):
        assert examples[row][0].tolist() == transformers_tokens(plan, messages)
        assert np.array_equal(examples[row][0], expected.tokens[end - n : end])
        assert np.array_equal(examples[row][1], expected.loss_mask[end - n : end])
    # One weight per source row: the input's own column lines up; an array over the kept examples does not.
    PackedIterableDataset(build_dir, example_weights=np.ones(len(ROWS)))
    refused = f"example_weights holds {len(source_rows)} values, the build has {len(ROWS)} example ids"
    with pytest.raises(ValueError, match=refused):
        PackedIterableDataset(build_dir, example_weights=np.ones(len(source_rows)))


def test_the_policy_is_part_of_the_fingerprint(chats):
    error = plan_build(PackConfig(dataset=str(chats)))
    skip = plan_build(PackConfig(dataset=str(chats), on_bad_row="skip"))
    assert error.fingerprint != skip.fingerprint
    assert plan_build(PackConfig(dataset=str(chats), on_bad_row="skip", max_bad_rows=3)).fingerprint == skip.fingerprint


def test_error_names_the_first_bad_line(chats, tmp_path, capsys):
    assert main(["--dataset", str(chats), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"varpack: error: {chats} line 6: 'conversations': turn 2 (assistant) is empty, and nothing is left to train on "
        "once the exchanges that hold empty turns are dropped; fix or remove it, or pass --on-bad-row skip to leave such "
        "rows out"
    )
    assert not list((tmp_path / "out").rglob("*.*"))


@pytest.mark.parametrize("bound", ["3", "0.2"])
def test_too_many_bad_rows_stop_the_run(chats, tmp_path, capsys, bound):
    args = ["--dataset", str(chats), "--out", str(tmp_path / "out"), "--on-bad-row", "skip", "--max-bad-rows", bound]
    assert main([*args, "--no-progress"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("varpack: error:")]
    assert len(errors) == 1 and f"more than --max-bad-rows {bound} (first: {chats} line 6:" in errors[0], errors
    assert f"error: 6 of {len(ROWS)} rows read are bad" in errors[0]  # the row of dangling turns only is no bad row
    assert not list(tmp_path.rglob(MANIFEST_NAME)) and not list(tmp_path.rglob(REJECTED_NAME))


def test_max_bad_rows_takes_every_fraction_from_0_to_1_and_says_the_range_of_others(chats, tmp_path, capsys):
    """--max-bad-rows 1.0 (every row may be bad) packs the good rows; 0.0 stops at the first bad row; a bound outside
    the range is refused in one line that gives it exactly."""
    args = ["--dataset", str(chats), "--on-bad-row", "skip", "--no-progress", "--no-report"]
    assert main([*args, "--out", str(tmp_path / "all"), "--max-bad-rows", "1.0"]) == 0, capsys.readouterr().err
    (build_dir,) = (tmp_path / "all").iterdir()
    assert read_manifest(build_dir).rejected.rows == 7
    assert main([*args, "--out", str(tmp_path / "none"), "--max-bad-rows", "0.0"]) == 1
    assert "more than --max-bad-rows 0.0 (first: " in capsys.readouterr().err
    assert not list((tmp_path / "none").rglob(MANIFEST_NAME))
    for bound in ("1.5", "-0.5", "-1", "nan"):
        assert main([*args, "--out", str(tmp_path / "refused"), "--max-bad-rows", bound]) == 1
        assert capsys.readouterr().err.splitlines() == [
            "varpack: error: --max-bad-rows must be a count (0, 1, 2, ...) or a fraction of the rows read from 0.0 to "
            f"1.0 (1.0: every row may be bad), got {bound}"]
    assert not (tmp_path / "refused").exists()


def test_the_rejected_list_of_a_run_that_wrote_nothing_is_kept_by_the_next_run(tmp_path, capsys):
    """Every row bad under --max-bad-rows 1.0: no build, and rejected.jsonl lists them. The next run of the same build
    keeps that list, saying where it is, not as a leftover to delete: one stopped by a lower bound leaves it as it was,
    one that gets as far replaces it with its own."""
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"id": line, "conversations": value}) + "\n"
                            for line, value, reason in ROWS if reason and reason != "only_dangling_turns"))
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--on-bad-row", "skip", "--no-progress"]
    assert main([*args, "--max-bad-rows", "1.0"]) == 1
    (listed,) = (tmp_path / "out").rglob(REJECTED_NAME)
    assert "all 6 rows read are bad rows (" in capsys.readouterr().err
    rows = listed.read_text()
    assert len(rows.splitlines()) == 6
    for bound in ("2", "1.0"):
        assert main([*args, "--max-bad-rows", bound]) == 1
        err = capsys.readouterr().err
        assert f"varpack: keeping {listed}, the rows rejected by an earlier run that wrote no build" in err, err
        assert "leftover" not in err, err
        assert listed.read_text() == rows
        assert [p.name for p in listed.parent.iterdir()] == [REJECTED_NAME]


def test_a_reused_build_is_held_to_this_runs_max_bad_rows(tmp_path, capsys):
    """--max-bad-rows is the run's bound, not fingerprinted: a build made under a loose bound and reused by a run with a
    tighter one is refused as a fresh run would stop, naming the list of its bad rows; a bound it meets reuses it."""
    rows = [{"text": f"row {i} some text"} for i in range(20)]
    rows[3], rows[7] = {"text": ""}, {"text": None}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--dataset", str(data), "--text-column", "text", "--out", str(tmp_path / "out"), "--on-bad-row", "skip",
            "--no-progress", "--max-len", "64"]
    assert main([*args, "--max-bad-rows", "1.0"]) == 0
    for bound in ("0", "1", "0.05"):
        capsys.readouterr()
        assert main([*args, "--max-bad-rows", bound]) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"the build to reuse left out 2 bad rows of 20 read, more than --max-bad-rows {bound} (listed in " in line
    for bound in ("2", "0.1"):
        assert main([*args, "--max-bad-rows", bound]) == 0


def test_max_bad_rows_minus_zero_is_zero_in_the_config_and_its_messages(chats, tmp_path, capsys):
    """--max-bad-rows -0.0 is the bound 0.0: it stops at the first bad row and says 0.0, never -0.0."""
    assert repr(PackConfig(dataset=str(chats), max_bad_rows=-0.0).max_bad_rows) == "0.0"
    args = ["--dataset", str(chats), "--out", str(tmp_path / "out"), "--on-bad-row", "skip", "--no-progress"]
    assert main([*args, "--max-bad-rows", "-0.0"]) == 1
    err = capsys.readouterr().err
    assert "more than --max-bad-rows 0.0 (first: " in err and "-0.0" not in err, err


def test_parquet_rows_are_named_by_index(tmp_path):
    prompts = [f"Question {i}?" for i in range(10)]
    prompts[6] = None
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"prompt": prompts, "response": [f"Answer {i}." for i in range(10)]}), path, row_group_size=4)
    config = PackConfig(dataset=str(path), out=str(tmp_path / "out"), progress=False)
    with pytest.raises(Exception, match=rf"^{path} row 6: 'prompt' is null"):
        build(config)
    result = build(dataclasses.replace(config, on_bad_row="skip", max_bad_rows=1))
    assert result.manifest.stats.examples == 9 and result.manifest.rejected.by_reason == {"null": 1}
    (record,) = map(json.loads, (tmp_path / "out" / result.out_dir.split("/")[-1] / REJECTED_NAME).read_text().splitlines())
    assert record["where"] == f"{path} row 6" and record["row"] == {"prompt": None, "response": "Answer 6."}


def test_lines_that_are_not_objects_are_bad_rows(tmp_path, capsys):
    good = [json.dumps({"prompt": f"Question {i}?", "response": f"Answer {i}."}) for i in range(8)]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(["null", *good[:3], "5", '"text"', *good[3:], "[1, 2]"]) + "\n")
    config = PackConfig(dataset=str(path), out=str(tmp_path / "out"), progress=False)
    with pytest.raises(Exception, match=rf"^{path} line 1: not a JSON object; fix or remove it"):
        build(config)
    result = build(dataclasses.replace(config, on_bad_row="skip", max_bad_rows=4))
    assert result.manifest.stats.examples == 8 and result.manifest.rejected.by_reason == {"not_an_object": 4}
    records = map(json.loads, (tmp_path / "out" / result.out_dir.split("/")[-1] / REJECTED_NAME).read_text().splitlines())
    assert [r["where"] for r in records] == [f"{path} line {n}" for n in (1, 5, 6, 12)]


def test_a_line_that_is_not_an_object_is_listed_as_the_source_holds_it(tmp_path, capsys):
    """``rejected.jsonl`` carries a line that is valid JSON but no object as read, not as the row of nulls Arrow makes of it."""
    good = [json.dumps({"prompt": f"Question {i}?", "response": f"Answer {i}."}) for i in range(8)]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join([*good[:4], "[1, 2]", '"text"', *good[4:], "3", "null", '{"prompt": null, "response": "A."}']) + "\n")
    out = tmp_path / "out"
    assert main(["--dataset", str(path), "--out", str(out), "--on-bad-row", "skip", "--max-bad-rows", "5", "--no-progress"]) == 0
    (build_dir,) = out.iterdir()
    records = [json.loads(line) for line in (build_dir / REJECTED_NAME).read_text().splitlines()]
    assert [(r["where"], r["reason"], r["row"]) for r in records] == [
        (f"{path} line 5", "not_an_object", [1, 2]),
        (f"{path} line 6", "not_an_object", "text"),
        (f"{path} line 11", "not_an_object", 3),
        (f"{path} line 12", "not_an_object", None),
        (f"{path} line 13", "null", {"prompt": None, "response": "A."}),
    ]

def test_dangling_sharegpt_turns_are_dropped_and_counted_by_default(tmp_path, capsys):
    """ShareGPT conversations split from longer ones start with the assistant or end with the user: FastChat and
    axolotl drop those turns, and so does a default build, saying how many; --keep-dangling-turns refuses them."""
    split = [
        sharegpt(("gpt", "...and that is all."), ("gpt", "Really."), ("human", "Thanks! Another?"), ("gpt", "Sure.")),
        sharegpt(("human", "Hi"), ("gpt", "Hello!"), ("human", "And then?")),
        sharegpt(("system", "Be brief"), ("chatgpt", "(cut)"), ("human", "Hi"), ("model", "Yo")),
        GOOD[0],
    ]
    path = tmp_path / "split.jsonl"
    path.write_text("".join(json.dumps({"conversations": value}) + "\n" for value in split))
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + eos_token }}{% endfor %}"
    args = ["--dataset", str(path), "--chat-template", template, "--no-progress", "--max-len", "256"]
    assert main([*args, "--out", str(tmp_path / "refused"), "--keep-dangling-turns"]) == 1
    assert f"{path} line 1: 'conversations': the conversation starts with an assistant turn" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "skipped"), "--keep-dangling-turns", "--on-bad-row", "skip",
                 "--max-bad-rows", "3"]) == 0
    (skipped,) = (tmp_path / "skipped").iterdir()
    assert read_manifest(skipped).rejected.by_reason == {"ends_with_user": 1, "starts_with_assistant": 2}
    capsys.readouterr()
    for flags in ([], ["--drop-dangling-turns"]):  # the old flag still works, and means the default here
        assert main([*args, "--out", str(tmp_path / f"dropped{len(flags)}"), *flags]) == 0
        report = capsys.readouterr().out
        assert re.search(r"trimmed +dropped 3 leading assistant turns and 1 trailing user turn in 3 conversations", report)
        assert re.search(r"turns +1 system, 4 of 5 user, 4 of 7 assistant\n", report)
    (dropped,) = (tmp_path / "dropped0").iterdir()
    manifest = read_manifest(dropped)
    assert manifest.stats.conversations_trimmed == 3 and manifest.rejected.rows == 0
    assert manifest.stats.dangling_turns_dropped == {"leading_assistant": 3, "trailing_user": 1}
    assert manifest.stats.chat_turns["assistant"] == {"read": 7, "used": 4}
    plan = plan_build(PackConfig(dataset=str(path), chat_template=template))
    backend = plan.tokenizer.backend()
    examples = read_examples(dropped)
    texts = {i: backend.decode(tokens.tolist(), skip_special_tokens=False) for i, (tokens, _) in examples.items()}
    assert texts[0] == "user: Thanks! Another?</s>assistant: Sure.</s>"
    assert texts[1] == "user: Hi</s>assistant: Hello!</s>"
    assert texts[2] == "system: Be brief</s>user: Hi</s>assistant: Yo</s>"
    # The loss covers exactly the assistant turns that remain.
    trained = {i: backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False) for i, (tokens, mask) in examples.items()}
    assert trained == {0: "assistant: Sure.</s>", 1: "assistant: Hello!</s>", 2: "assistant: Yo</s>",
                       3: "assistant: It is 0.</s>"}
    kept = [split[0][2:], split[1][:2], split[2][:1] + split[2][2:], split[3]]
    for i, turns in enumerate(kept):
        messages = [{"role": {"human": "user", "system": "system"}.get(t["from"], "assistant"), "content": t["value"]} for t in turns]
        assert examples[i][0].tolist() == transformers_tokens(plan, messages, template)


def test_messages_data_keeps_refusing_dangling_turns_unless_asked(tmp_path):
    messages = [{"role": "assistant", "content": "cut"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(RowProblem, match="starts with an assistant turn") as refused:
        conversation(messages)
    assert refused.value.reason == "starts_with_assistant"
    assert conversation(messages, drop_dangling_turns=True).messages == messages[1:]
    with pytest.raises(RowProblem, match="starts with an assistant turn"):
        conversation(sharegpt(("gpt", "cut"), ("human", "Hi"), ("gpt", "Yo")), drop_dangling_turns=False)


def test_the_issue_reproduction_packs_one_example_and_reports_one_row_left_out(tmp_path, capsys):
    """A conversation with nothing left once its dangling turns are dropped is left out with its own reason, never a crash."""
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"conversations": sharegpt(("human", "Hi"), ("gpt", "Hello"))}) + "\n"
                    + json.dumps({"conversations": sharegpt(("gpt", "orphan"))}) + "\n")
    out = tmp_path / "o"
    for flags in (["--on-bad-row", "skip", "--drop-dangling-turns"], []):
        assert main(["--dataset", str(path), "--messages-column", "conversations", *flags, "--out", str(out),
                     "--no-progress"]) == 0, capsys.readouterr().err
        report = capsys.readouterr().out
        assert re.search(r"examples +1 read, 1 kept, 0 dropped\n", report) and "rejected      1 row (1 only_dangling_turns)" in report
    plan = plan_build(PackConfig(dataset=str(path), messages_column="conversations"))
    hello = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for build_dir in out.iterdir():
        ((tokens, _),) = read_examples(build_dir).values()
        assert tokens.tolist() == transformers_tokens(plan, hello)
        assert read_manifest(build_dir).rejected.by_reason == {"only_dangling_turns": 1}
        (record,) = map(json.loads, (build_dir / REJECTED_NAME).read_text().splitlines())
        assert record["where"] == f"{path} line 2" and record["row"] == {"conversations": sharegpt(("gpt", "orphan"))}


ROLE_NAMES = st.sampled_from(["system", "user", "human", "assistant", "gpt", "chatgpt", "model", "tool", "observation",
                              "function_call", "narrator"])
CALL = json.dumps({"name": "add", "arguments": {"a": 1}})
TURNS = st.lists(
    st.fixed_dictionaries({"speaker": ROLE_NAMES, "text": st.sampled_from([None, "", "  ", "hi", "Hello there", CALL]),
                           "sharegpt": st.booleans()}),
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(TURNS, st.sampled_from([None, True, False]))
def test_conversation_returns_a_well_ordered_chat_or_raises_the_bad_row_error(turns, drop):
    value = [{"from": t["speaker"], "value": t["text"]} if t["sharegpt"] else {"role": t["speaker"], "content": t["text"]}
             for t in turns]
    try:
        chat = conversation(value, drop)
    except RowProblem as problem:
        assert isinstance(problem.reason, Reason) and problem.message
        return
    roles = [m["role"] for m in chat.messages]
    body = roles[1:] if roles[0] == "system" else roles
    assert body[0] == "user" and body[-1] == "assistant" and "system" not in body
    assert all(m["content"].strip() or m.get("tool_calls") for m in chat.messages)
    speakers = [r for k, r in enumerate(body) if r != "tool" and (k == 0 or body[k - 1] != "tool")]
    assert all(a != b for a, b in zip(speakers, speakers[1:]))
    assert all(body[k - 1] in ("assistant", "tool") for k, r in enumerate(body) if r == "tool")
    assert all(r in ("assistant", "tool") for k, r in enumerate(body) if k and body[k - 1] == "tool")
    assert len(chat.read) == len(value) == len(chat.messages) + len(chat.dropped)


def test_the_assistant_speaks_after_a_tool_turn_and_the_turns_that_break_it_are_named():
    """A tool turn is answered by the assistant: a user turn after it is refused naming both turns, and
    [user, assistant, tool, user, user, assistant] is not let through."""
    u, a, t = ({"role": role, "content": role[0]} for role in ("user", "assistant", "tool"))
    for value in ([u, a, t, u, a], [u, a, t, u, u, a]):
        with pytest.raises(RowProblem, match="^turn 4 is a user turn after tool turn 3; the assistant must answer a tool turn$"):
            conversation(value)
    assert [m["role"] for m in conversation([u, a, t, t, a, u, a]).messages] == ["user", "assistant", "tool", "tool",
                                                                                "assistant", "user", "assistant"]
    with pytest.raises(RowProblem, match="^turns 4 and 5 are both assistant turns"):
        conversation([u, a, t, a, a])


def test_a_dangling_leading_tool_turn_is_counted_as_a_tool_turn_without_a_warning(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"conversations": sharegpt(("observation", '{"temp": 21}'), ("human", "Hi"), ("gpt", "Hello!"))}) + "\n")
    assert main(["--dataset", str(path), "--out", str(tmp_path / "out"), "--max-len", "64", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert re.search(r"trimmed +dropped 1 leading tool turn in 1 conversation", captured.out)
    (out_dir,) = (tmp_path / "out").iterdir()
    stats = read_manifest(out_dir).stats
    assert stats.dangling_turns_dropped == {"leading_tool": 1}
    assert stats.chat_turns["tool"] == {"read": 1, "used": 0}


def test_turn_counts_are_those_in_the_tokens_after_truncation(tmp_path, capsys):
    """Under --overflow truncate a turn cut off, or in an example dropped with nothing left to train on, is read but
    not used: the manifest's assistant turns used are the assistant runs of the packed loss masks."""
    long = " ".join(["word"] * 120)
    rows = [sharegpt(("human", "Hi"), ("gpt", "Hello!"), ("human", long), ("gpt", "Second answer")),
            sharegpt(("human", long), ("gpt", "Only answer"))]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"conversations": row}) + "\n" for row in rows))
    assert main(["--dataset", str(path), "--out", str(tmp_path / "out"), "--max-len", "48", "--no-progress"]) == 0
    assert re.search(r"turns +2 of 3 user, 1 of 3 assistant\n", capsys.readouterr().out)
    (out_dir,) = (tmp_path / "out").iterdir()
    masks = [[0, *mask.tolist()] for _, mask in read_examples(out_dir).values()]
    runs = sum(b > a for mask in masks for a, b in zip(mask, mask[1:]))
    assert read_manifest(out_dir).stats.chat_turns["assistant"] == {"read": 3, "used": runs} and runs == 1


@pytest.mark.parametrize("flags, error", [
    (["--keep-dangling-turns"], "--keep-dangling-turns refuses turns of chat data; {path} is prompt_response data"),
    (["--drop-dangling-turns"], "--drop-dangling-turns drops turns of chat data; {path} is prompt_response data"),
    (["--drop-dangling-turns", "--keep-dangling-turns"],
     "--drop-dangling-turns and --keep-dangling-turns contradict each other; pass one of them"),
])
def test_dangling_turn_flags_that_do_not_fit_are_one_line(tmp_path, capsys, flags, error):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n")
    assert main(["--dataset", str(path), "--out", str(tmp_path / "out"), "--no-progress", *flags]) == 1
    assert capsys.readouterr().err.strip() == f"varpack: error: {error.format(path=path)}"
