"""How source rows become training examples: prompt/response pairs, chat messages or plain text.

The format names the source columns it reads and says, in ``template`` and ``loss_masking``,
how tokens and loss masks are made from them; both strings go into the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.config import PackConfig
from pipeline.errors import ConfigError, InputError
from pipeline.read.readers import MESSAGES_TYPE, TEXT_TYPE, read_schema
from schemas import ExampleKind, LossMasking

# How a prompt and its response are joined into one example, unless --prompt-template says otherwise.
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n\n{response}"


def split_prompt_template(template: str) -> tuple[str, str, str]:
    """The text before ``{prompt}``, between it and ``{response}``, and after ``{response}``.

    ``\\n`` and ``\\t`` written literally (as shells pass ``'{prompt}\\n{response}'``) mean a newline and a tab.

    >>> split_prompt_template("Q: {prompt}\\nA: {response}")
    ('Q: ', '\nA: ', '')
    """
    text = template.replace("\\n", "\n").replace("\\t", "\t")
    if text.count("{prompt}") != 1 or text.count("{response}") != 1 or text.index("{prompt}") > text.index("{response}"):
        raise ConfigError(
            f"--prompt-template {template!r} must hold {{prompt}} once, then {{response}} once, "
            "e.g. '{prompt}\\n\\n{response}'"
        )
    before, rest = text.split("{prompt}")
    between, after = rest.split("{response}")
    return before, between, after

# Tried in order when no column option is given.
_AUTODETECT = (
    (ExampleKind.PROMPT_RESPONSE, ("prompt", "response")),
    (ExampleKind.PROMPT_RESPONSE, ("question", "answer")),
    (ExampleKind.PROMPT_RESPONSE, ("inputs", "targets")),
    (ExampleKind.PROMPT_RESPONSE, ("instruction", "output")),
    (ExampleKind.CHAT, ("messages",)),
    (ExampleKind.CHAT, ("conversations",)),
    (ExampleKind.TEXT, ("text",)),
)


@dataclass(frozen=True)
class ExampleFormat:
    """A kind of example and the source columns it reads (prompt and response, messages, or text)."""

    kind: ExampleKind
    columns: tuple[str, ...]
    train_on_prompt: bool = False
    chat_template: str | None = None
    # Prompt/response only: how they are joined, or rendered as a user/assistant chat instead.
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    as_chat: bool = False
    # Chat only: drop assistant turns before the first user turn and user turns after the last assistant turn
    # (True), refuse them (False), or drop them in ShareGPT data only (None; see encode/chat.py).
    drop_dangling_turns: bool | None = None

    @property
    def is_chat(self) -> bool:
        """Whether examples are rendered with the chat template (chat data, or prompt/response ``--as-chat``)."""
        return self.kind == ExampleKind.CHAT or self.as_chat

    @property
    def column_types(self) -> dict[str, pa.DataType]:
        """The Arrow type each top-level source column is read as (a struct for a dotted ``data.question``)."""
        return read_schema(self.columns, MESSAGES_TYPE if self.kind == ExampleKind.CHAT else TEXT_TYPE)

    @property
    def template(self) -> str:
        """How the tokens are laid out, for the fingerprint (the chat template in full for chat data)."""
        if self.kind == ExampleKind.PROMPT_RESPONSE and self.as_chat:
            prompt, response = self.columns
            return (
                f"varpack.prompt_response_chat.v2 user={prompt} assistant={response}: the chat template below, "
                f"tokenized whole, ending with the end-of-turn token\n{self.chat_template}"
            )
        if self.kind == ExampleKind.PROMPT_RESPONSE:
            prompt, response = self.columns
            return (
                f"varpack.prompt_response.v2 prompt={prompt} response={response}: "
                f"[bos] prompt response [eos] joined as {self.prompt_template!r}"
            )
        if self.kind == ExampleKind.CHAT:
            dropped = {True: " without dangling turns", None: " without dangling ShareGPT turns"}.get(self.drop_dangling_turns, "")
            return (
                f"varpack.chat.v2 messages={self.columns[0]}{dropped}: the chat template below, tokenized whole, ending "
                f"with the last end-of-turn token\n{self.chat_template}"
            )
        return f"varpack.text.v1 text={self.columns[0]}: [bos] text [eos]"

    @property
    def loss_masking(self) -> LossMasking:
        """Which tokens are trained on, for the fingerprint."""
        if self.kind == ExampleKind.TEXT or self.train_on_prompt:
            return LossMasking.ALL_TOKENS
        return LossMasking.ASSISTANT_TURNS if self.is_chat else LossMasking.RESPONSE_AND_EOS

    def describe(self) -> str:
        """The layout of one example, for the report."""
        if self.is_chat:
            source = "messages" if self.kind == ExampleKind.CHAT else "prompt as user, response as assistant"
            source += {True: ", dangling turns dropped", None: ", dangling ShareGPT turns dropped"}.get(
                self.drop_dangling_turns, ""
            )
            return f"chat template ({source}); loss on {'every token' if self.train_on_prompt else 'assistant turns'}"
        if self.kind == ExampleKind.TEXT:
            return "[bos] text [eos]; loss on every token"
        shown = self.prompt_template.replace("\n", "\\n").replace("\t", "\\t")
        return f"[bos] {shown} [eos]; loss on {'every token' if self.train_on_prompt else 'response and EOS'}"


def resolve_format(
    config: PackConfig,
    available: tuple[str, ...] | None,
    where: str,
    default: ExampleFormat | None = None,
    chat_template: str | None = None,
) -> ExampleFormat:
    """The example format from the column options, else ``default``, else the first known column names.

    ``available`` lists the source's columns (None when unknown); a missing column raises
    InputError naming ``where`` and the columns that exist.
    """
    if config.prompt_column is not None:
        chosen = ExampleFormat(ExampleKind.PROMPT_RESPONSE, (config.prompt_column, config.response_column))
    elif config.messages_column is not None:
        chosen = ExampleFormat(ExampleKind.CHAT, (config.messages_column,))
    elif config.text_column is not None:
        chosen = ExampleFormat(ExampleKind.TEXT, (config.text_column,))
    elif default is not None:
        chosen = default
    elif available is not None:
        found = next((ExampleFormat(kind, cols) for kind, cols in _AUTODETECT if set(cols) <= set(available)), None)
        if found is None:
            raise InputError(
                f"{where}: cannot tell which columns to use (columns: {', '.join(available) or 'none'}); "
                "pass --prompt-column and --response-column, --messages-column or --text-column"
            )
        chosen = found
    else:
        raise InputError(f"{where}: pass --prompt-column and --response-column, --messages-column or --text-column")
    if available is not None:
        missing = [c for c in chosen.columns if c not in available and c.split(".")[0] not in available]
        if missing:
            raise InputError(
                f"{where}: no column {missing[0]!r} (columns: {', '.join(available) or 'none'}); "
                "choose columns with --prompt-column/--response-column, --messages-column or --text-column"
            )
    as_chat = config.as_chat and chosen.kind == ExampleKind.PROMPT_RESPONSE
    if config.as_chat and not as_chat:
        raise ConfigError(f"--as-chat renders prompt/response data as a chat; {where} is {chosen.kind} data")
    if config.drop_dangling_turns and chosen.kind != ExampleKind.CHAT:
        raise ConfigError(f"--drop-dangling-turns drops turns of chat data; {where} is {chosen.kind} data")
    if (chosen.kind == ExampleKind.CHAT or as_chat) and not chat_template:
        raise InputError(
            f"{where}: {'--as-chat' if as_chat else 'chat data'} needs a chat template and the tokenizer has none; "
            "pass --chat-template (chatml, llama3, mistral, gemma, a Jinja template, or a file holding one)"
        )
    template = config.prompt_template or chosen.prompt_template
    split_prompt_template(template)
    return ExampleFormat(
        chosen.kind,
        chosen.columns,
        train_on_prompt=config.train_on_prompt,
        chat_template=chat_template if chosen.kind == ExampleKind.CHAT or as_chat else None,
        prompt_template=template,
        as_chat=as_chat,
        drop_dangling_turns=config.drop_dangling_turns,
    )
