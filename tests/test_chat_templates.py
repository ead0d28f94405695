"""Chat builds end every assistant turn with a real special token: a template whose markers are not
special tokens of the tokenizer, or whose turns end in text, is refused before any data is read;
the manifest and the report name the token turns actually end with; named templates
(``--chat-template chatml|llama3|mistral|gemma``) work with tokenizers that have their tokens."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.build import build
from pipeline.chat_templates import CHAT_TEMPLATES
from pipeline.config import PackConfig
from pipeline.errors import ConfigError
from pipeline.pack import main
from pipeline.tokenizer import load_tokenizer
from tests.test_pipeline_e2e import read_examples

CHATS = [
    [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}]
    + ([{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"{4 * i}"}] if i % 2 else [])
    for i in range(10)
]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARPACK_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return path


def byte_level_directory(path: Path, specials: list[str], config: dict | None = None) -> Path:
    """A byte-level BPE tokenizer trained on the chats, with ``specials`` and an optional tokenizer_config.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [turn["content"] for chat in CHATS for turn in chat]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True)
    tokenizer.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def tiktoken_ranks_file(path: Path) -> Path:
    """A tiktoken ranks file: every byte and a few merges, no special tokens (as such files ship)."""
    ranks = {bytes([b]): b for b in range(256)}
    for merge in [b"Wh", b"at", b" is", b" plus", b"It"]:
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return path


def pack_chats(tmp_path: Path, chats: Path, **options):
    return build(PackConfig(dataset=str(chats), out=str(tmp_path / "out"), max_len=256, progress=False, **options))


def test_template_markers_that_are_not_special_tokens_are_refused(tmp_path, chats, capsys):
    ranks = tiktoken_ranks_file(tmp_path / "tiny.tiktoken")
    args = ["--dataset", str(chats), "--out", str(tmp_path / "out"), "--tokenizer", str(ranks), "--no-progress"]
    assert main([*args, "--chat-template", CHAT_TEMPLATES["chatml"]]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("varpack: error: ")
    assert "writes '<|im_start|>', which is not a special token of the tokenizer (it would be packed as" in error
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n")
    with pytest.raises(ConfigError, match="writes '<|im_start|>'"):
        build(PackConfig(dataset=str(prompts), out=str(tmp_path / "out"), tokenizer=str(ranks), as_chat=True,
                         chat_template=CHAT_TEMPLATES["chatml"], progress=False))


def test_turns_that_end_in_text_are_refused(tmp_path, chats):
    directory = byte_level_directory(tmp_path / "tok", ["<|endoftext|>"])
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"assistant turns end with .*, not with a special token of the tokenizer"):
        pack_chats(tmp_path, chats, tokenizer=str(directory), chat_template=plain)


def test_llama3_builds_record_the_end_of_turn_token_they_use(tmp_path, chats, capsys):
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    directory = byte_level_directory(tmp_path / "llama3", LLAMA3_SPECIALS, config)
    tokenizer = load_tokenizer(str(directory))
    eot, eos = tokenizer.token_id("<|eot_id|>"), tokenizer.token_id("<|end_of_text|>")
    assert tokenizer.eos_token_id == eos != eot
    args = ["--dataset", str(chats), "--out", str(tmp_path / "out"), "--tokenizer", str(directory),
            "--chat-template", "llama3", "--max-len", "256", "--no-progress"]
    assert main(args) == 0
    assert f"turns end with <|eot_id|> ({eot})" in capsys.readouterr().out
    (out_dir,) = (tmp_path / "out").iterdir()
    examples = read_examples(out_dir)
    assert len(examples) == len(CHATS) and all(tokens[-1] == eot for tokens, _ in examples.values())
    assert all(eos not in tokens for tokens, _ in examples.values())
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["inputs"]["tokenizer"]["eos_token_id"] == eot
