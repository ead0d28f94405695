"""The pipeline's pieces without Beam: sources, encoding, fingerprints, layout and routing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.build import plan_build
from pipeline.config import RUN_SETTINGS, PackConfig
from pipeline.encode.examples import Encoder, cuts_between_words, encode_ids, special_affixes
from pipeline.encode.chat_templates import MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.errors import ConfigError, HubUnreachableError, InputError
from pipeline.packing.groups import group_parts, make_layout
from pipeline.packing.shard_plans import GroupBatch, ShardPlan, assemble_shard, pack_group
from pipeline.packing.spill import spill
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import BatchRows, scan_file
from pipeline.read.sources import resolve_source
from pipeline.read.synthetic import SHAPES, generate_block
from schemas import ExampleKind, PackingStats, validate_table

BOS, EOS = 1, 2
CHATS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "user", "content": "Add 2 and 2"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def encoder(tokenizer, kind, columns, train_on_prompt=False, template=MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE, overflow="split"):
    fmt = ExampleFormat(kind, columns, train_on_prompt, template if kind == ExampleKind.CHAT else None)
    return Encoder(tokenizer, fmt, 4096, overflow)


def split_examples(batch):
    ends = np.cumsum(batch.lengths)
    return [(batch.tokens[e - n : e], batch.loss_mask[e - n : e]) for e, n in zip(ends, batch.lengths)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- tokenizer ---------------------------------------------------------------------------


def test_default_tokenizer_is_mistral_with_bos_and_eos(tokenizer):
    assert tokenizer.inputs().vocab_size == 32000
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)
    assert special_affixes(tokenizer) == ([BOS], [EOS])
    # The same ids as the sentencepiece model itself.
    assert tokenizer.backend().encode("Hello world. The answer is 42.", add_special_tokens=False).ids == [
        22557, 1526, 28723, 415, 4372, 349, 28705, 28781, 28750, 28723
    ]


def test_tokenizer_hash_covers_content_not_file_layout(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(json.loads(tokenizer.serialized), indent=4))  # same content, other layout
    # Without tokenizer_config.json, BOS and EOS are found in the post-processor and special tokens.
    assert load_tokenizer(str(path)).content_hash == tokenizer.content_hash
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert load_tokenizer(str(path)).content_hash == tokenizer.content_hash
    assert load_tokenizer(str(path), eos_token="<unk>").content_hash != tokenizer.content_hash
    changed = json.loads(tokenizer.serialized)
    changed["added_tokens"].append({**changed["added_tokens"][-1], "id": 32000, "content": "<extra>"})
    path.write_text(json.dumps(changed))
    assert load_tokenizer(str(path)).content_hash != tokenizer.content_hash


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))
    with pytest.raises(HubUnreachableError, match=r"cannot be reached.*\(hf download some-owner/some-tokenizer --local-dir"):
        load_tokenizer("some-owner/some-tokenizer")


# --- encoding ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, joined",
    [(None, ("{q}\n\n", "{a}")), ("Q: {prompt}\\nA: {response}", ("Q: {q}\nA: ", "{a}")), ("{prompt}{response}.", ("{q}", "{a}."))],
)
def test_prompt_response_layout_and_mask(tokenizer, template, joined):
    fmt = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), **({"prompt_template": template} if template else {}))
    batch = Encoder(tokenizer, fmt, 4096, "split").encode(
        pa.table({"q": ["Hello world", "What is 2+2?"], "a": ["Hi", "Four"]}), BatchRows("t", 0)
    )
    backend = tokenizer.backend()
    for (tokens, mask), (q, a) in zip(split_examples(batch), [("Hello world", "Hi"), ("What is 2+2?", "Four")]):
        prompt, response = joined[0].format(q=q), joined[1].format(a=a)
        whole = backend.encode(prompt + response, add_special_tokens=False)
        assert tokens.tolist() == [BOS, *whole.ids, EOS]
        response_start = whole.char_to_token(len(prompt))
        assert mask.tolist() == [0] * (1 + response_start) + [1] * (len(whole.ids) - response_start + 1)
        assert backend.decode(tokens[mask == 1][:-1].tolist()).strip() == response.strip()


def test_train_on_prompt_and_plain_text(tokenizer):
    table = pa.table({"q": ["Hello world"], "a": ["Hi"]})
    enc = encoder(tokenizer, ExampleKind.PROMPT_RESPONSE, ("q", "a"), train_on_prompt=True)
    (tokens, mask), = split_examples(enc.encode(table, BatchRows("t", 0)))
    assert mask.tolist() == [0] + [1] * (len(tokens) - 1)
    (tokens, mask), = split_examples(encoder(tokenizer, ExampleKind.TEXT, ("q",)).encode(table, BatchRows("t", 0)))
    assert tokens[0] == BOS and tokens[-1] == EOS and mask.tolist() == [0] + [1] * (len(tokens) - 1)


def test_batch_equals_one_example_at_a_time(tokenizer):
    table = generate_block(SHAPES["synthetic-orcamath"], 0, 40)
    enc = encoder(tokenizer, ExampleKind.PROMPT_RESPONSE, ("prompt", "response"))
    whole = split_examples(enc.encode(table, BatchRows("t", 0)))
    for i in range(table.num_rows):
        (tokens, mask), = split_examples(enc.encode(table.slice(i, 1), BatchRows("t", i)))
        assert np.array_equal(tokens, whole[i][0]) and np.array_equal(mask, whole[i][1])


PIECES_ALPHABET = ["a", "bc", "é", "日本", "💡", "1.", " ", "  ", "   ", "\n", " \n ", "\t", "▁", "▁ ", " ▁", "</s>", " <s> "]


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES_ALPHABET), min_size=1, max_size=200).map("".join),
       piece_chars=st.integers(1, 30))
def test_a_text_tokenized_in_pieces_gives_the_tokens_of_the_whole(tokenizer, text, piece_chars):
    backend = tokenizer.backend()
    ids, lengths = encode_ids(backend, [text, "a b c"], np.dtype(np.int32), piece_chars)
    assert lengths.tolist() == [len(ids) - 3, 3]
    assert ids[: lengths[0]].tolist() == backend.encode(text, add_special_tokens=False).ids


def test_a_long_text_is_tokenized_in_pieces(tokenizer):
    """tokenizers' BPE takes more than linear time on one long pre-token (a 20 MB line took minutes):
    a long text is cut between words, and its example is the same."""
    words = " ".join(f"word{i % 97}" for i in range(100_000))
    enc = encoder(tokenizer, ExampleKind.TEXT, ("text",))
    assert cuts_between_words(tokenizer.backend())  # the default tokenizer (SentencePiece BPE) allows pieces
    assert enc.piece_chars is not None and len(words) > 4 * enc.piece_chars
    (tokens, _), = split_examples(enc.encode(pa.table({"text": [words]}), BatchRows("t", 0)))
    assert tokens[1:-1].tolist() == tokenizer.backend().encode(words, add_special_tokens=False).ids


def test_chat_loss_on_assistant_turns_only(tokenizer):
    batch = encoder(tokenizer, ExampleKind.CHAT, ("messages",)).encode(pa.table({"messages": CHATS}), BatchRows("t", 0))
    backend = tokenizer.backend()
    examples = split_examples(batch)
    tokens, mask = examples[1]
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE
    )
    assert tokens.tolist() == list(reference.apply_chat_template(CHATS[1], tokenize=True)["input_ids"])
    trained = backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
    assert trained.replace(" ", "") == "4</s>12</s>"
    assert tokens[0] == BOS and mask[0] == 0
    assert backend.decode(examples[0][0][examples[0][1] == 1].tolist(), skip_special_tokens=False) == "Hello! How can I help?</s>"


def test_chat_template_with_generation_tags(tokenizer):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
        "{% else %}<<{{ m['content'] }}>>{% endif %}{% endfor %}"
    )
    enc = encoder(tokenizer, ExampleKind.CHAT, ("messages",), template=template)
    batch = enc.encode(pa.table({"messages": CHATS[1:]}), BatchRows("t", 0))
    (tokens, mask), = split_examples(batch)
    assert tokenizer.backend().decode(tokens[mask == 1].tolist(), skip_special_tokens=False).replace(" ", "") == "4</s>12</s>"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"q": ["x", None], "a": ["y", "z"]}, r"t row 6: 'q' is null"),
        ({"q": ["x", "w"], "a": ["y", ""]}, r"t row 6: 'a' is empty"),
        ({"q": [1, 2], "a": ["y", "z"]}, r"column 'q' holds int64 values"),
    ],
)
def test_bad_values_name_the_row(tokenizer, values, message):
    with pytest.raises(InputError, match=message):
        encoder(tokenizer, ExampleKind.PROMPT_RESPONSE, ("q", "a")).encode(pa.table(values), BatchRows("t", 5))


def test_too_long_under_error_names_the_row(tokenizer):
    enc = Encoder(tokenizer, ExampleFormat(ExampleKind.TEXT, ("t",)), 8, "error")
    with pytest.raises(InputError, match=r"f row 3: \d+ tokens, more than --max-len 8"):
        enc.encode(pa.table({"t": ["short", "a much longer text that does not fit in eight tokens"]}), BatchRows("f", 2))


def test_bad_chats_are_clear_errors(tokenizer):
    enc = encoder(tokenizer, ExampleKind.CHAT, ("m",))
    message = "t row 0: 'm': no assistant turn, so nothing to train on; fix or remove it, or pass --on-bad-row skip"
    with pytest.raises(InputError, match=message):
        enc.encode(pa.table({"m": [[{"role": "user", "content": "hi"}]]}), BatchRows("t", 0))
    with pytest.raises(InputError, match="t row 3: 'm': the chat template rejected the messages"):
        enc.encode(pa.table({"m": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 2,
                                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "adding"},
                                     {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]]}),
                   BatchRows("t", 2))


# --- sources -----------------------------------------------------------------------------


def test_gsm8k_is_embedded(tmp_path):
    source = resolve_source(PackConfig())
    assert source.known_examples == 1319 and source.inputs.split == "test"
    assert source.columns == ("question", "answer")
    with pytest.raises(ConfigError, match="only its test split"):
        resolve_source(PackConfig(split="train"))
    limited = resolve_source(PackConfig(num_examples=10))
    assert limited.known_examples == 10 and limited.inputs.content_hash == source.inputs.content_hash


def test_file_formats_read_the_same_rows(tmp_path):
    records = [{"prompt": f"p{i}", "response": f"r{i}", "extra": i} for i in range(25)]
    write_jsonl(tmp_path / "d.jsonl", records)
    (tmp_path / "d.json").write_text(json.dumps(records))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    columns = {"prompt": pa.string(), "response": pa.string()}
    for name in ("d.jsonl", "d.json", "d.parquet", "d.arrow"):
        scan = scan_file(str(tmp_path / name))
        assert set(scan.columns) >= {"prompt", "response"}, name
        rows = []
        for task in scan.tasks:
            for first_row, batch in task.read(columns, 4):
                assert batch["prompt"].to_pylist() == [f"p{i}" for i in range(first_row, first_row + batch.num_rows)]
                rows += batch["response"].to_pylist()
        assert rows == [f"r{i}" for i in range(25)], name
    assert len(scan_file(str(tmp_path / "d.parquet")).tasks) == 4  # one task per row group
    for name in ("d.jsonl", "d.parquet", "d.arrow"):
        limited = resolve_source(PackConfig(dataset=str(tmp_path / name), num_examples=10))
        rows = [r for task in limited.tasks for _, b in task.read(columns, 4) for r in b["prompt"].to_pylist()]
        assert limited.known_examples == 10 and rows == [f"p{i}" for i in range(10)], name


def test_json_lines_rows_are_counted_across_tasks(tmp_path, monkeypatch):
    import pipeline.read.readers as readers

    monkeypatch.setattr(readers, "JSONL_TASK_BYTES", 64)
    lines = [json.dumps({"text": f"line {i}"}) for i in range(30)]
    lines[11] = ""  # a blank line is skipped, not counted
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    scan = scan_file(str(tmp_path / "d.jsonl"))
    assert len(scan.tasks) > 3
    texts = [t for task in scan.tasks for _, b in task.read({"text": pa.string()}, 100) for t in b["text"].to_pylist()]
    assert texts == [f"line {i}" for i in range(30) if i != 11]
    bad = list(lines)
    bad[20] = json.dumps({"text": 5})
    (tmp_path / "d.jsonl").write_text("\n".join(bad))
    with pytest.raises(InputError, match=r"d.jsonl line 21: column 'text' holds a value of type int"):
        for task in scan_file(str(tmp_path / "d.jsonl")).tasks:
            list(task.read({"text": pa.string()}, 100))


def test_local_sources_and_their_errors(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    source = resolve_source(PackConfig(dataset=str(tmp_path / "a.jsonl")))
    assert source.name == "a" and source.columns == ("question", "answer")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "b.jsonl", [{"question": "q2", "answer": "a2"}])
    both = resolve_source(PackConfig(dataset=str(tmp_path)))
    assert both.known_examples == 2
    assert resolve_source(PackConfig(dataset=str(tmp_path / "**" / "*.jsonl"))).inputs.content_hash == both.inputs.content_hash
    with pytest.raises(InputError, match="unknown dataset 'nonsense'"):
        resolve_source(PackConfig(dataset="nonsense"))
    with pytest.raises(InputError, match="no such file"):
        resolve_source(PackConfig(dataset=str(tmp_path / "missing.jsonl")))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="broken.parquet: cannot be read"):
        resolve_source(PackConfig(dataset=str(tmp_path / "broken.parquet")))


def test_hub_datasets_fail_fast_offline():
    for name in ("flan", "orcamath", "hf:owner/name"):
        with pytest.raises(HubUnreachableError, match=r"cannot be reached.*--dataset 'DIR/\*\*/\*.parquet'"):
            resolve_source(PackConfig(dataset=name))


def test_synthetic_lengths_follow_the_shape_exactly(tokenizer):
    table = generate_block(SHAPES["synthetic-flan"], 0, 300)
    joined = resolve_source(PackConfig(dataset="synthetic-flan")).default_format
    batch = Encoder(tokenizer, joined, 4096, "split").encode(table, BatchRows("t", 0))
    rng = np.random.default_rng([1, 0])
    assert np.array_equal(batch.lengths, SHAPES["synthetic-flan"].lengths(rng, 8192)[:300])
    assert generate_block(SHAPES["synthetic-flan"], 0, 300).equals(table)


# --- fingerprints --------------------------------------------------------------------------


def test_every_setting_is_in_the_fingerprint_or_named_a_run_setting(tmp_path, tokenizer):
    """A setting that changes the shards changes the fingerprint; one that cannot (RUN_SETTINGS) leaves it.

    Every field of PackConfig must be one or the other, so a new setting cannot slip past the
    fingerprint and make a run silently reuse shards built another way.
    """
    data = tmp_path / "data"
    data.mkdir()
    record = {"prompt": "p", "response": "r", "answer": "a", "other": "o", "messages": CHATS[0]}
    write_jsonl(data / "train.jsonl", [record, {**record, "prompt": "q"}])
    write_jsonl(data / "test.jsonl", [record])
    base = PackConfig(dataset=str(data), out=str(tmp_path / "out"))
    fingerprint = plan_build(base).fingerprint
    assert plan_build(base).fingerprint == fingerprint
    other_data = tmp_path / "other"
    other_data.mkdir()
    write_jsonl(other_data / "train.jsonl", [{**record, "response": "R"}, {**record, "prompt": "q"}])
    tokenizer_json = tmp_path / "tok" / "tokenizer.json"
    tokenizer_json.parent.mkdir()
    changed = json.loads(tokenizer.serialized)
    changed["added_tokens"][0]["content"] = "<unknown>"
    tokenizer_json.write_text(json.dumps(changed))
    in_fingerprint = {
        "dataset": {"dataset": str(other_data)},
        "tokenizer": {"tokenizer": str(tokenizer_json)},
        "max_len": {"max_len": 2048},
        "split": {"split": "test"},
        "num_examples": {"num_examples": 1},
        "overflow": {"overflow": "truncate"},
        "packing": {"packing": "first_fit_decreasing"},
        "seed": {"seed": 1},
        "prompt_column": {"prompt_column": "answer", "response_column": "response"},
        "response_column": {"prompt_column": "prompt", "response_column": "answer"},
        "messages_column": {"messages_column": "messages"},
        "text_column": {"text_column": "prompt"},
        "chat_template": {"messages_column": "messages", "chat_template": "{% for m in messages %}{{ m.content + eos_token }}{% endfor %}"},
        "prompt_template": {"prompt_template": "Q: {prompt} A: {response}"},
        "as_chat": {"as_chat": True},
        "system_prompt": {"system_prompt": "Be brief."},
        "truncate_side": {"overflow": "truncate", "truncate_side": "left"},
        "bos_token": {"bos_token": "none"},
        "eos_token": {"eos_token": "<unk>"},
        "special_tokens": {"special_tokens": ("<|im_end|>",)},
        "drop_dangling_turns": {"messages_column": "messages", "drop_dangling_turns": True},
        "train_on_prompt": {"train_on_prompt": True},
        "on_bad_row": {"on_bad_row": "skip"},
        "rows_per_shard": {"rows_per_shard": 7},
        "examples_per_group": {"examples_per_group": 5},
        "format": {"format": "preference", "chosen_column": "response", "rejected_column": "answer"},
        "preference_layout": {
            "format": "preference", "chosen_column": "response", "rejected_column": "answer", "preference_layout": "shared-prompt",
        },
        "chosen_column": {"format": "preference", "chosen_column": "other", "rejected_column": "answer"},
        "rejected_column": {"format": "preference", "chosen_column": "response", "rejected_column": "other"},
    }
    prints = {name: plan_build(dataclasses.replace(base, **change)).fingerprint for name, change in in_fingerprint.items()}
    assert fingerprint not in prints.values() and len(set(prints.values())) == len(prints), prints
    run_settings = {
        "out": {"out": str(tmp_path / "elsewhere")},
        "force": {"force": True},
        "lock_timeout": {"lock_timeout": 5.0},
        "max_bad_rows": {"on_bad_row": "skip", "max_bad_rows": 3},
        "batch_size": {"batch_size": 1},
        "progress": {"progress": False},
        "report": {"report": False},
        "verbose": {"verbose": True},
        "strict": {"strict": True},
        "beam_args": {"beam_args": ("--direct_num_workers=2",)},
        "verify_tokens": {"verify_tokens": "all"},
        "on_token_mismatch": {"on_token_mismatch": "count"},
    }
    for name, change in run_settings.items():
        reference = prints["on_bad_row"] if name == "max_bad_rows" else fingerprint
        assert plan_build(dataclasses.replace(base, **change)).fingerprint == reference, name
    # --revision pins a Hub dataset's commit: tests/test_hub_layouts.py shows it changes the content hash.
    covered = set(in_fingerprint) | {"revision"}
    assert set(run_settings) == RUN_SETTINGS
    assert covered | RUN_SETTINGS == {field.name for field in dataclasses.fields(PackConfig)}
    assert not covered & RUN_SETTINGS

    write_jsonl(data / "train.jsonl", [record, {**record, "prompt": "Q"}])
    assert plan_build(base).fingerprint != fingerprint
    assert plan_build(base).out_dir == str(tmp_path / "out" / f"data-{plan_build(base).fingerprint}")


# Rows of every kind whose encoding the encoding rules decide: dangling, empty and unanswered ShareGPT turns,
# function calls (one null), a system turn, tool calls and reasoning in {role, content} messages, a turn of
# weight 0, conversations truncated mid-way, a bad row, and prompt/response and text rows (one long enough to be split).
RULES_SAMPLE = {
    "conversations": [
        [{"from": "gpt", "value": "...and so on."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
         {"from": "human", "value": ""}, {"from": "gpt", "value": "Lost."}, {"from": "human", "value": "Bye"}],
        [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Add 1 and 2"},
         {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
         {"from": "observation", "value": "3"}, {"from": "gpt", "value": "3"}, {"from": "human", "value": "And 2 and 2?"},
         {"from": "function_call", "value": None}, {"from": "observation", "value": "4"}, {"from": "gpt", "value": "4"},
         {"from": "human", "value": "Thanks " * 30}, {"from": "gpt", "value": "Welcome " * 30}],
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "weight": 0,
          "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "content": "Sunny"}, {"role": "assistant", "content": "Sunny <|EOT|> in Oslo."}],
        [{"from": "gpt", "value": "orphan"}],
    ],
    "prompt_response": [("What is 2 + 2?", "4"), ("Say hi", " hi\n"), ("Long " * 40, "Short")],
    "text": ["One line.", "Two\nlines.", "word " * 150],
}
RULES_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.reasoning_content %} ({{ m.reasoning_content }}){% endif %}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Each ENCODING_RULES version with the fingerprint of the fixed build inputs of RULES_SAMPLE's formats and the
# digest of what RULES_SAMPLE encodes to under it. A change of the encoding adds a line; no line is ever edited.
ENCODINGS = {
    1: ("0816de77956985cc", "e684781de079d472"),
}


def rules_sample_encoding(tokenizer) -> tuple[str, str]:
    """The fingerprint RULES_SAMPLE's formats give fixed build inputs, and the sha256 of its encoding (tokens,
    loss masks, each example's row and each bad row's reason) in each format."""
    from pipeline.read.readers import MESSAGES_TYPE
    from schemas import BuildInputs, DatasetInputs, compute_fingerprint

    cases = [
        (ExampleFormat(ExampleKind.CHAT, ("c",), chat_template=RULES_TEMPLATE), 48, "truncate",
         pa.table({"c": pa.array(RULES_SAMPLE["conversations"], MESSAGES_TYPE)})),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("p", "r")), 32, "split",
         pa.table({"p": [p for p, _ in RULES_SAMPLE["prompt_response"]], "r": [r for _, r in RULES_SAMPLE["prompt_response"]]})),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("p", "r"), chat_template=RULES_TEMPLATE, as_chat=True), 32, "truncate",
         pa.table({"p": [p for p, _ in RULES_SAMPLE["prompt_response"]], "r": [r for _, r in RULES_SAMPLE["prompt_response"]]})),
        (ExampleFormat(ExampleKind.TEXT, ("t",)), 64, "split", pa.table({"t": RULES_SAMPLE["text"]})),
    ]
    fingerprints, encoded = [], hashlib.sha256()
    for fmt, max_len, overflow, table in cases:
        inputs = BuildInputs(DatasetInputs("sample", "train", "0"), tokenizer.inputs(), fmt.template, fmt.loss_masking,
                             max_len, overflow, "best_fit_decreasing", 0, "0")
        fingerprints.append(compute_fingerprint(inputs))
        batch = Encoder(tokenizer, fmt, max_len, overflow, "skip").encode(table, BatchRows("t", 0))
        for part in (batch.tokens.astype(np.int64), batch.loss_mask, batch.lengths, batch.example_rows):
            encoded.update(np.ascontiguousarray(part).tobytes())
        encoded.update(json.dumps([(bad.where, bad.reason) for bad in batch.rejected]).encode())
    return hashlib.sha256(" ".join(fingerprints).encode()).hexdigest()[:16], encoded.hexdigest()[:16]


def test_a_change_of_the_encoded_tokens_needs_a_new_encoding_rules_version(tokenizer, monkeypatch):
    """A build is reused by its fingerprint, so the rules that encode rows are in it (``ENCODING_RULES``): fixed
    rows of every kind encode to the digest pinned for the current version, and the fingerprint of fixed inputs
    is the one pinned with it. A change of the encoding without a new version fails here, as does a new version
    that keeps the fingerprint."""
    from pipeline.read import kinds

    fingerprint, encoding = rules_sample_encoding(tokenizer)
    assert ENCODINGS.get(kinds.ENCODING_RULES, (None, None))[1] == encoding, (
        f"RULES_SAMPLE encodes to {encoding} now: bump ENCODING_RULES in pipeline/read/kinds.py and pin "
        f"{kinds.ENCODING_RULES + 1}: (fingerprint, {encoding!r}) in ENCODINGS"
    )
    assert ENCODINGS[kinds.ENCODING_RULES][0] == fingerprint
    assert kinds.ENCODING_RULES == max(ENCODINGS) and len({e for _, e in ENCODINGS.values()}) == len(ENCODINGS)
    monkeypatch.setattr(kinds, "ENCODING_RULES", kinds.ENCODING_RULES + 1)
    bumped_fingerprint, bumped_encoding = rules_sample_encoding(tokenizer)
    assert bumped_encoding == encoding and bumped_fingerprint != fingerprint


def test_config_errors():
    for config, message in [
        (PackConfig(max_len=0), "--max-len must be a positive integer"),
        (PackConfig(batch_size=True), "--batch-size must be a positive integer, got True"),
        (PackConfig(num_examples=-3), "--num-examples must be a positive integer, got -3"),
        (PackConfig(packing="worst_fit"), "--packing must be one of best_fit_decreasing, first_fit_decreasing, sequential"),
        (PackConfig(on_bad_row="ignore"), "--on-bad-row must be one of error, skip, got 'ignore'"),
        (PackConfig(prompt_column="p"), "go together"),
        (PackConfig(prompt_column="p", response_column="r", text_column="t"), "choose one example format"),
        (PackConfig(overflow="wrap"), "--overflow must be one of"),
        (PackConfig(rows_per_shard=0), "--rows-per-shard must be a positive integer"),
        (PackConfig(examples_per_group=True), "--examples-per-group must be a positive integer"),
        (PackConfig(revision="main"), "--revision applies to Hub datasets .*, not to gsm8k"),
    ]:
        with pytest.raises(ConfigError, match=message):
            plan_build(config)


def test_shard_and_group_sizes_are_build_inputs_only_when_set():
    """A different shard or group size is another build; the defaults leave fingerprints as they were."""
    from pipeline.pack import parse_args

    default = plan_build(PackConfig(dataset="synthetic-flan", num_examples=10))
    assert "rows_per_shard" not in default.inputs.to_dict() and "examples_per_group" not in default.inputs.to_dict()
    sized = plan_build(parse_args(["--dataset", "synthetic-flan", "--num-examples", "10", "--rows-per-shard", "7",
                                   "--examples-per-group", "5"]))
    assert sized.config.rows_per_shard == 7 and sized.inputs.to_dict()["examples_per_group"] == 5
    assert sized.fingerprint != default.fingerprint


def test_chat_data_needs_a_template(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_text(tokenizer.serialized)
    with pytest.raises(InputError, match="needs a chat template"):
        plan_build(PackConfig(dataset=str(data), tokenizer=str(bare)))


def test_examples_keep_their_row_when_rows_before_them_are_left_out(tokenizer):
    """A null row (--on-bad-row skip) and an example truncation leaves untrained take no id from the rows after them."""
    fmt = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("prompt", "response"))
    encoder = Encoder(tokenizer, fmt, 16, "truncate", "skip")
    table = pa.table({"prompt": ["Hi", None, "word " * 40, "Bye"], "response": ["a", "b", "c", "d"]})
    batch = encoder.encode(table, BatchRows("t"))
    assert batch.example_rows.tolist() == [0, 3] and batch.untrained[0] == 1 and len(batch.rejected) == 1


# --- layout and routing --------------------------------------------------------------------


def test_layout_numbers_rows_in_source_order_and_limits():
    # (examples, rows read): batch (0, 1) left a row out; its rows are numbered all the same.
    layout = make_layout([((1, 0), (5, 5)), ((0, 1), (2, 3)), ((0, 0), (4, 4))], limit=10)
    assert layout.keys == ((0, 0), (0, 1), (1, 0))
    assert layout.first_rows.tolist() == [0, 4, 7] and layout.kept_rows.tolist() == [4, 3, 3]
    assert layout.num_example_ids == 10
    # Groups of 4 rows: [0, 4), [4, 8), [8, 10); the last batch gives a row to group 1 and two to group 2.
    parts = [group_parts(first, kept, examples_per_group=4) for first, kept in layout.index().values()]
    assert parts == [[(0, 0, 4)], [(1, 0, 3)], [(1, 0, 1), (2, 1, 3)]]
    with pytest.raises(InputError, match="no examples"):
        make_layout([((0, 0), (0, 0))], limit=None)
    with pytest.raises(InputError, match="no examples"):
        make_layout([((0, 0), (0, 3))], limit=None)


def test_what_the_runner_holds_per_batch_does_not_grow_with_its_examples_or_bad_rows(tmp_path):
    # The runner holds every batch's SpilledBatch and GroupBatch in its shuffles: per-example arrays and the bad rows
    # themselves there made the pack command's own memory grow with the dataset.
    from apache_beam import coders

    from pipeline.encode.bad_rows import BadRow, Reason
    from pipeline.encode.examples import EncodedBatch

    coder = coders.registry.get_coder(object)  # what Beam encodes these elements with
    sizes = []
    for n in (10, 10_000):
        lengths = np.full(n, 3, dtype=np.int64)
        # The first bad row grows with n: only where it is and why travel, not its values.
        bad = [BadRow(f"data.jsonl line {i}", Reason.NULL, "column 'prompt' is null",
                      {"prompt": None, "response": "x" * (100 * n if i == 0 else 1)}) for i in range(n)]
        batch = EncodedBatch(lengths, np.arange(3 * n, dtype=np.int32), np.ones(3 * n, dtype=np.uint8),
                             np.arange(n, dtype=np.int64) * 2, bad)
        spilled = spill(batch, str(tmp_path), f"{n:06d}", 2 * n)
        grouped = GroupBatch((0, 1), 0, 2 * n, spilled.path)
        sizes.append(len(coder.encode(((0, 1), spilled))) + len(coder.encode((0, grouped))))
        examples = grouped.examples()
        assert (examples.lengths.tolist(), examples.rows.tolist()) == (lengths.tolist(), list(range(0, 2 * n, 2)))
        first = spilled.rejected.first_bad
        assert spilled.rejected.by_reason == {"null": n} and (first.where, first.message) == (bad[0].where, bad[0].message)
        assert Path(spilled.rejected.path).read_text(encoding="utf-8") == "".join(row.to_json() + "\n" for row in bad)
    assert sizes[1] < 2048 and sizes[1] - sizes[0] < 16  # the counts' own digits


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_routing_places_every_token_once(overflow, tmp_path):
    rng = np.random.default_rng(0)
    capacity, rows_per_shard = 64, 5
    batches = {}
    for key, n in [((0, 0), 40), ((0, 1), 25), ((1, 0), 60)]:
        lengths = rng.integers(1, 150, n)
        tokens = rng.integers(0, 30000, int(lengths.sum())).astype(np.int32)
        batches[key] = (lengths, tokens, (tokens % 2).astype(np.uint8))
    index = make_layout([(k, (v[0].size, v[0].size)) for k, v in batches.items()], limit=None).index()
    from pipeline.encode.examples import EncodedBatch

    grouped = {}  # groups of 50 rows: the second and third batches each fall in two
    for key, (lengths, tokens, mask) in batches.items():
        first, kept = index[key]
        spilled = spill(EncodedBatch(lengths, tokens, mask), str(tmp_path), f"{key[0]}-{key[1]}", lengths.size)
        for group, start, end in group_parts(first, kept, examples_per_group=50):
            grouped.setdefault(group, []).append(GroupBatch(key, first, end, spilled.path, start))
    assert [len(parts) for _, parts in sorted(grouped.items())] == [2, 2, 1]
    plan_dir = str(tmp_path / "plans")
    groups = [
        pack_group(g, b[::-1], capacity, overflow, "best_fit_decreasing", 0, rows_per_shard, plan_dir)  # any arrival order
        for g, b in sorted(grouped.items())
    ]
    groups_paths = [p for g in groups for p in g.shard_plans]
    plans = {shard: ShardPlan.load(path).plan for shard, path in enumerate(groups_paths)}
    placed = {}
    for shard, plan in plans.items():
        table = assemble_shard(ShardPlan.load(groups_paths[shard]))
        validate_table(table, capacity, f"shard {shard}")
        for row in table.to_pylist():
            for j, (example, offset) in enumerate(zip(row["example_ids"], row["example_offsets"])):
                a, b = row["cu_seqlens"][j], row["cu_seqlens"][j + 1]
                placed.setdefault(example, []).append((offset, row["input_ids"][a:b], row["loss_mask"][a:b]))
    stats = PackingStats.merged([g.stats for g in groups])
    assert stats.examples == 125 and stats.rows == sum(p.num_rows for p in plans.values())
    example = 0
    for key in sorted(batches):
        lengths, tokens, mask = batches[key]
        ends = np.cumsum(lengths)
        for n, end in zip(lengths.tolist(), ends.tolist()):
            chunks = sorted(placed.pop(example, []), key=lambda c: c[0])
            got = [t for _, ts, _ in chunks for t in ts]
            expected = tokens[end - n : end].tolist()
            if n > capacity and overflow == "drop":
                assert got == []
            elif n > capacity and overflow == "truncate":
                assert got == expected[:capacity]
            else:
                assert got == expected and [m for _, _, ms in chunks for m in ms] == mask[end - n : end].tolist()
            example += 1
    assert not placed
