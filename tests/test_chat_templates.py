"""Chat builds end every assistant turn with a real special token: a template whose markers are not
special tokens of the tokenizer, or whose turns end in text, is refused before any data is read;
the manifest and the report name the token turns actually end with; named templates
(``--chat-template chatml|llama3|mistral|gemma``) work with tokenizers that have their tokens."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.build import build
from pipeline.encode.chat_templates import CHAT_TEMPLATES
from pipeline.config import PackConfig
from pipeline.errors import ConfigError, InputError
from pipeline.pack import main
from pipeline.encode.tokenizer import load_tokenizer
from schemas import read_manifest
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


def test_tiktoken_with_added_special_tokens_and_a_named_template_ends_every_example_with_its_end_token(
    tmp_path, chats, capsys
):
    ranks = tiktoken_ranks_file(tmp_path / "tiny.tiktoken")
    args = ["--dataset", str(chats), "--out", str(tmp_path / "out"), "--tokenizer", str(ranks), "--chat-template", "chatml",
            "--special-tokens", "<|endoftext|>,<|im_start|>,<|im_end|>", "--max-len", "256", "--no-progress"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "holds no split pattern, so cl100k_base's is a guess" in captured.err
    tokenizer = load_tokenizer(str(ranks), special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    im_start, im_end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
    assert (im_start, im_end) == (262, 263)  # after the 261 ranks and <|endoftext|>
    assert f"turns end with <|im_end|> ({im_end})" in captured.out
    (out_dir,) = (tmp_path / "out").iterdir()
    examples = read_examples(out_dir)
    assert sorted(examples) == list(range(len(CHATS)))
    backend = tokenizer.backend()
    for i, (tokens, mask) in examples.items():
        assert tokens[-1] == im_end and mask[-1] == 1
        turns = sum(1 for turn in CHATS[i] if turn["role"] == "assistant")
        assert list(tokens).count(im_start) == 2 * turns and list(tokens).count(im_end) == 2 * turns
        trained = backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
        assert trained == "".join(turn["content"] + "<|im_end|>" for turn in CHATS[i] if turn["role"] == "assistant")


def test_a_json_beside_the_ranks_file_gives_the_split_pattern_and_the_special_tokens_ids(tmp_path):
    """Tokens and ids as tiktoken itself encodes with the same ranks, pattern and special tokens."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = tiktoken_ranks_file(tmp_path / "tiny.tiktoken")
    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    specials = {"<|endoftext|>": 300, "<|im_start|>": 301, "<|im_end|>": 302}
    (tmp_path / "tiny.tiktoken.json").write_text(json.dumps({"pat_str": pattern, "special_tokens": specials}))
    reference = tiktoken.Encoding("tiny", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(str(ranks)),
                                  special_tokens=specials)
    tokenizer = load_tokenizer(str(ranks))
    assert tokenizer.notes == () and tokenizer.eos_token == "<|endoftext|>"
    text = "<|im_start|>user\nWhat is 12345 plus 678?<|im_end|>\n<|im_start|>assistant\nIt is 13023.<|im_end|>"
    assert tokenizer.backend().encode(text, add_special_tokens=False).ids == reference.encode(text, allowed_special="all")
    assert tokenizer.token_id("<|im_end|>") == 302 and tokenizer.backend().id_to_token(270) == "<|unused_270|>"
    (tmp_path / "tiny.tiktoken.json").write_text(json.dumps({"special_tokens": {"<|endoftext|>": 3}}))
    with pytest.raises(InputError, match="special token '<|endoftext|>' has id 3, which an earlier token holds"):
        load_tokenizer(str(ranks))


def test_tiktokens_possessive_patterns_split_as_tiktoken_does(tmp_path):
    """cl100k_base's and o200k_base's patterns (possessive quantifiers) given beside a ranks file split text
    as tiktoken does; tiktoken's own ranks files are known by content, with their special tokens."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from pipeline.encode.tokenizer import tiktoken_encodings

    known = {encoding.special_tokens[0]: encoding for encoding in tiktoken_encodings().values()}
    assert ("<|endoftext|>", 100257) in known and ("<|endoftext|>", 199999) in known
    ranks = tiktoken_ranks_file(tmp_path / "tiny.tiktoken")
    texts = ["What is 1234567 plus 89?  It's 1234656.\n\n", "  two  spaces\ttab\r\nCRLF  \n", "Hindi हिन्दी, Khmer ខ្មែរ!"]
    for encoding in (known[("<|endoftext|>", 100257)], known[("<|endoftext|>", 199999)]):
        (tmp_path / "tiny.tiktoken.json").write_text(json.dumps({"pat_str": encoding.pat_str}))
        reference = tiktoken.Encoding("tiny", pat_str=encoding.pat_str, mergeable_ranks=load_tiktoken_bpe(str(ranks)),
                                      special_tokens={})
        backend = load_tokenizer(str(ranks)).backend()
        for text in texts:
            assert backend.encode(text, add_special_tokens=False).ids == reference.encode(text), text


# Gemma 3's own chat template, its text-only part: a system turn goes into the first user turn.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"""
# Phi-3-mini's chat template as its GGUF files carry it: no system branch, so system turns vanish.
PHI3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}"
)
SYSTEM_CHATS = [[{"role": "system", "content": f"Answer as number {i}."}, *chat] for i, chat in enumerate(CHATS[:4])]


def reference_tokens(directory: Path, messages: list[dict], template: str) -> list[int]:
    """The tokens of transformers' own ``apply_chat_template(messages, tokenize=True)`` with the tokenizer in ``directory``."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **config)
    ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def assert_tokens_as_transformers(directory: Path, tokens, messages: list[dict], template: str) -> None:
    """``tokens`` are transformers' tokens of the chat up to its last end-of-turn token (an example ends there)."""
    reference = reference_tokens(directory, messages, template)
    assert list(tokens) == reference[: len(tokens)]
    backend = load_tokenizer(str(directory)).backend()
    assert not backend.decode(reference[len(tokens):], skip_special_tokens=False).strip()


def write_chats(path: Path, chats: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return path


def test_gemma_merges_a_system_turn_into_the_first_user_turn_as_gemmas_own_template_does(tmp_path, capsys):
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    directory = byte_level_directory(tmp_path / "gemma", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], config)
    path = write_chats(tmp_path / "system.jsonl", SYSTEM_CHATS)
    args = ["--dataset", str(path), "--out", str(tmp_path / "out"), "--tokenizer", str(directory), "--chat-template", "gemma",
            "--max-len", "256", "--no-progress"]
    assert main(args) == 0
    assert "turns         4 system, 6 user, 6 assistant\n" in capsys.readouterr().out
    (out_dir,) = (tmp_path / "out").iterdir()
    examples = read_examples(out_dir)
    backend = load_tokenizer(str(directory)).backend()
    for i, chat in enumerate(SYSTEM_CHATS):
        tokens, mask = examples[i]
        assert_tokens_as_transformers(directory, tokens, chat, GEMMA3_TEMPLATE)
        text = backend.decode(tokens.tolist(), skip_special_tokens=False)
        assert text.startswith(f"<bos><start_of_turn>user\nAnswer as number {i}.\n\n{chat[1]['content']}<end_of_turn>")
        trained = backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
        assert trained == "".join(turn["content"] + "<end_of_turn>" for turn in chat if turn["role"] == "assistant")


PHI3_SPECIALS = ["<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]


def test_a_template_that_drops_system_turns_gets_them_merged_into_the_first_user_turn(tmp_path, capsys):
    """Phi-3's GGUF template writes no system turn: the system prompt goes into the first user turn, and the report says so."""
    directory = byte_level_directory(tmp_path / "phi3", PHI3_SPECIALS, {"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    path = write_chats(tmp_path / "system.jsonl", SYSTEM_CHATS)
    args = ["--dataset", str(path), "--out", str(tmp_path / "out"), "--tokenizer", str(directory), "--chat-template",
            PHI3_TEMPLATE, "--max-len", "256", "--no-progress"]
    assert main(args) == 0
    assert "turns         4 system (merged into the first user turn), 6 user, 6 assistant\n" in capsys.readouterr().out
    (out_dir,) = (tmp_path / "out").iterdir()
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["stats"]["chat_turns"] == {
        "system": {"read": 4, "used": 4, "merged": 4}, "user": {"read": 6, "used": 6}, "assistant": {"read": 6, "used": 6}
    }
    examples = read_examples(out_dir)
    backend = load_tokenizer(str(directory)).backend()
    for i, (system, user, *rest) in enumerate(SYSTEM_CHATS):
        merged = [{"role": "user", "content": f"{system['content']}\n\n{user['content']}"}, *rest]
        tokens, mask = examples[i]
        assert_tokens_as_transformers(directory, tokens, merged, PHI3_TEMPLATE)
        trained = backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
        assert trained == "".join(turn["content"] + "<|end|>" for turn in rest if turn["role"] == "assistant")


def test_a_role_the_template_leaves_out_is_a_warning_line_and_under_strict_an_error(tmp_path, capsys):
    """Phi-3's template writes no tool turns either: counted, warned about in one line, and refused under --strict."""
    directory = byte_level_directory(tmp_path / "phi3", PHI3_SPECIALS, {"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    tool_chats = [
        [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "Let me add."},
         {"role": "tool", "content": "{\"sum\": 4}"}, {"role": "assistant", "content": "It is 4."}],
        CHATS[0],
    ]
    path = write_chats(tmp_path / "tools.jsonl", tool_chats)
    args = ["--dataset", str(path), "--tokenizer", str(directory), "--chat-template", PHI3_TEMPLATE, "--max-len", "256",
            "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == ["varpack: warning: 1 tool turn of 1 read left out of the tokens: the chat template leaves tool "
                        "turns out; use a template that writes them (--chat-template), or pass --strict to stop on this"]
    assert "turns         2 user, 3 assistant, 0 of 1 tool\n" in captured.out
    (out_dir,) = (tmp_path / "out").iterdir()
    for i, chat in enumerate(tool_chats):
        assert_tokens_as_transformers(directory, read_examples(out_dir)[i][0], chat, PHI3_TEMPLATE)
    assert main([*args, "--out", str(tmp_path / "strict"), "--strict"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"varpack: error: {path} line 1: the chat template left out a tool turn (its content is not in the "
                     "rendered text); use a template that writes such turns, or leave out --strict to count them")
    assert not list((tmp_path / "strict").rglob("*.*"))
    # --strict is no fingerprint setting: the build made without it is reused, and its recorded turns stop the run.
    assert main([*args, "--out", str(tmp_path / "out"), "--strict"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("varpack: error: 1 tool turn of 1 read left out of the tokens: the chat template leaves tool turns "
                     "out; use a template that writes them (--chat-template), or pass --strict to stop on this (--strict; "
                     "the build was reused)")


def test_a_left_out_turn_whose_text_occurs_elsewhere_is_still_left_out(tmp_path, capsys):
    """Phi-3 drops the tool turn "4"; that "4" also occurs in "It is 4." does not make it count as written."""
    directory = byte_level_directory(tmp_path / "phi3", PHI3_SPECIALS, {"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    chat = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "Let me add."},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    path = write_chats(tmp_path / "tools.jsonl", [chat])
    args = ["--dataset", str(path), "--tokenizer", str(directory), "--chat-template", PHI3_TEMPLATE, "--max-len", "256",
            "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert "turns         1 user, 2 assistant, 0 of 1 tool\n" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert "the chat template left out a tool turn" in capsys.readouterr().err


# Llama 3.1's own template, its tool parts: tool output through `| tojson`, one tool call as JSON.
LLAMA31_TOOLS_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""


def test_a_tool_turn_the_template_writes_through_a_filter_counts_as_used(tmp_path, capsys):
    """Llama 3.1 writes a tool's output with `| tojson` ({"sum": 4} as "{\\"sum\\": 4}"): in the tokens, so used,
    no warning, and --strict builds."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    directory = byte_level_directory(tmp_path / "llama31", LLAMA3_SPECIALS, config)
    turns = [("human", "What is 2 plus 2?"), ("function_call", json.dumps({"name": "add", "arguments": {"a": 2, "b": 2}})),
             ("observation", '{"sum": 4}'), ("gpt", "It is 4.")]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]}) + "\n")
    args = ["--dataset", str(path), "--tokenizer", str(directory), "--chat-template", LLAMA31_TOOLS_TEMPLATE,
            "--max-len", "256", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "turns         1 user, 2 assistant, 1 tool\n" in captured.out and "warning" not in captured.err
    assert main([*args, "--out", str(tmp_path / "strict"), "--strict"]) == 0


def reference_with_mask(directory: Path, messages: list[dict], template: str) -> tuple[list[int], list[int]]:
    """transformers' tokens and ``return_assistant_tokens_mask`` of ``messages`` (``template`` has generation tags)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **config)
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


TOOLS_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.mark.parametrize("arguments", ["object", "openai"])
def test_openai_tool_calls_reach_the_template_and_are_trained_as_transformers_marks_them(tmp_path, capsys, arguments):
    """{role, content} messages with tool_calls (arguments an object, or JSON text with content null as OpenAI
    writes them): the tokens are apply_chat_template's, and the loss mask is its assistant mask (the template
    with {% generation %} tags); the report counts every turn."""
    directory = byte_level_directory(tmp_path / "qwen", TOOLS_SPECIALS, {"eos_token": "<|im_end|>"})
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    messages = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "Let me add.", "tool_calls": [call]},
                {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    data = json.loads(json.dumps(messages))
    if arguments == "openai":
        data[1] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]}
        messages[1] = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", **call}]}
    path = write_chats(tmp_path / "tools.jsonl", [data])
    assert main(["--dataset", str(path), "--tokenizer", str(directory), "--chat-template", TOOLS_TEMPLATE, "--max-len",
                 "256", "--no-progress", "--out", str(tmp_path / "out")]) == 0
    assert "turns         1 user, 2 assistant, 1 tool\n" in capsys.readouterr().out
    (out_dir,) = (tmp_path / "out").iterdir()
    tokens, mask = read_examples(out_dir)[0]
    marked = TOOLS_TEMPLATE.replace("{{- '<|im_start|>assistant\n' + (message.content or '') }}",
                                    "{{- '<|im_start|>assistant\n' }}{% generation %}{{- message.content or '' }}")
    marked = marked.replace("{{- '<|im_end|>\n' }}\n    {%- elif", "{{- '<|im_end|>' }}{% endgeneration %}{{- '\n' }}\n    {%- elif")
    marked = marked.replace("{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}",
                            "{{- '<|im_start|>' + message.role + '\n' }}{% if message.role == 'assistant' %}{% generation %}"
                            "{{- message.content + '<|im_end|>' }}{% endgeneration %}{% else %}{{- message.content + "
                            "'<|im_end|>' }}{% endif %}{{- '\n' }}")
    ids, reference_mask = reference_with_mask(directory, messages, marked)
    assert ids == reference_tokens(directory, messages, TOOLS_TEMPLATE)
    assert list(tokens) == ids[: len(tokens)] and list(mask) == reference_mask[: len(tokens)]
    assert "<tool_call>" in load_tokenizer(str(directory)).backend().decode(tokens[mask == 1].tolist(), skip_special_tokens=False)


THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}{% if m.reasoning_content %}"
    "{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{% endif %}{{ m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_reasoning_content_reaches_the_template_and_a_template_without_it_is_a_warning(tmp_path, capsys):
    """reasoning_content (Qwen3's and DeepSeek-R1's traces) is written where the template writes it; a template that
    does not write it is a warning line naming the field, and under --strict an error naming the row."""
    directory = byte_level_directory(tmp_path / "think", TOOLS_SPECIALS, {"eos_token": "<|im_end|>"})
    messages = [{"role": "user", "content": "What is 2 plus 2?"},
                {"role": "assistant", "reasoning_content": "2 plus 2 is 4", "content": "It is 4."}]
    path = write_chats(tmp_path / "think.jsonl", [messages])
    args = ["--dataset", str(path), "--tokenizer", str(directory), "--max-len", "256", "--no-progress"]
    assert main([*args, "--chat-template", THINK_TEMPLATE, "--out", str(tmp_path / "out"), "--strict"]) == 0
    assert "warning" not in capsys.readouterr().err
    (out_dir,) = (tmp_path / "out").iterdir()
    tokens, mask = read_examples(out_dir)[0]
    assert_tokens_as_transformers(directory, tokens, messages, THINK_TEMPLATE)
    trained = load_tokenizer(str(directory)).backend().decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "<think>\n2 plus 2 is 4\n</think>\n\nIt is 4.<|im_end|>"
    assert main([*args, "--chat-template", "chatml", "--out", str(tmp_path / "chatml")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["varpack: warning: the chat template does not write the 'reasoning_content' of 1 assistant turn; "
                        "use a template that writes it (--chat-template), or pass --strict to stop on this"]
    assert main([*args, "--chat-template", "chatml", "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"varpack: error: {path} line 1: the chat template does not write the 'reasoning_content' of turn 2 (assistant); "
        "use a template that writes it, or leave out --strict to count it"
    )


# Qwen2.5's way of writing tool calls and tool outputs (its chat template, without the tool definitions part).
TOOLS_TEMPLATE = """{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls %}
            {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


def test_tool_calls_and_tool_turns_pass_through_a_template_that_writes_them_and_only_the_assistant_is_trained(
    tmp_path, capsys
):
    """ShareGPT function calling (function_call and observation turns) as tool_calls and tool turns: the tokens are
    transformers' apply_chat_template's, the loss covers the assistant's call and answer, not the tool's output; a
    template that writes no tool calls is refused in one line naming the row."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    directory = byte_level_directory(tmp_path / "qwen", specials, {"eos_token": "<|im_end|>"})
    turns = [("human", "What is 2 plus 3?"), ("function_call", json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})),
             ("observation", "5"), ("gpt", "It is 5.")]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]}) + "\n")
    args = ["--dataset", str(path), "--tokenizer", str(directory), "--max-len", "256", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "out"), "--chat-template", TOOLS_TEMPLATE]) == 0
    assert "turns         1 user, 2 assistant, 1 tool\n" in capsys.readouterr().out
    (out_dir,) = (tmp_path / "out").iterdir()
    tokens, mask = read_examples(out_dir)[0]
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    assert_tokens_as_transformers(directory, tokens, messages, TOOLS_TEMPLATE)
    backend = load_tokenizer(str(directory)).backend()
    assert backend.decode(tokens[mask == 1].tolist(), skip_special_tokens=False) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>It is 5.<|im_end|>'
    )
    assert main([*args, "--out", str(tmp_path / "chatml"), "--chat-template", "chatml"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"varpack: error: {path} line 1: the chat template writes no tool calls, so the call to 'add' would "
                     "vanish; use a template that writes tool calls (the model's own, e.g. Qwen2.5's or Llama 3.1's)")
    assert not list((tmp_path / "chatml").rglob("*.*"))


@pytest.mark.parametrize("answer", ['{"answer": 4}', "**Four.**", "$2+2=4$", "(four)", "[4]", "\\frac{8}{2}", "Four."])
def test_an_answer_whose_first_token_holds_the_templates_last_character_is_trained_as_transformers_marks_it(answer):
    """The default Mistral tokenizer merges "]" of "[/INST]" with an answer's first character ("]{"): that token
    holds the answer's first character, so it is trained, as apply_chat_template's assistant mask marks it."""
    from transformers import PreTrainedTokenizerFast

    from pipeline.encode.chat_templates import MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE as TEMPLATE
    from pipeline.encode.examples import Encoder
    from pipeline.read.formats import ExampleFormat
    from pipeline.read.readers import MESSAGES_TYPE, BatchRows
    from schemas import ExampleKind

    tokenizer = load_tokenizer()
    messages = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": answer}]
    encoder = Encoder(tokenizer, ExampleFormat(ExampleKind.CHAT, ("messages",), False, TEMPLATE), 256, "split")
    batch = encoder.encode(pa.table({"messages": pa.array([messages], type=MESSAGES_TYPE)}), BatchRows("t"))
    reference = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend(), bos_token="<s>", eos_token="</s>")
    marked = TEMPLATE.replace("{{ message['content'] + eos_token }}",
                              "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}")
    out = reference.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert batch.tokens.tolist() == list(out["input_ids"])
    assert batch.loss_mask.tolist() == list(out["assistant_masks"])


def test_a_long_conversation_costs_renders_of_its_kept_part_under_truncation(monkeypatch):
    """Without {% generation %} assistant turns are found by rendering prefixes; under --overflow truncate only those
    within --max-len are, so the renders per conversation do not grow with its turns (a 3,200-turn-pair row took
    two minutes when every prefix was rendered)."""
    from pipeline.encode.chat_templates import MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE as TEMPLATE
    from pipeline.encode.examples import Encoder
    from pipeline.read.formats import ExampleFormat
    from pipeline.read.readers import MESSAGES_TYPE, BatchRows
    from schemas import ExampleKind

    encoder = Encoder(load_tokenizer(), ExampleFormat(ExampleKind.CHAT, ("messages",), False, TEMPLATE), 64, "truncate")
    renders = []
    apply_template = encoder._apply_template
    def counted(messages, *args, **kwargs):
        renders.append(len(messages))
        return apply_template(messages, *args, **kwargs)

    monkeypatch.setattr(encoder, "_apply_template", counted)
    for pairs in (50, 800):
        renders.clear()
        chat = [m for i in range(pairs) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})]
        batch = encoder.encode(pa.table({"messages": pa.array([chat], type=MESSAGES_TYPE)}), BatchRows("t"))
        kept = [0, *batch.loss_mask[:64].tolist()]
        assert batch.turns["assistant.used"] == sum(b > a for a, b in zip(kept, kept[1:])) > 0  # the turns in the tokens
        assert len(renders) <= 32 and sum(renders) <= 12 * 2 * pairs


def test_special_token_text_in_chat_messages_is_counted_named_and_refused_under_strict(tmp_path, capsys):
    """A message writing ``</s>`` is tokenized with Mistral's EOS inside it: counted per conversation like a text
    column's, not for the template's own markers nor for a turn dropped before rendering."""
    rows = [
        [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
        [{"from": "gpt", "value": "cut </s>"}, {"from": "human", "value": "Strike it"}, {"from": "gpt", "value": "Use <s>old</s>."}],
        [{"role": "user", "content": "Close it"}, {"role": "assistant", "content": "With </s>, twice: </s>"}],
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    args = ["--dataset", str(data), "--max-len", "64", "--no-progress", "--no-report"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert f"'</s>' in the data text of 2 examples, tokenized as that special token (the first: {data} line 2)" in out
    assert f"warning: 2 examples (the first: {data} line 2): the data text holds '</s>'" in err
    (out_dir,) = (tmp_path / "out").iterdir()
    assert read_manifest(out_dir).stats.special_token_text == {
        "</s>": {"examples": 2, "first_row": f"{data} line 2"}, "<s>": {"examples": 1, "first_row": f"{data} line 2"}
    }
    assert main([*args, "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"varpack: error: {data} line 2: the data text holds '<s>', the text of a special token, and is tokenized as that "
        "token, not as text; remove it from the data, or leave out --strict"
    )
    assert not list((tmp_path / "strict").glob("*/manifest.json"))
