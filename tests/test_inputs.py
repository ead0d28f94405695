"""What a build reads of the data users bring: every file and column it should, rendered as the template
says and tokenized as the whole text is, and a line for whatever it leaves out."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest

from pipeline.build import build
from pipeline.config import PackConfig
from pipeline.encode.examples import Encoder
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.pack import main
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import BatchRows
from pipeline.read.templates import ALPACA_WITH_INPUT, ALPACA_WITHOUT_INPUT
from schemas import ExampleKind, read_manifest
from tests.test_pipeline_e2e import read_examples
from tests.test_tokenizer_files import sentencepiece_model, tiktoken_ranks  # noqa: F401  (fixtures)

ALPACA_ROWS = [
    {"instruction": "Answer from the context.", "input": "Tom is five. How old is Tom?", "output": "Five"},
    {"instruction": "Name a prime number.", "input": "", "output": "7"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pack(tmp_path, capsys, *args: str) -> tuple[str, str]:
    """Run ``pack`` with ``args``; the build directory and what it printed to stderr."""
    assert main([*args, "--out", str(tmp_path / "out"), "--no-progress", "--no-report"]) == 0
    (build_dir,) = (tmp_path / "out").iterdir()
    return str(build_dir), capsys.readouterr().err


def decoded(build_dir: str) -> list[tuple[str, str]]:
    """Each example's text between BOS and EOS, and its trained text before EOS, decoded with the default
    tokenizer, in example order."""
    backend = load_tokenizer().backend()
    texts = []
    for _, (tokens, mask) in sorted(read_examples(build_dir).items()):
        assert tokens[0] == 1 and tokens[-1] == 2 and mask[0] == 0 and mask[-1] == 1
        texts.append((backend.decode(tokens[1:-1].tolist()), backend.decode(tokens[:-1][mask[:-1] == 1].tolist())))
    return texts


def test_alpaca_rows_keep_their_input(tmp_path, capsys):
    """instruction/input/output rows are rendered with Alpaca's template, the input section where input holds text."""
    data = write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data))
    (with_input, trained), (without_input, _) = decoded(build_dir)
    assert with_input == ALPACA_WITH_INPUT.format(**ALPACA_ROWS[0])
    assert trained == "Five"
    assert without_input == ALPACA_WITHOUT_INPUT.format(**ALPACA_ROWS[1])
    assert read_manifest(build_dir).inputs.template.count("alpaca") == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_key_first_seen_in_a_later_row_is_a_column(tmp_path, capsys, suffix):
    """Alpaca rows whose first row has no ``input``: the column is still found, read and rendered, under --strict."""
    rows = [{"instruction": "Say hi", "output": "hi"}, {"instruction": "Translate", "input": "hello", "output": "bonjour"}]
    data = tmp_path / f"a{suffix}"
    if suffix == ".json":
        data.write_text(json.dumps(rows))
    else:
        write_jsonl(data, rows)
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--strict")
    assert [text for text, _ in decoded(build_dir)] == [ALPACA_WITHOUT_INPUT.format(**rows[0]), ALPACA_WITH_INPUT.format(**rows[1])]
    assert read_manifest(build_dir).stats.source_columns_used == ["instruction", "input", "output"]


def test_a_key_first_seen_after_a_line_that_is_not_an_object_is_a_column(tmp_path, capsys):
    """Lines that are not objects (bad rows, skipped here) do not hide the keys of the records after them."""
    rows = [{"instruction": "Say hi", "output": "hi"}, {"instruction": "Translate", "input": "hello", "output": "bonjour"}]
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join([json.dumps(rows[0]), "null", json.dumps(rows[1])]) + "\n")
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--on-bad-row", "skip", "--max-bad-rows", "1")
    assert [text for text, _ in decoded(build_dir)] == [ALPACA_WITHOUT_INPUT.format(**rows[0]), ALPACA_WITH_INPUT.format(**rows[1])]


def test_a_template_names_any_column_and_a_system_prompt(tmp_path, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [{"topic": "math", "q": "2 + 3?", "a": "5", "unused": "x"}])
    build_dir, _ = pack(
        tmp_path, capsys, "--dataset", str(data), "--prompt-template", "{system}\\n[{topic}] {q}\\nA: {a}",
        "--system-prompt", "Be brief.",
    )
    ((text, trained),) = decoded(build_dir)
    assert text == "Be brief.\n[math] 2 + 3?\nA: 5" and trained == "5"


def test_a_system_prompt_goes_before_a_template_without_one(tmp_path, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "2 + 3?", "answer": "5"}])
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--system-prompt", "Be brief.")
    ((text, _),) = decoded(build_dir)
    assert text == "Be brief.\n\n2 + 3?\n\n5"


@pytest.mark.parametrize(
    "template, bad",
    [("{prompt}", "at least one for the prompt"), ("{q} {q} {a}", "each field once"), ("{a!r} {b}", "not a column name"),
     ("{prompt} {response", "--prompt-template")],
)
def test_a_bad_template_fails_in_one_line(tmp_path, capsys, template, bad):
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "response": "r", "q": "q", "a": "a", "b": "b"}])
    assert main(["--dataset", str(data), "--prompt-template", template, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert bad in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, template, line",
    [
        (["--prompt-column", "question", "--response-column", "answer"], "P: {prompt} Q: {question}\\nA: {response}",
         "{prompt} and {question} both read column 'question' (--prompt-column question)"),
        (["--prompt-column", "question", "--response-column", "answer"], "{prompt}\\n{answer} {response}",
         "{answer} and {response} both read column 'answer' (--response-column answer)"),
    ],
)
def test_two_template_fields_on_one_column_are_one_line(tmp_path, capsys, options, template, line):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}])
    assert main(["--dataset", str(data), *options, "--prompt-template", template, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"varpack: error: --prompt-template {template!r}: {line}; name each column once"
    assert not (tmp_path / "out").exists()


TEMPLATES = ["{prompt}\n\n{response}", "### Question: {prompt}\n### Answer: {response}", "Q: {prompt} A:{response}", "{prompt}{response}"]
PAIRS = [("What is 2 + 3?", "5"), ("Name a city.", " Paris, the capital"), ("café 東京?", "naïve 🙂"), ("x", "Five")]


def assert_tokens_are_the_whole_text(tokenizer, template: str) -> None:
    """Each packed example is ``[bos] tokenizer(whole text) [eos]``, its loss on exactly the response's tokens and EOS."""
    table = pa.table({"prompt": [p for p, _ in PAIRS], "response": [r for _, r in PAIRS]})
    example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("prompt", "response"), prompt_template=template)
    batch = Encoder(tokenizer, example_format, 4096, "split").encode(table, BatchRows("t"))
    backend, prefix, suffix = tokenizer.backend(), list(tokenizer.prefix_ids), list(tokenizer.suffix_ids)
    ends = np.cumsum(batch.lengths)
    for (prompt, response), end, length in zip(PAIRS, ends, batch.lengths):
        tokens, mask = batch.tokens[end - length : end].tolist(), batch.loss_mask[end - length : end].tolist()
        before, after = template.split("{prompt}")[0], template.split("{response}")[0].split("{prompt}")[1]
        rendered_prompt = before + prompt + after
        whole = backend.encode(rendered_prompt + response, add_special_tokens=False)
        assert tokens == prefix + whole.ids + suffix
        # The response's tokens: those that end past where it starts (the first may hold a space before it).
        starts_in_response = [end > len(rendered_prompt) for _, end in whole.offsets]
        assert mask == [0] * len(prefix) + [int(trained) for trained in starts_in_response] + [1] * len(suffix)


@pytest.mark.parametrize("template", TEMPLATES)
def test_packed_tokens_are_the_whole_text_with_the_default_tokenizer(template):
    """The docs' own template gave ':', '▁', '▁', '5' where the whole text is ':', '▁', '5'."""
    assert_tokens_are_the_whole_text(load_tokenizer(), template)


@pytest.mark.parametrize("template", TEMPLATES)
def test_packed_tokens_are_the_whole_text_with_sentencepiece_and_tiktoken(sentencepiece_model, tiktoken_ranks, template):  # noqa: F811
    assert_tokens_are_the_whole_text(load_tokenizer(str(sentencepiece_model)), template)
    assert_tokens_are_the_whole_text(load_tokenizer(str(tiktoken_ranks[0]), eos_token="a"), template)


def test_the_docs_template_trains_no_double_space(tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2 + 3?", "answer": "5"}])
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--prompt-template", "### Question: {prompt}\\n### Answer: {response}")
    ((tokens, mask),) = read_examples(build_dir).values()
    backend = load_tokenizer().backend()
    pieces = [backend.id_to_token(int(i)) for i in tokens]
    assert pieces[-4:] == [":", "▁", "5", "</s>"] and mask[-4:].tolist() == [0, 0, 1, 1]


def test_config_builds_what_the_cli_builds(tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data))
    result = build(PackConfig(dataset=str(data), out=str(tmp_path / "api"), progress=False, report=False))
    assert result.manifest.fingerprint == read_manifest(build_dir).fingerprint


# --- files and columns read --------------------------------------------------------------------


def test_a_directory_reads_the_files_that_name_no_split_as_train(tmp_path, capsys):
    """Beside train.jsonl, more_data.jsonl names no split, so it is train too; both are listed as read."""
    data = tmp_path / "d2"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in (1, 2)])
    write_jsonl(data / "more_data.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in (3, 4, 5)])
    write_jsonl(data / "test.jsonl", [{"question": "q6", "answer": "a6"}])
    (data / "README.md").write_text("# d2\n")
    (data / "extra.csv").write_text("question,answer\nq7,a7\n")
    build_dir, err = pack(tmp_path, capsys, "--dataset", str(data))
    manifest = read_manifest(build_dir)
    assert manifest.stats.examples == 5 and manifest.stats.source_files == ["more_data.jsonl", "train.jsonl"]
    assert "the files of other splits are not read: test.jsonl" in err
    assert "warning: extra.csv: not read (not a .jsonl, .json, .parquet, .arrow file)" in err and "README" not in err
    assert main(["--dataset", str(data), "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert "extra.csv: not read" in capsys.readouterr().err and not (tmp_path / "strict").exists()


@pytest.mark.parametrize("with_train", [True, False])
def test_a_hidden_data_file_is_skipped_with_a_line_and_underscored_ones_are_read(tmp_path, capsys, with_train):
    """As on the Hub, ``.hidden.jsonl`` is not read, and a warning names it (an error under --strict); ``_extra.jsonl``
    and ``_more/x.jsonl`` are read as train, whether ``train.jsonl`` is beside them or not."""
    data = tmp_path / "d"
    (data / "_more").mkdir(parents=True)
    names = ["_extra.jsonl", "_more/x.jsonl", *(["train.jsonl"] if with_train else [])]
    for name in [*names, ".hidden.jsonl"]:
        write_jsonl(data / name, [{"prompt": f"file {name}", "response": "ok"}])
    build_dir, err = pack(tmp_path, capsys, "--dataset", str(data))
    assert read_manifest(build_dir).stats.source_files == sorted(names)
    assert "warning: .hidden.jsonl: not read (hidden: as on the Hub" in err
    assert main(["--dataset", str(data), "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert ".hidden.jsonl: not read" in capsys.readouterr().err and not (tmp_path / "strict").exists()


def test_the_report_and_the_manifest_say_which_columns_were_not_read(tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"id": 7, "question": "2 + 3?", "answer": "5", "source": "web"}])
    assert main(["--dataset", str(data), "--out", str(tmp_path / "out"), "--no-progress", "--no-report"]) == 0
    out, err = capsys.readouterr()
    assert "warning: q.jsonl: column id is not read (the examples use question, answer)" in err
    assert "warning: q.jsonl: column source is not read" in err
    assert re.search(r"files read +q\.jsonl", out) and re.search(r"not read +id, source", out)
    stats = read_manifest(next((tmp_path / "out").iterdir())).stats
    assert (stats.source_columns_used, stats.source_columns_unused) == (["question", "answer"], ["id", "source"])


def test_strict_refuses_a_column_left_unread_and_writes_nothing(tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"topic": "math", "question": "2 + 3?", "answer": "5"}])
    assert main(["--dataset", str(data), "--out", str(tmp_path / "out"), "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "varpack: error: q.jsonl: column topic is not read (the examples use question, answer) (--strict)"
    assert not (tmp_path / "out").exists()
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--strict", "--prompt-template", "[{topic}] {question}\\n{answer}")
    assert decoded(build_dir)[0][0] == "[math] 2 + 3?\n5"


def test_files_that_share_no_column_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"question": "q", "answer": "a"}])
    write_jsonl(tmp_path / "data" / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    assert main(["--dataset", str(tmp_path / "data"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "its 2 files share no column (chat.jsonl: messages; train.jsonl: question, answer)" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_datasets_save_to_disk_directory_is_read_as_a_dataset(tmp_path, capsys, as_dict):
    import datasets

    rows = {"question": ["2 + 3?", "Name a prime."], "answer": ["5", "7"]}
    saved = datasets.Dataset.from_dict(rows)
    held_out = datasets.Dataset.from_dict({"question": ["1 + 1?"], "answer": ["2"]})
    (datasets.DatasetDict({"train": saved, "test": held_out}) if as_dict else saved).save_to_disk(str(tmp_path / "saved"))
    build_dir, err = pack(tmp_path, capsys, "--dataset", str(tmp_path / "saved"))
    assert [text for text, _ in decoded(build_dir)] == ["2 + 3?\n\n5", "Name a prime.\n\n7"]
    assert "warning" not in err and all(name.endswith(".arrow") for name in read_manifest(build_dir).stats.source_files)
    if as_dict:
        build_dir, _ = pack(tmp_path / "test", capsys, "--dataset", str(tmp_path / "saved"), "--split", "test")
        assert [text for text, _ in decoded(build_dir)] == ["1 + 1?\n\n2"]


def test_file_urls_name_local_paths(tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "2 + 3?", "answer": "5"}])
    assert main(["--dataset", f"file://{data}", "--out", f"file://{tmp_path / 'out'}", "--no-progress", "--no-report"]) == 0
    (build_dir,) = (tmp_path / "out").iterdir()
    assert decoded(str(build_dir)) == [("2 + 3?\n\n5", "5")]


@pytest.mark.parametrize("form", ["file://localhost{}", "file:{}"])
def test_every_local_file_url_form_names_the_same_path(tmp_path, capsys, monkeypatch, form):
    """RFC 8089's ``file://localhost/ABS`` and ``file:/ABS`` write to ``/ABS``, not under the working directory."""
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "2 + 3?", "answer": "5"}])
    args = ["--dataset", form.format(data), "--out", form.format(tmp_path / "out"), "--no-progress", "--no-report"]
    assert main(args) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "q.jsonl"]
    (build_dir,) = (tmp_path / "out").iterdir()
    assert decoded(str(build_dir)) == [("2 + 3?\n\n5", "5")]


@pytest.mark.parametrize("option", ["--dataset", "--out"])
@pytest.mark.parametrize("url", ["file://rel/out", "file://otherhost/abs", "file:rel"])
def test_a_file_url_of_another_host_or_a_relative_path_is_one_line(tmp_path, capsys, monkeypatch, option, url):
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "2 + 3?", "answer": "5"}])
    args = {"--dataset": str(data), "--out": str(tmp_path / "out"), option: url}
    assert main([arg for pair in args.items() for arg in pair]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"varpack: error: {url}: not a local file URL; write file:///ABS/PATH (or file://localhost/ABS/PATH), or the path itself"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["q.jsonl"]


# --- truncation that keeps the response -------------------------------------------------------


def test_truncate_side_left_cuts_the_prompts_head_and_keeps_the_response(tmp_path, capsys):
    long_prompt = " ".join(f"word{i}" for i in range(200))
    rows = [{"question": long_prompt, "answer": "The answer is 5."}, {"question": "Hi", "answer": "Hello"}]
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    build_dir, _ = pack(tmp_path, capsys, "--dataset", str(data), "--max-len", "64", "--overflow", "truncate", "--truncate-side", "left")
    examples = read_examples(build_dir)
    (long_tokens, long_mask), (short_tokens, _) = examples[0], examples[1]
    backend = load_tokenizer().backend()
    whole = backend.encode(f"{long_prompt}\n\nThe answer is 5.", add_special_tokens=False).ids
    assert long_tokens.tolist() == [1, *whole[len(whole) + 2 - 64 :], 2]
    assert backend.decode(long_tokens[long_mask == 1].tolist()) == "The answer is 5."
    assert decoded(build_dir)[1] == ("Hi\n\nHello", "Hello") and len(short_tokens) < 64
    stats = read_manifest(build_dir).stats
    assert (stats.examples_truncated, stats.tokens_truncated) == (1, len(whole) + 2 - 64)


def test_truncation_that_leaves_nothing_to_train_says_so_naming_max_len(tmp_path, capsys):
    """Examples read and all dropped as untrained under --overflow truncate: the line says so, not "no examples"."""
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "hi there", "response": "ok"}, {"prompt": "hello you", "response": "fine"}])
    assert main(["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-len", "3", "--overflow", "truncate", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "varpack: error: nothing to train: every example read (2) was dropped as untrained: --overflow truncate keeps its "
        "first --max-len 3 tokens, none of them trained; raise --max-len or pass --overflow split"
    )
    assert not list((tmp_path / "out").iterdir())


def test_truncate_side_left_goes_with_overflow_truncate(tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    assert main(["--dataset", str(data), "--out", str(tmp_path / "out"), "--truncate-side", "left"]) == 1
    assert "--truncate-side left cuts the prompt's head" in capsys.readouterr().err


@pytest.mark.parametrize("template", ["QQQ: {prompt} AAA: {response}", "{question}\\n{answer}"])
def test_a_prompt_template_is_refused_with_as_chat(tmp_path, capsys, template):
    """The chat template renders --as-chat examples, so a --prompt-template would be silently left out: it is refused."""
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "response": "ok", "question": "q", "answer": "a"}])
    args = ["--dataset", str(data), "--as-chat", "--prompt-template", template, "--out", str(tmp_path / "out")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("varpack: error: --prompt-template does not go with --as-chat") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_system_prompt_is_a_system_turn_under_as_chat(tmp_path, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "2 + 3?", "answer": "5"}])
    build_dir, _ = pack(
        tmp_path, capsys, "--dataset", str(data), "--as-chat", "--system-prompt", "Be brief.", "--chat-template", "chatml",
        "--special-tokens", "<|im_start|>,<|im_end|>",
    )
    ((tokens, mask),) = read_examples(build_dir).values()
    tokenizer = load_tokenizer(special_tokens=("<|im_start|>", "<|im_end|>"))
    text = tokenizer.backend().decode(tokens.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>")
    assert tokenizer.backend().decode(tokens[mask == 1].tolist(), skip_special_tokens=False).strip() == "5<|im_end|>"
