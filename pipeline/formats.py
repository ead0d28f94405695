"""How source rows become training examples: prompt/response pairs, chat messages or plain text.

The format names the source columns it reads and says, in ``template`` and ``loss_masking``,
how tokens and loss masks are made from them; both strings go into the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.config import PackConfig
from pipeline.errors import InputError
from pipeline.readers import MESSAGES_TYPE, TEXT_TYPE

PROMPT_RESPONSE = "prompt_response"
CHAT = "chat"
TEXT = "text"

# Tried in order when no column option is given.
_AUTODETECT = (
    (PROMPT_RESPONSE, ("prompt", "response")),
    (PROMPT_RESPONSE, ("question", "answer")),
    (PROMPT_RESPONSE, ("inputs", "targets")),
    (PROMPT_RESPONSE, ("instruction", "output")),
    (CHAT, ("messages",)),
    (TEXT, ("text",)),
)


@dataclass(frozen=True)
class ExampleFormat:
    """A kind of example and the source columns it reads (prompt and response, messages, or text)."""

    kind: str
    columns: tuple[str, ...]
    train_on_prompt: bool = False
    chat_template: str | None = None

    @property
    def column_types(self) -> dict[str, pa.DataType]:
        """The Arrow type each source column is read as."""
        kind = MESSAGES_TYPE if self.kind == CHAT else TEXT_TYPE
        return {name: kind for name in self.columns}

    @property
    def template(self) -> str:
        """How the tokens are laid out, for the fingerprint (the chat template in full for chat data)."""
        if self.kind == PROMPT_RESPONSE:
            prompt, response = self.columns
            return f"varpack.prompt_response.v1 prompt={prompt} response={response}: [bos] prompt response [eos]"
        if self.kind == CHAT:
            return f"varpack.chat.v1 messages={self.columns[0]}: the chat template below, tokenized whole\n{self.chat_template}"
        return f"varpack.text.v1 text={self.columns[0]}: [bos] text [eos]"

    @property
    def loss_masking(self) -> str:
        """Which tokens are trained on, for the fingerprint."""
        if self.kind == TEXT:
            return "all_tokens"
        if self.train_on_prompt:
            return "all_tokens"
        return "response_and_eos" if self.kind == PROMPT_RESPONSE else "assistant_turns"


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
        chosen = ExampleFormat(PROMPT_RESPONSE, (config.prompt_column, config.response_column))
    elif config.messages_column is not None:
        chosen = ExampleFormat(CHAT, (config.messages_column,))
    elif config.text_column is not None:
        chosen = ExampleFormat(TEXT, (config.text_column,))
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
        missing = [c for c in chosen.columns if c not in available]
        if missing:
            raise InputError(
                f"{where}: no column {missing[0]!r} (columns: {', '.join(available) or 'none'}); "
                "choose columns with --prompt-column/--response-column, --messages-column or --text-column"
            )
    if chosen.kind == CHAT and not chat_template:
        raise InputError(
            f"{where}: chat data needs a chat template and the tokenizer has none; "
            "pass --chat-template (a Jinja template, or a file holding one)"
        )
    return ExampleFormat(
        chosen.kind,
        chosen.columns,
        train_on_prompt=config.train_on_prompt,
        chat_template=chat_template if chosen.kind == CHAT else None,
    )
