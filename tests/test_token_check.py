"""Every build checks its own tokens against the tokenizer's own tokenization of each whole example.

Tests named ``..._whole_text`` pack prompt/response data end to end, prompt and response tokenized as
one text (the check finds the extra ``▁`` of the two tokenized apart). The reference renders each example
as the build does (its template's named fields, Alpaca's layouts, the system prompt, merged system turns
and dropped dangling turns) but takes its tokens from the tokenizer alone.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from pipeline.beam_pipeline import finish_filtered
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.examples import EncodedBatch, Encoder, encode_ids
from pipeline.encode.token_check import SAMPLE_SIZE, TokenChecker, first_differences, sample_mask
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.errors import TokenMismatchError
from pipeline.packing.spill import SpilledRejects
from pipeline.pack import main
from pipeline.read.formats import ExampleFormat, split_prompt_template
from pipeline.read.readers import BatchRows
from pipeline.report.summary import describe_token_check, reuse_token_check_error
from schemas import ExampleKind, PackingStats, read_manifest

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
    stats = build(PackConfig(dataset=data, out=str(tmp_path / "out"), progress=False, verify_tokens="off")).manifest.stats
    assert stats.examples_checked == 0 and stats.token_check == "off"  # reused: a run setting, not fingerprinted


def test_a_reused_build_reports_the_check_it_had_and_refuses_a_stronger_one(tmp_path, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(SAMPLE_SIZE + 100)])
    args = ["--dataset", data, "--out", str(tmp_path / "out"), "--max-len", "64", "--no-progress", "--no-report"]
    assert main([*args, "--verify-tokens", "sample"]) == 0
    capsys.readouterr()
    assert main([*args, "--verify-tokens", "sample"]) == 0  # reused: says what was checked when it was built
    assert f"{SAMPLE_SIZE:,} examples checked when built (a seeded sample)" in capsys.readouterr().out
    assert main([*args, "--verify-tokens", "all"]) == 1  # not reused as if every example had been checked
    out, err = capsys.readouterr()
    assert "token check" not in out
    assert err.count("\n") == 1 and "--verify-tokens all asks for more than this build checked" in err
    assert f"--verify-tokens sample, {SAMPLE_SIZE:,} examples of {SAMPLE_SIZE + 100:,}" in err and "--force" in err
    assert main([*args, "--verify-tokens", "all", "--force"]) == 0
    assert f"{SAMPLE_SIZE + 100:,} examples checked (all examples)" in capsys.readouterr().out
    assert main([*args, "--verify-tokens", "sample"]) == 0  # an all-checked build stands for a sample
    assert f"{SAMPLE_SIZE + 100:,} examples checked when built (all examples)" in capsys.readouterr().out


def test_a_check_over_an_unchecked_build_or_differences_under_error_refuse_reuse(tmp_path, capsys):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": f"Line {i}"} for i in range(5)])
    args = ["--dataset", data, "--out", str(tmp_path / "out"), "--no-progress", "--no-report"]
    assert main([*args, "--verify-tokens", "off"]) == 0
    capsys.readouterr()
    assert main([*args, "--verify-tokens", "sample"]) == 1
    assert "--verify-tokens sample asks for more than this build checked when it was built (--verify-tokens off" in (
        capsys.readouterr().err
    )
    stats = read_manifest(plan_build(PackConfig(dataset=data, out=str(tmp_path / "out"))).out_dir).stats
    stats.examples_checked, stats.examples_equal, stats.token_check = 5, 4, "all"
    assert reuse_token_check_error(stats, "sample", "count") is None
    assert "1 example of this build differs from" in (reuse_token_check_error(stats, "sample", "error") or "")
    assert reuse_token_check_error(stats, "off", "error") is None


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


def encoded_and_checked(example_format: ExampleFormat, table: pa.Table, max_len: int = 4096, overflow: str = "split"):
    """The encoder's batch of ``table`` and what checking all of its examples found."""
    tokenizer = load_tokenizer()
    batch = Encoder(tokenizer, example_format, max_len, overflow).encode(table, BatchRows("data.jsonl"))
    checker = TokenChecker(tokenizer, example_format, "error")
    return batch, checker.check(table, BatchRows("data.jsonl"), batch, np.ones(batch.lengths.size, dtype=bool))


def test_named_fields_alpaca_rows_and_a_system_prompt_are_checked_as_the_encoder_renders_them():
    """The reference renders prompt/response rows with the build's own template, whatever it names: text around
    named columns, Alpaca's two layouts (an empty or null input leaves the input section out), a system prompt."""
    alpaca = pa.table({
        "instruction": ["Add the numbers.", "Say hello.", "Name a colour."],
        "input": ["2 and 3", "", None],
        "output": ["5", "Hello!", "Blue"],
    })
    named = pa.table({"question": ["How old is Tom?", "What is 2+3?"], "context": ["Tom is five.", "Sums."], "answer": ["Five", "5"]})
    qa = pa.table({"q": ["How old is Tom?"], "a": ["Five"]})
    cases = [
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("instruction", "input", "output"), prompt_template="alpaca"), alpaca),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("instruction", "input", "output"), prompt_template="alpaca",
                       system_prompt="Be brief."), alpaca),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("context", "question", "answer"),
                       prompt_template="<ctx>{context}</ctx> Q: {question}\\nA: {answer} (end)"), named.select([1, 0, 2])),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template="[{system}] {q} => {a}", system_prompt="Be brief."),
         qa),
        (ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE, system_prompt="Be brief."), qa),
    ]
    for example_format, table in cases:
        table = table.select(list(example_format.columns))
        _, counts = encoded_and_checked(example_format, table)
        assert counts.checked == counts.equal == table.num_rows, example_format
    # The reference is the rendered text itself: Alpaca's prompt, tokenized whole by the tokenizer.
    checker = TokenChecker(load_tokenizer(), cases[0][0], "error")
    texts, _ = checker.rendered_texts(alpaca)
    assert "### Input:\n2 and 3\n\n### Response:\n5" in texts[0]
    assert "### Input" not in texts[1] and "### Input" not in texts[2]
    system, _ = TokenChecker(load_tokenizer(), cases[4][0], "error").rendered_texts(qa)
    assert system == ["Be brief.\n\n### Question: How old is Tom?\n### Answer: Five"]


SHAREGPT = [
    [{"from": "system", "value": f"Answer as number {i}."}, {"from": "human", "value": f"What is {i} + {i}?"},
     {"from": "gpt", "value": f"It is {2 * i}."}, {"from": "human", "value": "Thanks!"}]
    for i in range(6)
]


def test_a_merged_system_turn_and_dropped_dangling_turns_are_checked_as_the_build_uses_them():
    """Mistral's template refuses system turns, so the build merges the system turn into the first user turn,
    and drops ShareGPT's trailing user turn: the reference is apply_chat_template of those same messages,
    and tokens that lost the system turn instead are caught."""
    tokenizer = load_tokenizer()
    example_format = ExampleFormat(ExampleKind.CHAT, ("conversations",), chat_template=tokenizer.chat_template)
    table = pa.table({"conversations": SHAREGPT})
    batch, counts = encoded_and_checked(example_format, table)
    assert counts.checked == counts.equal == len(SHAREGPT)
    text = tokenizer.backend().decode(batch.tokens[: batch.lengths[0]].tolist(), skip_special_tokens=False)
    assert text.startswith("<s>[INST] Answer as number 0.\n\nWhat is 0 + 0? [/INST]") and "Thanks" not in text
    without_system = pa.table({"conversations": [chat[1:] for chat in SHAREGPT]})
    lost = Encoder(tokenizer, example_format, 4096, "split").encode(without_system, BatchRows("data.jsonl"))
    with pytest.raises(TokenMismatchError, match="data.jsonl row 0: its tokens differ from the tokenizer's apply_chat_template"):
        TokenChecker(tokenizer, example_format, "error").check(table, BatchRows("data.jsonl"), lost, np.ones(6, dtype=bool))
    as_chat = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), chat_template=tokenizer.chat_template, as_chat=True,
                            system_prompt="Be brief.")
    _, counts = encoded_and_checked(as_chat, pa.table({"q": ["How old is Tom?"], "a": ["Five"]}))
    assert counts.checked == counts.equal == 1


def test_truncate_side_left_examples_are_checked_as_the_whole_texts_last_tokens():
    """An example whose prompt's head --truncate-side left cut is the BOS and the whole text's last tokens; a
    kept token that is not is caught."""
    example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE, keep_response=True)
    table = pa.table({"q": ["word " * 60, "Short?"], "a": ["The answer is five.", "Yes."]})
    batch, counts = encoded_and_checked(example_format, table, max_len=32, overflow="truncate")
    assert batch.prompt_cut[0] == 1 and batch.lengths[0] == 32
    assert counts.checked == counts.equal == 2
    batch.tokens[5] += 1  # a kept prompt token of the cut example, now another
    with pytest.raises(TokenMismatchError, match="data.jsonl row 0: .* at token 5"):
        TokenChecker(load_tokenizer(), example_format, "error").check(table, BatchRows("data.jsonl"), batch, np.ones(2, bool))


@pytest.mark.parametrize("name", ["alpaca", "named fields", "sharegpt system"])
def test_the_issues_examples_pack_with_every_example_checked_equal(tmp_path, capsys, name):
    """Packed end to end: an Alpaca file, a template with text around named fields and a system prompt, and
    ShareGPT chats with a system turn and a dangling user turn; the report checks every example, all equal."""
    rows, options = {
        "alpaca": ([{"instruction": f"Add {i} and {i}.", "input": "" if i % 2 else f"{i}, {i}", "output": f"{2 * i}"}
                    for i in range(8)], []),
        "named fields": ([{"question": f"What is {i}+{i}?", "context": "Arithmetic.", "answer": f"{2 * i}"} for i in range(8)],
                         ["--prompt-template", "Context: {context}\\nQuestion: {question}\\nAnswer: {answer}.",
                          "--system-prompt", "Be exact."]),
        "sharegpt system": ([{"conversations": chat} for chat in SHAREGPT], []),
    }[name]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    args = ["--dataset", data, "--out", str(tmp_path / "out"), "--no-progress", "--no-report", *options]
    assert main(args) == 0, capsys.readouterr().err
    n = len(rows)
    assert f"{n} examples checked (a seeded sample) against the tokenizer's own tokenization, {n} equal\n" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["prompt/response", "train on prompt", "text", "prompt head cut"])
def test_a_loss_mask_the_whole_texts_offsets_contradict_is_caught_naming_the_row(case):
    """The loss mask of a prompt/response or text example is checked too, against the tokenizer's own character
    offsets in the whole text: 0 over the BOS and the tokens wholly before the response's first character (none
    under --train-on-prompt), 1 from there through EOS. The encoder's masks pass; one flipped token is caught."""
    table = pa.table({"q": ["How old is Tom? " * (12 if case == "prompt head cut" else 1), "What is 2+3?"],
                      "a": ["Five years old.", "5"]})
    formats = {
        "prompt/response": ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE),
        "train on prompt": ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE,
                                         train_on_prompt=True),
        "text": ExampleFormat(ExampleKind.TEXT, ("q",)),
        "prompt head cut": ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE,
                                         keep_response=True),
    }
    example_format = formats[case]
    batch, counts = encoded_and_checked(example_format, table, max_len=40, overflow="truncate")
    assert counts.checked == counts.equal == 2
    if case == "prompt head cut":
        assert batch.prompt_cut[0] == 1 and batch.lengths[0] == 40
    first_trained = int(np.flatnonzero(batch.loss_mask[: batch.lengths[0]])[0])
    assert (first_trained == 1) == (case in ("train on prompt", "text"))  # after the BOS, or after the prompt
    batch.loss_mask[first_trained] = 0  # the first trained token of row 0, now untrained
    checker = TokenChecker(load_tokenizer(), example_format, "error")
    with pytest.raises(TokenMismatchError, match=f"data.jsonl row 0: .* leaves a completion token untrained at token {first_trained} "):
        checker.check(table, BatchRows("data.jsonl"), batch, np.ones(2, bool))
    batch.loss_mask[first_trained] = 1
    batch.loss_mask[0] = 1  # the BOS, now trained
    counted = TokenChecker(load_tokenizer(), example_format, "count").check(table, BatchRows("data.jsonl"), batch, np.ones(2, bool))
    assert (counted.checked, counted.equal) == (2, 1) and "trains a prompt token at token 0" in counted.first_mismatch


def test_a_left_cut_that_took_response_tokens_is_caught_naming_the_row():
    """Under --truncate-side left a cut must leave the response whole: an example holding the whole text's last
    tokens, every one after the BOS trained, but with the response's first tokens cut away too, is a difference, counted
    under --on-token-mismatch count as what it is: a cut that took response tokens."""
    tokenizer = load_tokenizer()
    example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template="{prompt}\\n{response}",
                                   keep_response=True)
    table = pa.table({"q": ["word " * 40], "a": ["The answer is five, said the teacher."]})
    text = example_format.example_kind.render_text(table)[0][0]
    backend = tokenizer.backend()
    whole = backend.encode(text, add_special_tokens=False).ids
    prompt = len(backend.encode(text[: text.index("The")], add_special_tokens=False).ids)
    kept = whole[prompt + 3 :]  # the whole prompt and the response's first three tokens cut away
    tokens = np.array([*tokenizer.prefix_ids, *kept, *tokenizer.suffix_ids], np.int32)
    mask = np.array([0] * len(tokenizer.prefix_ids) + [1] * (len(kept) + len(tokenizer.suffix_ids)), np.uint8)
    batch = EncodedBatch(np.array([tokens.size]), tokens, mask)
    with pytest.raises(TokenMismatchError, match=r"data.jsonl row 0: .* took the first 3 tokens of its response"):
        TokenChecker(tokenizer, example_format, "error").check(table, BatchRows("data.jsonl"), batch, np.ones(1, bool))
    # Counted, it is neither a difference in tokens nor one in the loss mask alone, and the warning says what it is.
    counted = TokenChecker(tokenizer, example_format, "count").check(table, BatchRows("data.jsonl"), batch, np.ones(1, bool))
    assert (counted.checked, counted.equal, counted.mask_only, counted.response_cut) == (1, 0, 0, 1)
    assert counted.mismatch_warning().startswith(
        "1 of 1 example checked differs from the token check's reference (1 with response tokens cut by --truncate-side left); "
        "the first, data.jsonl row 0: its tokens are the whole text's last ones, but the cut of its head")


def test_a_loss_mask_difference_is_counted_and_reported_as_one_not_as_a_tokenization_difference(tmp_path, caplog):
    """Under --on-token-mismatch count, the build's warning counts an example whose tokens equal the reference but whose
    loss mask does not apart from one whose tokens differ, and shows the first without suggesting the option already
    given. The manifest records only the examples checked and equal, so the report and a refused reuse say of any
    build, packed by this varpack or an older one, that they differ in their tokens or loss mask."""
    example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("q", "a"), prompt_template=DOCS_TEMPLATE)
    table = pa.table({"q": ["How old is Tom?", "What is 2+3?", "Who?"], "a": ["Five years old.", "5", "Me."]})
    batch, _ = encoded_and_checked(example_format, table)
    batch.loss_mask[0] = 1  # row 0's BOS, now trained: its tokens are still equal
    batch.tokens[batch.starts[1] + 2] += 1  # a token of row 1, now another
    checker = TokenChecker(load_tokenizer(), example_format, "count")
    first, rest = (checker.check(table, BatchRows("data.jsonl"), batch, np.arange(3) == 0),
                   checker.check(table, BatchRows("data.jsonl"), batch, np.arange(3) > 0))
    assert (first.checked, first.equal, first.mask_only, rest.checked, rest.equal, rest.mask_only) == (1, 0, 1, 2, 1, 0)
    assert first.first_mismatch.startswith("data.jsonl row 0: its tokens equal the whole text tokenized at once, but "
                                           "its loss mask trains a prompt token at token 0")
    assert "pass --on-token-mismatch count" not in first.first_mismatch
    assert "packed as built and counted (--on-token-mismatch count)" in first.first_mismatch
    # The two batches' notes as the build gathers them, in any order: the build's warning names the first in source order.
    notes = [((0, part), rows, SpilledRejects(Counter()), (0, 0, 0, 0), Counter(), counts, {})
             for part, rows, counts in [(1, 2, rest), (0, 1, first)]]
    with caplog.at_level(logging.WARNING, logger="varpack"):
        filtered = finish_filtered(notes, str(tmp_path), 0)
    assert caplog.messages == [
        "2 of 3 examples checked differ from the token check's reference (1 in tokens, 1 in the loss mask only); "
        f"the first, {first.first_mismatch}"
    ]
    assert (filtered.examples_checked, filtered.examples_equal) == (3, 1)
    stats = PackingStats(examples=3, examples_checked=3, examples_equal=1, token_check="all")
    assert describe_token_check(stats, "all") == (
        "3 examples checked (all examples) against the tokenizer's own tokenization, 1 equal, 2 differ in their tokens "
        "or loss mask (--on-token-mismatch count; the warning above counts each kind and shows the first)")
    assert describe_token_check(stats, "sample", reused=True).endswith(
        "1 equal, 2 differ in their tokens or loss mask (--on-token-mismatch count; the first was logged when it was built)")
    assert reuse_token_check_error(stats, "sample", "error").startswith(
        "2 examples of this build differ from the token check's reference in their tokens or loss mask (found when it was built)")
