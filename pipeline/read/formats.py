"""How source rows become training examples: prompt/response pairs, chat messages or plain text.

The format names the source columns it reads and says, in ``template`` and ``loss_masking``,
how tokens and loss masks are made from them; both strings go into the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from pipeline.config import PackConfig, TruncateSide
from pipeline.errors import ConfigError, InputError
from pipeline.read.readers import MESSAGES_TYPE, TEXT_TYPE, read_schema
from pipeline.read.templates import ALPACA, SYSTEM_FIELD, AlpacaTemplate, PromptTemplate, parse_template
from schemas import ExampleKind, LossMasking, Overflow

# How a prompt and its response are joined into one example, unless --prompt-template says otherwise.
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n\n{response}"


def split_prompt_template(template: str) -> tuple[str, str, str]:
    """The text before ``{prompt}``, between it and ``{response}``, and after ``{response}``.

    ``\\n`` and ``\\t`` written literally (as shells pass ``'{prompt}\\n{response}'``) mean a newline and a tab.

    >>> split_prompt_template("Q: {prompt}\\nA: {response}")
    ('Q: ', '\\nA: ', '')
    """
    parsed = PromptTemplate.parse(template)
    if parsed.fields != ("prompt", "response"):
        raise ConfigError(
            f"--prompt-template {template!r} must hold {{prompt}} once, then {{response}} once, "
            "e.g. '{prompt}\\n\\n{response}'"
        )
    before, between, after = parsed.pieces
    return before, between, after

# Tried in order when no column option is given.
_AUTODETECT = (
    (ExampleKind.PROMPT_RESPONSE, ("prompt", "response")),
    (ExampleKind.PROMPT_RESPONSE, ("question", "answer")),
    (ExampleKind.PROMPT_RESPONSE, ("inputs", "targets")),
    (ExampleKind.PROMPT_RESPONSE, ("instruction", "input", "output")),
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
    # Prompt/response only: how the columns are joined (their fields in the order of ``columns``), or
    # rendered as a user/assistant chat instead; the system prompt; whether the prompt's head is cut to fit.
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    as_chat: bool = False
    system_prompt: str | None = None
    keep_response: bool = False
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
    def optional_columns(self) -> tuple[str, ...]:
        """Columns that may be null or empty (Alpaca's ``input``)."""
        if self.kind == ExampleKind.PROMPT_RESPONSE and not self.as_chat and self.prompt_template == ALPACA:
            return (self.columns[1],)
        return ()

    @property
    def template(self) -> str:
        """How the tokens are laid out, for the fingerprint (the chat template in full for chat data)."""
        system = f" system={self.system_prompt!r}" if self.system_prompt is not None else ""
        if self.kind == ExampleKind.PROMPT_RESPONSE and self.as_chat:
            prompt, response = self.columns
            return (
                f"varpack.prompt_response_chat.v2 user={prompt} assistant={response}{system}: the chat template below, "
                f"tokenized whole, ending with the end-of-turn token\n{self.chat_template}"
            )
        if self.kind == ExampleKind.PROMPT_RESPONSE:
            cut = ", the prompt's head cut to fit --max-len" if self.keep_response else ""
            return (
                f"varpack.prompt_response.v3 columns={','.join(self.columns)}{system}: [bos] text [eos], the text "
                f"rendered with {self.prompt_template!r} and tokenized whole{cut}"
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

    def prompt_response(self) -> PromptTemplate | AlpacaTemplate:
        """The template that joins the columns of a prompt/response example."""
        return parse_template(self.prompt_template)

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
        if self.prompt_template == ALPACA:
            shown = f"alpaca ({', '.join(self.columns)}; the input section where {self.columns[1]!r} is not empty)"
        return f"[bos] {shown} [eos]; loss on {'every token' if self.train_on_prompt else 'response and EOS'}"


def _named_template(config: PackConfig) -> ExampleFormat | None:
    """The format a ``--prompt-template`` naming its own columns (``{instruction}``, ``alpaca``) reads, else None."""
    if config.prompt_template is None:
        return None
    template = parse_template(config.prompt_template)
    if set(template.fields) <= {"prompt", "response", SYSTEM_FIELD}:
        return None
    if config.messages_column is not None or config.text_column is not None:
        raise ConfigError("--prompt-template joins prompt/response columns; it does not go with --messages-column or --text-column")
    columns = template.columns(config.prompt_column, config.response_column)
    return ExampleFormat(ExampleKind.PROMPT_RESPONSE, columns, prompt_template=config.prompt_template)


def _from_options(config: PackConfig) -> ExampleFormat | None:
    """The format the column options (or a template of named columns) choose, else None."""
    named = _named_template(config)
    if named is not None:
        return named
    if config.prompt_column is not None:
        return ExampleFormat(ExampleKind.PROMPT_RESPONSE, (config.prompt_column, config.response_column))
    if config.messages_column is not None:
        return ExampleFormat(ExampleKind.CHAT, (config.messages_column,))
    if config.text_column is not None:
        return ExampleFormat(ExampleKind.TEXT, (config.text_column,))
    return None


def _detected(available: tuple[str, ...] | None, where: str) -> ExampleFormat:
    """The first known column names among ``available``; Alpaca's instruction, input and output with its template."""
    if available is None:
        raise InputError(f"{where}: pass --prompt-column and --response-column, --messages-column or --text-column")
    for kind, columns in _AUTODETECT:
        if set(columns) <= set(available):
            template = ALPACA if columns == AlpacaTemplate().fields else DEFAULT_PROMPT_TEMPLATE
            return ExampleFormat(kind, columns, prompt_template=template)
    raise InputError(
        f"{where}: cannot tell which columns to use (columns: {', '.join(available) or 'none'}); "
        "pass --prompt-column and --response-column, --messages-column or --text-column"
    )


def _check_columns(chosen: ExampleFormat, available: tuple[str, ...] | None, where: str) -> None:
    """Raise InputError naming the first column of ``chosen`` the source lacks."""
    if available is None:
        return
    missing = [c for c in chosen.columns if c not in available and c.split(".")[0] not in available]
    if missing:
        raise InputError(
            f"{where}: no column {missing[0]!r} (columns: {', '.join(available) or 'none'}); "
            "choose columns with --prompt-column/--response-column, --messages-column or --text-column"
        )


def _check_prompt_response_options(config: PackConfig, chosen: ExampleFormat, where: str, as_chat: bool) -> None:
    """Raise for a prompt/response option given for other data, or in a mix that cannot work."""
    if chosen.kind != ExampleKind.PROMPT_RESPONSE:
        options = {"--system-prompt": config.system_prompt is not None, "--truncate-side left": config.truncate_side == TruncateSide.LEFT}
        given = [option for option, on in options.items() if on]
        if given:
            raise ConfigError(f"{given[0]} applies to prompt/response data; {where} is {chosen.kind} data")
    if as_chat and len(chosen.columns) != 2:
        raise ConfigError("--as-chat renders one prompt column and one response column; it does not go with a template of more")
    if config.truncate_side == TruncateSide.LEFT and (as_chat or config.overflow != Overflow.TRUNCATE):
        raise ConfigError(
            "--truncate-side left cuts the prompt's head of prompt/response examples: pass it with --overflow truncate, "
            "without --as-chat"
        )


def _check_options(config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> bool:
    """Raise for an option that does not fit the data ``chosen`` reads; whether prompt/response data is rendered as chat."""
    as_chat = config.as_chat and chosen.kind == ExampleKind.PROMPT_RESPONSE
    if config.as_chat and not as_chat:
        raise ConfigError(f"--as-chat renders prompt/response data as a chat; {where} is {chosen.kind} data")
    if config.drop_dangling_turns and chosen.kind != ExampleKind.CHAT:
        raise ConfigError(f"--drop-dangling-turns drops turns of chat data; {where} is {chosen.kind} data")
    _check_prompt_response_options(config, chosen, where, as_chat)
    if (chosen.kind == ExampleKind.CHAT or as_chat) and not chat_template:
        raise InputError(
            f"{where}: {'--as-chat' if as_chat else 'chat data'} needs a chat template and the tokenizer has none; "
            "pass --chat-template (chatml, llama3, mistral, gemma, a Jinja template, or a file holding one)"
        )
    return as_chat


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
    chosen = _from_options(config) or default or _detected(available, where)
    _check_columns(chosen, available, where)
    as_chat = _check_options(config, chosen, where, chat_template)
    template = config.prompt_template or chosen.prompt_template
    if chosen.kind == ExampleKind.PROMPT_RESPONSE and len(parse_template(template).columns()) != len(chosen.columns):
        raise ConfigError(
            f"--prompt-template {config.prompt_template!r} names {len(parse_template(template).columns())} columns; "
            f"{where} is read as {len(chosen.columns)} ({', '.join(chosen.columns)})"
        )
    return ExampleFormat(
        chosen.kind,
        chosen.columns,
        train_on_prompt=config.train_on_prompt,
        chat_template=chat_template if chosen.kind == ExampleKind.CHAT or as_chat else None,
        prompt_template=template,
        as_chat=as_chat,
        system_prompt=config.system_prompt if chosen.kind == ExampleKind.PROMPT_RESPONSE else None,
        keep_response=config.truncate_side == TruncateSide.LEFT,
        drop_dangling_turns=config.drop_dangling_turns,
    )
