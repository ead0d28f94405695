"""Every build checks its own tokens against the tokenizer's own tokenization of each whole example.

Tests named ``..._whole_text`` pack prompt/response data end to end: they pass once prompt and
response are tokenized as one text (until then the check finds the extra ``▁`` it was built to find).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest

from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.examples import EncodedBatch, Encoder, encode_ids
from pipeline.encode.token_check import SAMPLE_SIZE, TokenChecker, first_differences, sample_mask
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.errors import TokenMismatchError
from pipeline.pack import main
from pipeline.read.formats import ExampleFormat, split_prompt_template
from pipeline.read.readers import BatchRows
from schemas import ExampleKind, read_manifest

DOCS_TEMPLATE = "### Question: {prompt}\\n### Answer: {response}"
CHATS = [
    [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}] for i in range(40)
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def apart(tokenizer, example_format: ExampleFormat, table: pa.Table) -> EncodedBatch:
    """Prompt/response examples with prompt and response tokenized apart: the encoding issue 27 found (``: ▁ ▁5``)."""
    before, between, after = split_prompt_template(example_format.prompt_template)
    prompts, responses = (table.column(c).to_pylist() for c in example_format.columns)
    pieces = [before + p + between for p in prompts] + [r + after for r in responses]
    ids, lengths = encode_ids(tokenizer.backend(), pieces, np.dtype(np.int32))
    starts = np.cumsum(lengths) - lengths
    n = len(prompts)
    examples = [
        [*tokenizer.prefix_ids, *ids[starts[i] : starts[i] + lengths[i]], *ids[starts[n + i] : starts[n + i] + lengths[n + i]],
         *tokenizer.suffix_ids]
        for i in range(n)
    ]
    tokens = np.concatenate([np.array(e, dtype=np.int32) for e in examples])
    return EncodedBatch(np.array([len(e) for e in examples]), tokens, np.zeros(tokens.size, np.uint8))


def test_first_differences_finds_the_first_unequal_token_and_a_missing_tail():
    built = [[1, 5, 6, 2], [1, 7, 2], [1, 7], [], [3, 9, 9]]
    reference = [[1, 5, 6, 2], [1, 7, 7, 2], [1, 7, 2], [], [3, 8]]
    flat = [(np.array(sum(side, []), dtype=np.int64), np.array([len(s) for s in side])) for side in (built, reference)]
    assert first_differences(*flat[0], *flat[1]).tolist() == [-1, 2, 2, -1, 1]


def test_the_sample_is_seeded_and_holds_exactly_its_size_wherever_rows_are_read():
    """Workers decide alone which examples are checked: the places of a dataset of known size, split
    among read tasks in any way, hold exactly SAMPLE_SIZE checked ones, and another seed picks others."""
    n = 25_000
    places = np.arange(n)
    whole = sample_mask(places, n, seed=0)
    parts = np.concatenate([sample_mask(part, n, seed=0) for part in np.array_split(places, 7)])
    assert whole.sum() == SAMPLE_SIZE and np.array_equal(whole, parts)
    assert not np.array_equal(whole, sample_mask(places, n, seed=1))
    assert np.flatnonzero(whole).max() > n // 2  # spread over the dataset, not its head
    assert sample_mask(np.arange(300), 300, seed=0).all()
    assert sample_mask(np.arange(1500), None, seed=0).sum() == SAMPLE_SIZE  # unknown size: each task's first places


def test_prompt_and_response_tokenized_apart_are_caught_naming_the_row_and_both_sequences():
    """Issue 27 item 3: the docs' template packed a double space with a SentencePiece tokenizer. The check
    refuses such tokens with the example's row, both token sequences and both decoded texts, one line each."""
    tokenizer = load_tokenizer()
    example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE)
    table = pa.table({"q": ["How old is Tom?", "What is 2+3?"], "a": ["Five", "5"]})
    batch = apart(tokenizer, example_format, table)
    checker = TokenChecker(tokenizer, example_format, "error")
    with pytest.raises(TokenMismatchError) as caught:
        checker.check(table, BatchRows("data.jsonl", first_row=10), batch, np.ones(2, dtype=bool))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("data.jsonl row 10: its tokens differ from the whole text tokenized at once at token")
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["built", "reference", "built text", "reference text"]
    assert "Answer:  Five" in lines[3] and "Answer: Five" in lines[4]
    counted = TokenChecker(tokenizer, example_format, "count").check(table, BatchRows("data.jsonl"), batch, np.ones(2, bool))
    assert (counted.checked, counted.equal) == (2, 0) and counted.first_mismatch.startswith("data.jsonl row 0:")


def test_the_encoders_text_and_chat_examples_equal_the_reference():
    """Text examples ([bos] text [eos], long texts cut into pieces) and chats (the tokenizer's own
    apply_chat_template) as the encoder makes them pass the check."""
    tokenizer = load_tokenizer()
    texts = pa.table({"text": ["Plain text. " * 20, "x" * 70_000 + " tail " + "word " * 20_000, "Short"]})
    chats = pa.table({"messages": CHATS})
    cases = [
        (ExampleFormat(ExampleKind.TEXT, ("text",)), texts),
        (ExampleFormat(ExampleKind.CHAT, ("messages",), chat_template=tokenizer.chat_template), chats),
    ]
    for example_format, table in cases:
        batch = Encoder(tokenizer, example_format, 4096, "split").encode(table, BatchRows("data.jsonl"))
        everything = np.ones(batch.lengths.size, dtype=bool)
        counts = TokenChecker(tokenizer, example_format, "error").check(table, BatchRows("data.jsonl"), batch, everything)
        assert counts.checked == counts.equal == table.num_rows


def test_a_chat_build_checks_every_example_under_verify_tokens_all(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat} for chat in CHATS])
    assert main(["--dataset", data, "--out", str(tmp_path / "out"), "--verify-tokens", "all", "--no-progress", "--no-report"]) == 0
    report = capsys.readouterr().out
    assert f"{len(CHATS)} examples checked (all examples) against the tokenizer's own tokenization, {len(CHATS)} equal" in report
    stats = read_manifest(plan_build(PackConfig(dataset=data, out=str(tmp_path / "out"))).out_dir).stats
    assert stats.examples_checked == stats.examples_equal == len(CHATS)


def test_verify_tokens_off_says_so_and_checks_nothing(tmp_path, capsys):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": f"Line {i}"} for i in range(5)])
    assert main(["--dataset", data, "--out", str(tmp_path / "out"), "--verify-tokens", "off", "--no-progress", "--no-report"]) == 0
    assert re.search(r"token check +off \(--verify-tokens off\)", capsys.readouterr().out)
    stats = build(PackConfig(dataset=data, out=str(tmp_path / "out"), progress=False)).manifest.stats
    assert stats.examples_checked == 0  # reused: the check is a run setting, not part of the fingerprint


def test_the_quickstart_reports_its_check_whole_text(quickstart):
    """A default build of the Quickstart (GSM8K, Mistral tokenizer) checks a seeded sample of 1,000 examples."""
    cwd, finished = quickstart
    assert finished.returncode == 0, finished.stderr
    assert re.search(r"token check +1,000 examples checked \(a seeded sample\) .*, 1,000 equal$", finished.stdout, re.M)
    (build_dir,) = (cwd / "shards").iterdir()
    stats = read_manifest(build_dir).stats
    assert stats.examples_checked == stats.examples_equal == SAMPLE_SIZE


def test_the_docs_template_packs_no_double_space_whole_text(tmp_path, capsys):
    """Issue 27 item 3 end to end: the docs' template with the default SentencePiece tokenizer passes the check."""
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": "What is 2+3?", "answer": "5"}] * 3)
    args = ["--dataset", data, "--out", str(tmp_path / "out"), "--prompt-template", DOCS_TEMPLATE, "--no-progress", "--no-report"]
    assert main(args) == 0, capsys.readouterr().err
    assert "3 examples checked (a seeded sample) against the tokenizer's own tokenization, 3 equal" in capsys.readouterr().out
