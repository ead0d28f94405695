"""Example kinds: each kind keeps the layout its builds' fingerprints were made with, and packs the text it renders."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.encode.examples import Encoder
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.read.formats import ExampleFormat
from pipeline.read.kinds import ENCODING_RULES, ChatMessages, PlainText, PromptResponse, PromptResponseAsChat
from pipeline.read.readers import BatchRows
from schemas import ExampleKind, LossMasking

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
PR, MESSAGES, TEXT = ExampleKind.PROMPT_RESPONSE, ExampleKind.CHAT, ExampleKind.TEXT


@pytest.mark.parametrize(
    ("example_format", "kind", "template", "loss_masking"),
    [
        (
            ExampleFormat(PR, ("question", "answer")), PromptResponse,
            "varpack.prompt_response.v3 columns=question,answer: [bos] text [eos], the text rendered with "
            "'{prompt}\\n\\n{response}' and tokenized whole",
            LossMasking.RESPONSE_AND_EOS,
        ),
        (
            ExampleFormat(PR, ("instruction", "input", "output"), True, prompt_template="alpaca", system_prompt="S",
                          keep_response=True),
            PromptResponse,
            "varpack.prompt_response.v3 columns=instruction,input,output system='S': [bos] text [eos], the text rendered "
            "with 'alpaca' and tokenized whole, the prompt's head cut to fit --max-len",
            LossMasking.ALL_TOKENS,
        ),
        (
            ExampleFormat(PR, ("prompt", "response"), chat_template=CHAT, as_chat=True, system_prompt="S"),
            PromptResponseAsChat,
            f"varpack.prompt_response_chat.v2 user=prompt assistant=response system='S': the chat template below, "
            f"tokenized whole, ending with the end-of-turn token\n{CHAT}",
            LossMasking.ASSISTANT_TURNS,
        ),
        (
            ExampleFormat(MESSAGES, ("conversations",), chat_template=CHAT), ChatMessages,
            f"varpack.chat.v2 messages=conversations without dangling ShareGPT turns: the chat template below, tokenized "
            f"whole, ending with the last end-of-turn token\n{CHAT}",
            LossMasking.ASSISTANT_TURNS,
        ),
        (
            ExampleFormat(MESSAGES, ("messages",), True, CHAT, drop_dangling_turns=True), ChatMessages,
            f"varpack.chat.v2 messages=messages without dangling turns: the chat template below, tokenized whole, ending "
            f"with the last end-of-turn token\n{CHAT}",
            LossMasking.ALL_TOKENS,
        ),
        (
            ExampleFormat(MESSAGES, ("messages",), chat_template=CHAT, drop_dangling_turns=False), ChatMessages,
            f"varpack.chat.v2 messages=messages: the chat template below, tokenized whole, ending with the last "
            f"end-of-turn token\n{CHAT}",
            LossMasking.ASSISTANT_TURNS,
        ),
        (ExampleFormat(TEXT, ("body",)), PlainText, "varpack.text.v1 text=body: [bos] text [eos]", LossMasking.ALL_TOKENS),
    ],
)
def test_each_kind_keeps_the_layout_its_fingerprints_were_made_with(example_format, kind, template, loss_masking):
    """The template string and loss masking go into every build's fingerprint: changing one silently rebuilds everything."""
    assert type(example_format.example_kind) is kind
    assert (example_format.template, example_format.loss_masking) == (f"varpack.encoding_rules.v{ENCODING_RULES} {template}", loss_masking)


@pytest.mark.parametrize(
    ("example_format", "table"),
    [
        (
            ExampleFormat(PR, ("instruction", "input", "output"), prompt_template="alpaca", system_prompt="Be exact."),
            pa.table({"instruction": ["Add.", "Say hi."], "input": ["2 and 3", None], "output": ["5", "Hi"]}),
        ),
        (ExampleFormat(TEXT, ("text",)), pa.table({"text": ["One document.", "Another, longer document."]})),
    ],
)
def test_a_text_kind_packs_its_rendered_text_tokenized_whole(example_format, table):
    """``render_text`` is what the build tokenizes: each example is BOS, the whole text's tokens, EOS, trained from
    the response's first token (the first token of plain text)."""
    tokenizer = load_tokenizer("mistral-7b-v0.1")
    backend = tokenizer.backend()
    texts, trained_from = example_format.example_kind.render_text(table)
    batch = Encoder(tokenizer, example_format, 4096, "split").encode(table, BatchRows("t"))
    for i, text in enumerate(texts):
        encoding = backend.encode(text, add_special_tokens=False)
        start, length = int(batch.starts[i]), int(batch.lengths[i])
        tokens, mask = batch.tokens[start : start + length], batch.loss_mask[start : start + length]
        assert tokens.tolist() == [*tokenizer.prefix_ids, *encoding.ids, *tokenizer.suffix_ids]
        first_trained = len(tokenizer.prefix_ids) + (encoding.char_to_token(int(trained_from[i])) if trained_from[i] else 0)
        assert mask.tolist() == [0] * first_trained + [1] * (length - first_trained)
    assert np.count_nonzero(trained_from) == (len(texts) if example_format.kind == PR else 0)
