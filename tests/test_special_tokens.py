"""Every prompt/response and text example ends with an EOS the model can learn to stop on, BOS is
there only where the tokenizer uses one, and prompt and response are joined as documented.

Decoding a packed row gives back each example's text with its separators and special tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loaders.shard_reader import open_shard
from pipeline.build import build
from pipeline.config import PackConfig
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.errors import ConfigError
from pipeline.pack import main
from schemas import read_manifest

RECORDS = [
    {"prompt": f"How many remoras follow shark {i}?", "response": f"Eerste, {i} of them."} for i in range(12)
]


def byte_level_tokenizer(path: Path, specials: list[str]) -> Path:
    """A GPT-2-style byte-level BPE tokenizer trained on the records: no BOS, no post-processor, no config."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [r["prompt"] + "\n\n" + r["response"] for r in RECORDS]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def decoded_examples(out_dir: str, tokenizer) -> list[str]:
    """The text of every packed example, special tokens included, in example-id order."""
    manifest = read_manifest(out_dir)
    backend = tokenizer.backend()
    found = {}
    for info in manifest.shards:
        shard = open_shard(str(Path(out_dir) / info.path), manifest.capacity)
        for i in range(shard.num_rows):
            row = shard.row(i)
            cu = row["cu_seqlens"]
            for j, example in enumerate(row["example_ids"].tolist()):
                found[example] = backend.decode(row["input_ids"][cu[j] : cu[j + 1]].tolist(), skip_special_tokens=False)
    return [found[k] for k in sorted(found)]


def pack(tmp_path: Path, **options) -> tuple[str, object]:
    config = PackConfig(out=str(tmp_path / "out"), max_len=256, progress=False, **options)
    result = build(config)
    return result.out_dir, load_tokenizer(config.tokenizer, config.bos_token, config.eos_token)


def test_a_bare_byte_level_tokenizer_gets_its_eos_and_no_bos(tmp_path, data):
    path = byte_level_tokenizer(tmp_path / "bpe", ["<|endoftext|>"])
    tokenizer = load_tokenizer(str(path))
    assert (tokenizer.prefix_ids, tokenizer.suffix_ids) == ((), (tokenizer.backend().token_to_id("<|endoftext|>"),))
    out_dir, tokenizer = pack(tmp_path, dataset=str(data), tokenizer=str(path))
    assert decoded_examples(out_dir, tokenizer) == [f"{r['prompt']}\n\n{r['response']}<|endoftext|>" for r in RECORDS]
    assert read_manifest(out_dir).inputs.tokenizer.eos_token_id == tokenizer.suffix_ids[0]


def test_a_bare_sentencepiece_tokenizer_json_keeps_bos_and_eos(tmp_path, data):
    default = load_tokenizer()
    bare = tmp_path / "mistral" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_text(default.serialized)  # no tokenizer_config.json beside it
    out_dir, tokenizer = pack(tmp_path, dataset=str(data), tokenizer=str(bare))
    manifest = read_manifest(out_dir)
    assert (manifest.inputs.tokenizer.bos_token_id, manifest.inputs.tokenizer.eos_token_id) == (1, 2)
    # SentencePiece marks the start of the text as a word start (a space when decoded), and only the start:
    # the example is tokenized whole, not as a prompt and a response that each start a word.
    assert decoded_examples(out_dir, tokenizer) == [f"<s> {r['prompt']}\n\n{r['response']}</s>" for r in RECORDS]


def test_no_known_eos_is_refused_with_how_to_pass_one(tmp_path, data, capsys):
    path = byte_level_tokenizer(tmp_path / "bpe", ["<pad>", "<stop>"])
    args = ["--dataset", str(data), "--tokenizer", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no known EOS token" in err and "pass --eos-token TOKEN" in err
    assert not (tmp_path / "out").exists()
    assert main([*args, "--eos-token", "<end>"]) == 1
    assert "--eos-token '<end>' is not a token of tokenizer" in capsys.readouterr().err
    assert main([*args, "--eos-token", "<stop>", "--bos-token", "<pad>"]) == 0
    out_dir = next((tmp_path / "out").iterdir())
    tokenizer = load_tokenizer(str(path), "<pad>", "<stop>")
    assert decoded_examples(str(out_dir), tokenizer)[0] == f"<pad>{RECORDS[0]['prompt']}\n\n{RECORDS[0]['response']}<stop>"
    assert "BOS <pad> (0), EOS <stop> (1)" in capsys.readouterr().out


def test_bos_can_be_left_out(tmp_path, data):
    out_dir, tokenizer = pack(tmp_path, dataset=str(data), bos_token="none")
    assert decoded_examples(out_dir, tokenizer)[0] == f"{RECORDS[0]['prompt']}\n\n{RECORDS[0]['response']}</s>"


def test_prompt_template_joins_and_changes_the_fingerprint(tmp_path, data):
    path = byte_level_tokenizer(tmp_path / "bpe", ["<|endoftext|>"])
    plain_dir, _ = pack(tmp_path, dataset=str(data), tokenizer=str(path))
    out_dir, tokenizer = pack(tmp_path, dataset=str(data), tokenizer=str(path), prompt_template="Q: {prompt}\\nA: {response}")
    assert out_dir != plain_dir
    assert decoded_examples(out_dir, tokenizer) == [f"Q: {r['prompt']}\nA: {r['response']}<|endoftext|>" for r in RECORDS]
    with pytest.raises(ConfigError, match="must hold {prompt} once, then {response} once"):
        pack(tmp_path, dataset=str(data), tokenizer=str(path), prompt_template="{response} {prompt}")


def test_as_chat_renders_a_user_and_an_assistant_turn(tmp_path, data):
    out_dir, tokenizer = pack(tmp_path, dataset=str(data), as_chat=True)
    texts = decoded_examples(out_dir, tokenizer)
    assert texts == [f"<s>[INST] {r['prompt']} [/INST]{r['response']}</s>" for r in RECORDS]
    manifest = read_manifest(out_dir)
    shard = open_shard(str(Path(out_dir) / manifest.shards[0].path), manifest.capacity)
    row = shard.row(0)
    cu, backend = row["cu_seqlens"], tokenizer.backend()
    trained = backend.decode(row["input_ids"][cu[0] : cu[1]][row["loss_mask"][cu[0] : cu[1]] == 1].tolist(), skip_special_tokens=False)
    example = RECORDS[int(row["example_ids"][0])]
    assert trained.strip() == f"{example['response']}</s>"
    assert np.count_nonzero(row["loss_mask"][cu[0] : cu[1]] == 0) > 0
    with pytest.raises(ConfigError, match="--as-chat renders prompt/response data"):
        text = tmp_path / "text.jsonl"
        text.write_text(json.dumps({"text": "plain"}) + "\n")
        pack(tmp_path, dataset=str(text), as_chat=True)
    shutil.rmtree(tmp_path / "out")


def test_special_token_text_in_the_data_is_counted_and_named_in_the_report_and_manifest(tmp_path, capsys):
    """A response writing ``<s>old</s>`` (HTML strikethrough) is tokenized with Mistral's BOS and EOS inside it."""
    rows = [*RECORDS[:3], {"prompt": "Strike it in HTML", "response": "Use <s>old</s> tags."}]
    rows.append({"prompt": "And bold?", "response": "Use <b>, not </s>."})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-len", "64", "--no-progress", "--no-report"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "special text  warning: '</s>' in the data text of 2 examples, tokenized as that special token (the first: " in out
    assert f"'<s>' in the data text of 1 example, tokenized as that special token (the first: {data} line 4)" in out
    assert f"warning: 2 examples (the first: {data} line 4): the data text holds '</s>'" in err
    stats = read_manifest(plan_out(tmp_path)).stats
    assert stats.special_token_text == {
        "</s>": {"examples": 2, "first_row": f"{data} line 4"}, "<s>": {"examples": 1, "first_row": f"{data} line 4"}
    }
    assert main([*args, "--strict"]) == 1  # reused: the recorded warning is an error under --strict
    assert "the data text holds" in capsys.readouterr().err
    assert main([*args, "--strict", "--out", str(tmp_path / "strict")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"varpack: error: {data} line 4: the data text holds '<s>', the text of a special token, and is tokenized "
        "as that token, not as text; remove it from the data, or leave out --strict"
    )
    assert not list((tmp_path / "strict").glob("*/manifest.json"))


def test_a_template_naming_special_tokens_is_not_counted_as_data_text(tmp_path, data, capsys):
    template = "<s>[INST] {prompt} [/INST] {response}"
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--prompt-template", template, "--no-progress", "--no-report"]
    assert main(args) == 0
    assert "special text" not in capsys.readouterr().out
    assert read_manifest(plan_out(tmp_path)).stats.special_token_text == {}


def plan_out(tmp_path: Path) -> str:
    (out_dir,) = (tmp_path / "out").iterdir()
    return str(out_dir)


@pytest.mark.parametrize(
    ("record", "options"),
    [
        ({"instruction": "Explain", "input": "what does </s> mean", "output": "end"}, []),  # Alpaca's optional input
        ({"prompt": "Strike it", "response": "Use </s> to close"}, ["--as-chat"]),
    ],
    ids=["alpaca-input", "as-chat"],
)
def test_special_token_text_in_every_data_column_is_an_error_under_strict(tmp_path, capsys, record, options):
    """Optional columns and prompt/response rendered as a chat are data text too."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-len", "96", "--no-progress", "--no-report", *options]
    assert main([*args, "--strict"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"varpack: error: {data} line 1: the data text holds '</s>'")
    assert main(args) == 0
    assert read_manifest(plan_out(tmp_path)).stats.special_token_text == {"</s>": {"examples": 1, "first_row": f"{data} line 1"}}


DEEPSEEK_GGUF = Path(__file__).parent / "data" / "llama-cpp-vocab" / "ggml-vocab-deepseek-coder.gguf"


@pytest.mark.parametrize(
    ("record", "options"),
    [
        ({"conversations": [{"from": "human", "value": "Finish this<|EOT|> and <｜fim▁hole｜> please"},
                            {"from": "gpt", "value": "Done."}]},
         ["--chat-template", "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}"
                             "{{ eos_token }}{% endif %}\n{% endfor %}"]),
        ({"prompt": "Finish this<|EOT|> and <｜fim▁hole｜> please", "response": "Done."}, []),
    ],
    ids=["chat", "prompt-response"],
)
def test_text_of_added_control_tokens_not_flagged_special_is_counted_and_refused_under_strict(tmp_path, capsys, record, options):
    """DeepSeek-coder's GGUF holds ``<|EOT|>`` and ``<｜fim▁hole｜>`` as user-defined tokens, not flagged special
    but matched whole: data text holding them is packed as those control tokens, so it is counted and named
    like a special token's text; its added letters (``õ``) are text."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record, ensure_ascii=False) + "\n")
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--tokenizer", str(DEEPSEEK_GGUF), "--max-len", "128",
            "--no-progress", "--no-report", *options]
    assert main([*args, "--strict"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"varpack: error: {data} line 1: the data text holds '<|EOT|>', the text of a special token, and is "
        "tokenized as that token, not as text; remove it from the data, or leave out --strict"
    )
    assert not list((tmp_path / "out").glob("*/manifest.json"))
    assert main(args) == 0
    first = {"examples": 1, "first_row": f"{data} line 1"}
    assert read_manifest(plan_out(tmp_path)).stats.special_token_text == {"<｜fim▁hole｜>": first, "<|EOT|>": first}
    backend = load_tokenizer(str(DEEPSEEK_GGUF)).backend()
    assert not backend.get_added_tokens_decoder()[backend.token_to_id("<|EOT|>")].special
    assert len(backend.encode("<|EOT|>", add_special_tokens=False).ids) == 1
    (out_dir,) = (tmp_path / "out").iterdir()
    assert "õ" not in read_manifest(out_dir).stats.special_token_text
