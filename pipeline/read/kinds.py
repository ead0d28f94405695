"""Example kinds: how the columns of a source row become one training example, one type per kind.

Each kind names the columns it reads and their Arrow types, renders a batch of rows as text
(``render_text``) or as chats (``conversations``), hands them to the encoder's matching tokenizer
call (``encode``), and says, for the fingerprint and the report, how tokens and loss masks are
made (``template``, ``loss_masking``, ``describe``) and which options apply to it (``check``).
A new kind is a new class in ``KINDS``.

>>> import pyarrow as pa
>>> example_format = ExampleFormat(ExampleKind.PROMPT_RESPONSE, ("question", "answer"), prompt_template="Q: {prompt}\\nA: {response}")
>>> kind = example_format.example_kind
>>> type(kind).__name__, kind.loss_masking
('PromptResponse', <LossMasking.RESPONSE_AND_EOS: 'response_and_eos'>)
>>> kind.render_text(pa.table({"question": ["2 + 3?"], "answer": ["5"]}))
(['Q: 2 + 3?\\nA: 5'], array([13]))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import PackConfig, TruncateSide
from pipeline.errors import ConfigError, InputError
from pipeline.read.readers import MESSAGES_TYPE, TEXT_TYPE, BatchRows, read_schema
from pipeline.read.templates import ALPACA, SYSTEM_FIELD, AlpacaTemplate, PromptTemplate, parse_template
from schemas import ExampleKind, LossMasking, Overflow

# How a prompt and its response are joined into one example, unless --prompt-template says otherwise.
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n\n{response}"

# The version of the rules that turn source rows into tokens and loss masks (pipeline/read, pipeline/encode:
# which rows and turns are kept, how they are rendered and masked), part of every build's fingerprint, so a
# build made under other rules is never reused. Bump it with any change to what a fixed input encodes to:
# tests/test_pipeline_units.py::test_a_change_of_the_encoded_tokens_needs_a_new_encoding_rules_version fails until then.
ENCODING_RULES = 1

Encoded = TypeVar("Encoded", covariant=True)


class ExampleEncoder(Protocol[Encoded]):
    """The tokenizer calls a kind hands its rendered rows to (``encode/examples.py``'s ``Encoder``)."""

    def encode_texts(self, texts: list[str], trained_from: np.ndarray) -> Encoded:
        """``[bos] text [eos]`` per text, tokenized whole, trained on from character ``trained_from[i]``."""
        ...

    def encode_chats(self, conversations: list, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        """Each conversation rendered with the chat template and tokenized whole, trained on its assistant turns."""
        ...

    def encode_text_pairs(
        self, prompts: list[str], chosen: list[str | None], rejected: list[str | None], rows: BatchRows, source_rows: np.ndarray
    ) -> Encoded:
        """Preference pairs of texts: ``[bos] prompt completion [eos]`` for each completion, trained on the completion."""
        ...

    def encode_message_pairs(self, chosen: list, rejected: list, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        """Preference pairs of conversations whose shared leading turns are the prompt, trained on the last turns."""
        ...


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
    def example_kind(self) -> Kind:
        """The type of this format's examples, which renders, tokenizes and masks them."""
        return kind_type(self.kind, self.as_chat)(self)

    @property
    def is_chat(self) -> bool:
        """Whether examples are rendered with the chat template (chat data, or prompt/response ``--as-chat``)."""
        return self.example_kind.is_chat

    @property
    def column_types(self) -> dict[str, pa.DataType]:
        """The Arrow type each top-level source column is read as (a struct for a dotted ``data.question``)."""
        return self.example_kind.column_types

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """Columns that may be null or empty (Alpaca's ``input``)."""
        return self.example_kind.optional_columns

    @property
    def template(self) -> str:
        """How the tokens are laid out, for the fingerprint (the chat template in full for chat data), under
        which version of the encoding rules (``ENCODING_RULES``)."""
        return f"varpack.encoding_rules.v{ENCODING_RULES} {self.example_kind.template}"

    @property
    def loss_masking(self) -> LossMasking:
        """Which tokens are trained on, for the fingerprint."""
        return self.example_kind.loss_masking

    def prompt_response(self) -> PromptTemplate | AlpacaTemplate:
        """The template that joins the columns of a prompt/response example."""
        return parse_template(self.prompt_template)

    def describe(self) -> str:
        """The layout of one example, for the report."""
        return self.example_kind.describe()


# Options that apply to some kinds only, in the order they are checked, with what each does (for the error).
_KIND_OPTIONS = (
    ("--as-chat", "renders prompt/response data as a chat", lambda config: config.as_chat),
    ("--drop-dangling-turns", "drops turns of chat data", lambda config: bool(config.drop_dangling_turns)),
    ("--keep-dangling-turns", "refuses turns of chat data", lambda config: config.drop_dangling_turns is False),
    ("--system-prompt", "applies to prompt/response data", lambda config: config.system_prompt is not None),
    ("--truncate-side left", "applies to prompt/response data", lambda config: config.truncate_side == TruncateSide.LEFT),
)


class Kind(ABC):
    """One kind of example over the options of its ``ExampleFormat``."""

    kind: ClassVar[ExampleKind]
    # Prompt/response rendered as a user turn and an assistant turn (--as-chat).
    as_chat: ClassVar[bool] = False
    # Rendered with the chat template, which the build checks before reading any data.
    is_chat: ClassVar[bool] = False
    # The Arrow type its columns are read as.
    column_type: ClassVar[pa.DataType] = TEXT_TYPE
    # What it trains on, unless --train-on-prompt says every token.
    trained: ClassVar[LossMasking]
    # The options of _KIND_OPTIONS that apply to it.
    options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, example_format: ExampleFormat):
        self.format = example_format

    @property
    def columns(self) -> tuple[str, ...]:
        return self.format.columns

    @property
    def column_types(self) -> dict[str, pa.DataType]:
        """The Arrow type each top-level source column is read as (a struct for a dotted ``data.question``)."""
        return read_schema(self.columns, self.column_type)

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """Columns that may be null or empty."""
        return ()

    @property
    def text_columns(self) -> tuple[str, ...]:
        """Columns of which every row needs a non-empty string."""
        return tuple(column for column in self.columns if column not in self.optional_columns)

    @property
    def messages_columns(self) -> tuple[str, ...]:
        """Columns holding chat messages."""
        return ()

    @property
    @abstractmethod
    def template(self) -> str:
        """How the tokens are laid out, for the fingerprint."""

    @property
    def loss_masking(self) -> LossMasking:
        """Which tokens are trained on, for the fingerprint."""
        return LossMasking.ALL_TOKENS if self.format.train_on_prompt else self.trained

    @abstractmethod
    def describe(self) -> str:
        """The layout of one example, for the report."""

    @abstractmethod
    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        """The rows of ``table`` (``source_rows`` of the batch ``rows`` names) tokenized by ``encoder``."""

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        """Raise ConfigError for an option that does not fit ``chosen`` (read from ``where``); a kind that needs
        more (a chat template, a template naming its columns) checks that too."""
        _check_kind_options(cls, config, where)


class _TextKind(Kind):
    """A kind rendered as one text per row, ``[bos] text [eos]``, trained on from a character of it."""

    @abstractmethod
    def render_text(self, table: pa.Table) -> tuple[list[str], np.ndarray]:
        """Each row's text, and the character where its trained part starts."""

    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        return encoder.encode_texts(*self.render_text(table))


class _ChatKind(Kind):
    """A kind rendered as a conversation with the chat template, trained on its assistant turns."""

    is_chat = True
    trained = LossMasking.ASSISTANT_TURNS
    # Where the turns come from, for the report.
    turns_from: ClassVar[str]

    @abstractmethod
    def conversations(self, table: pa.Table) -> list:
        """Each row's messages as read (``encode/chat.py`` reads their roles and contents)."""

    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        return encoder.encode_chats(self.conversations(table), rows, source_rows)

    def describe(self) -> str:
        dangling = {True: ", dangling turns dropped", None: ", dangling ShareGPT turns dropped"}
        source = self.turns_from + dangling.get(self.format.drop_dangling_turns, "")
        return f"chat template ({source}); loss on {'every token' if self.format.train_on_prompt else 'assistant turns'}"


def _check_kind_options(kind: type[Kind], config: PackConfig, where: str) -> None:
    """Raise ConfigError for the first option of _KIND_OPTIONS given that does not apply to ``kind``."""
    for option, what, given in _KIND_OPTIONS:
        if given(config) and option not in kind.options:
            raise ConfigError(f"{option} {what}; {where} is {kind.kind} data")


def _require_chat_template(what: str, where: str, chat_template: str | None) -> None:
    """Raise InputError when there is no chat template to render ``what``."""
    if not chat_template:
        raise InputError(
            f"{where}: {what} needs a chat template and the tokenizer has none; "
            "pass --chat-template (chatml, llama3, mistral, gemma, a Jinja template, or a file holding one)"
        )


def _system(example_format: ExampleFormat) -> str:
    """The system prompt as the fingerprint names it."""
    return f" system={example_format.system_prompt!r}" if example_format.system_prompt is not None else ""


def _check_template_columns(config: PackConfig, chosen: ExampleFormat, where: str) -> None:
    """Raise ConfigError when ``--prompt-template`` names more or fewer columns than ``chosen`` reads."""
    named = len(parse_template(config.prompt_template or chosen.prompt_template).columns())
    if named != len(chosen.columns):
        raise ConfigError(
            f"--prompt-template {config.prompt_template!r} names {named} columns; "
            f"{where} is read as {len(chosen.columns)} ({', '.join(chosen.columns)})"
        )


def _check_truncate_side(config: PackConfig, as_chat: bool) -> None:
    """Raise ConfigError for ``--truncate-side left`` where there is no prompt's head to cut."""
    if config.truncate_side == TruncateSide.LEFT and (as_chat or config.overflow != Overflow.TRUNCATE):
        raise ConfigError(
            "--truncate-side left cuts the prompt's head of prompt/response examples: pass it with --overflow truncate, "
            "without --as-chat"
        )


class PromptResponse(_TextKind):
    """Prompt/response columns joined by ``--prompt-template``: loss on the response and EOS."""

    kind = ExampleKind.PROMPT_RESPONSE
    trained = LossMasking.RESPONSE_AND_EOS
    options = frozenset({"--as-chat", "--system-prompt", "--truncate-side left"})

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """Alpaca's ``input``, whose section is left out where it is empty."""
        return (self.columns[1],) if self.format.prompt_template == ALPACA else ()

    @property
    def template(self) -> str:
        cut = ", the prompt's head cut to fit --max-len" if self.format.keep_response else ""
        return (
            f"varpack.prompt_response.v3 columns={','.join(self.columns)}{_system(self.format)}: [bos] text [eos], the text "
            f"rendered with {self.format.prompt_template!r} and tokenized whole{cut}"
        )

    def describe(self) -> str:
        shown = self.format.prompt_template.replace("\n", "\\n").replace("\t", "\\t")
        if self.format.prompt_template == ALPACA:
            shown = f"alpaca ({', '.join(self.columns)}; the input section where {self.columns[1]!r} is not empty)"
        return f"[bos] {shown} [eos]; loss on {'every token' if self.format.train_on_prompt else 'response and EOS'}"

    def render_text(self, table: pa.Table) -> tuple[list[str], np.ndarray]:
        """Each row rendered with the template, and the character where its response starts."""
        prompts, responses = self.format.prompt_response().render(table, self.format.system_prompt or "")
        trained_from = pc.utf8_length(prompts).to_numpy(zero_copy_only=False).astype(np.int64)
        return pc.binary_join_element_wise(prompts, responses, "").to_pylist(), trained_from

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        _check_truncate_side(config, as_chat=False)
        _check_template_columns(config, chosen, where)


class PromptResponseAsChat(_ChatKind):
    """Prompt/response columns as a user turn and an assistant turn (``--as-chat``), after the system prompt."""

    kind = ExampleKind.PROMPT_RESPONSE
    as_chat = True
    options = PromptResponse.options
    turns_from = "prompt as user, response as assistant"

    @property
    def template(self) -> str:
        prompt, response = self.columns
        return (
            f"varpack.prompt_response_chat.v2 user={prompt} assistant={response}{_system(self.format)}: the chat template "
            f"below, tokenized whole, ending with the end-of-turn token\n{self.format.chat_template}"
        )

    def conversations(self, table: pa.Table) -> list:
        prompts, responses = (table.column(column).to_pylist() for column in self.columns)
        system = [] if self.format.system_prompt is None else [{"role": "system", "content": self.format.system_prompt}]
        return [
            [*system, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            for prompt, response in zip(prompts, responses)
        ]

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        if config.prompt_template is not None:
            raise ConfigError(
                "--prompt-template does not go with --as-chat: the chat template renders the prompt and response columns; "
                "pass --prompt-column and --response-column to choose them"
            )
        if len(chosen.columns) != 2:
            raise ConfigError("--as-chat renders one prompt column and one response column; it does not go with a template of more")
        _check_truncate_side(config, as_chat=True)
        _require_chat_template("--as-chat", where, chat_template)
        _check_template_columns(config, chosen, where)


class _MessagesColumns:
    """A kind whose columns hold message lists: read as messages, and the dangling-turn options apply."""

    columns: tuple[str, ...]
    column_type = MESSAGES_TYPE
    options = frozenset({"--drop-dangling-turns", "--keep-dangling-turns"})

    @property
    def messages_columns(self) -> tuple[str, ...]:
        return self.columns

    @property
    def text_columns(self) -> tuple[str, ...]:
        return ()


class ChatMessages(_MessagesColumns, _ChatKind):
    """A column of messages, ``{role, content}`` or ShareGPT's ``{from, value}``."""

    kind = ExampleKind.CHAT
    turns_from = "messages"

    @property
    def template(self) -> str:
        dropped = {True: " without dangling turns", None: " without dangling ShareGPT turns"}.get(self.format.drop_dangling_turns, "")
        return (
            f"varpack.chat.v2 messages={self.columns[0]}{dropped}: the chat template below, tokenized whole, ending "
            f"with the last end-of-turn token\n{self.format.chat_template}"
        )

    def conversations(self, table: pa.Table) -> list[Any]:
        return table.column(self.columns[0]).to_pylist()

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        _require_chat_template("chat data", where, chat_template)


class PlainText(_TextKind):
    """A column of text, trained on whole."""

    kind = ExampleKind.TEXT
    trained = LossMasking.ALL_TOKENS

    @property
    def template(self) -> str:
        return f"varpack.text.v1 text={self.columns[0]}: [bos] text [eos]"

    def describe(self) -> str:
        return "[bos] text [eos]; loss on every token"

    def render_text(self, table: pa.Table) -> tuple[list[str], np.ndarray]:
        """Each row's text, trained on from its first character."""
        texts = table.column(self.columns[0]).to_pylist()
        return texts, np.zeros(len(texts), np.int64)


def _check_preference_template(config: PackConfig) -> None:
    """Raise ConfigError for a ``--prompt-template`` that is not one prompt and one completion."""
    if config.prompt_template is None:
        return
    fields = set(parse_template(config.prompt_template).fields)
    if not {"prompt", "response"} <= fields <= {"prompt", "response", SYSTEM_FIELD}:
        raise ConfigError(
            f"--prompt-template {config.prompt_template!r}: a preference pair joins one prompt and one completion; "
            "write {prompt} and {response} (the completion), e.g. '{prompt}\\n\\n{response}'"
        )


class PreferenceText(Kind):
    """Prompt, chosen and rejected text columns, each completion joined to the prompt by ``--prompt-template``
    as ``[bos] text [eos]``; loss on each completion and its EOS, never the prompt."""

    kind = ExampleKind.PREFERENCE
    trained = LossMasking.COMPLETIONS
    options = frozenset({"--as-chat", "--system-prompt"})

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """The completions, whose null or blank values are bad pairs (``empty_completion``)."""
        return self.columns[1:]

    @property
    def template(self) -> str:
        prompt, chosen, rejected = self.columns
        return (
            f"varpack.preference.v1 prompt={prompt} chosen={chosen} rejected={rejected}{_system(self.format)}: "
            f"[bos] text [eos] per completion, the text rendered with {self.format.prompt_template!r} and tokenized whole"
        )

    def describe(self) -> str:
        shown = self.format.prompt_template.replace("\n", "\\n").replace("\t", "\\t")
        return f"[bos] {shown} [eos] per completion; loss on each completion and EOS"

    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        prompt, chosen, rejected = (table.column(column) for column in self.columns)
        template, system = self.format.prompt_response(), self.format.system_prompt or ""
        # The template's text before {response} is the prompt; the rest, the completion.
        prompts, chosen_texts = template.render(pa.table([prompt, pc.fill_null(chosen, "")], names=["p", "c"]), system)
        _, rejected_texts = template.render(pa.table([prompt, pc.fill_null(rejected, "")], names=["p", "c"]), system)
        return encoder.encode_text_pairs(
            prompts.to_pylist(), _completions(chosen, chosen_texts), _completions(rejected, rejected_texts), rows, source_rows
        )

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        _check_preference_template(config)


class PreferenceTextAsChat(PreferenceText):
    """Prompt, chosen and rejected text columns rendered with the chat template (``--as-chat``): the prompt as a
    user turn after the system prompt, each completion as an assistant turn."""

    as_chat = True
    is_chat = True

    @property
    def template(self) -> str:
        prompt, chosen, rejected = self.columns
        return (
            f"varpack.preference_chat.v1 user={prompt} chosen={chosen} rejected={rejected}{_system(self.format)}: the chat "
            f"template below, each completion an assistant turn ending with the end-of-turn token\n{self.format.chat_template}"
        )

    def describe(self) -> str:
        return "chat template (prompt as user, each completion as assistant); loss on each completion and its end-of-turn token"

    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        prompt, chosen, rejected = (table.column(column).to_pylist() for column in self.columns)
        system = [] if self.format.system_prompt is None else [{"role": "system", "content": self.format.system_prompt}]

        def chats(completions: list[str | None]) -> list:
            return [[*system, {"role": "user", "content": p}, {"role": "assistant", "content": c}] for p, c in zip(prompt, completions)]

        return encoder.encode_message_pairs(chats(chosen), chats(rejected), rows, source_rows)

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        if config.prompt_template is not None:
            raise ConfigError("--prompt-template does not go with --as-chat: the chat template renders the pair")
        _require_chat_template("--as-chat", where, chat_template)


def _completions(values: pa.ChunkedArray, rendered: pa.Array) -> list[str | None]:
    """Each completion as the template renders it, None where the completion itself is null or blank."""
    blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), True)
    return pc.if_else(blank, pa.scalar(None, pa.string()), rendered).to_pylist()


class PreferenceMessages(_MessagesColumns, Kind):
    """Chosen and rejected columns of messages (UltraFeedback's, HH-RLHF's shape): their shared leading turns
    are the prompt and each one's last turn, an assistant turn, its completion; loss on each completion and its
    end-of-turn token."""

    kind = ExampleKind.PREFERENCE_CHAT
    is_chat = True
    trained = LossMasking.COMPLETIONS

    @property
    def template(self) -> str:
        chosen, rejected = self.columns
        return (
            f"varpack.preference_chat.v1 chosen={chosen} rejected={rejected}: the shared leading turns are the prompt, "
            f"each last assistant turn a completion; the chat template below\n{self.format.chat_template}"
        )

    def describe(self) -> str:
        return (
            "chat template (shared leading turns as the prompt, the last assistant turns as completions); loss on each "
            "completion and its end-of-turn token"
        )

    def encode(self, encoder: ExampleEncoder[Encoded], table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> Encoded:
        chosen, rejected = (table.column(column).to_pylist() for column in self.columns)
        return encoder.encode_message_pairs(chosen, rejected, rows, source_rows)

    @classmethod
    def check(cls, config: PackConfig, chosen: ExampleFormat, where: str, chat_template: str | None) -> None:
        _check_kind_options(cls, config, where)
        _require_chat_template("preference pairs of messages", where, chat_template)


# Each kind by what it is and whether it is rendered as a chat.
KINDS: dict[tuple[ExampleKind, bool], type[Kind]] = {
    (kind.kind, kind.as_chat): kind
    for kind in (PromptResponse, PromptResponseAsChat, ChatMessages, PlainText, PreferenceText, PreferenceTextAsChat, PreferenceMessages)
}


def kind_type(kind: ExampleKind, as_chat: bool = False) -> type[Kind]:
    """The type of ``kind`` examples, rendered as a chat with ``as_chat`` where that kind can be."""
    return KINDS.get((kind, as_chat)) or KINDS[(kind, False)]
