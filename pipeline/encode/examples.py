"""Turn a batch of source rows into token ids and loss masks, one tokenizer call per batch.

- prompt/response: ``[bos] text [eos]``, the text the columns rendered with ``--prompt-template``
  (default ``{prompt}\n\n{response}``; see ``pipeline/read/templates.py``) and tokenized whole,
  so its tokens are those of the text as the model will see it. Mask 0 on BOS and the prompt (1
  with ``--train-on-prompt``), 1 from the token holding the response's first character through
  EOS. With ``--as-chat`` they are rendered as a user turn and an assistant turn, like chat data.
- plain text: ``[bos] text [eos]``, mask 1 on every token that can be predicted (not BOS).
- chat: the messages (``{role, content}`` or ShareGPT's ``{from, value}``, see ``chat.py``)
  rendered with the chat template and tokenized whole; mask 1 on the characters each assistant
  turn adds (its content and the template's end-of-turn token, not the whitespace after it).
  The example ends with the last turn's end-of-turn token, which must be a special token.
  A template that writes no system turn (it drops it, or refuses it) gets the system content
  merged into the first user turn, ``system\n\nuser``, as Gemma's own template does. Each turn
  the template leaves out (``chat.written``) is counted as left out (``EncodedBatch.turns``), and
  under ``--strict`` stops the build; a turn is used when it is in the tokens kept.

Rows that cannot make an example (null or empty text, broken conversations, no tokens) stop the
batch with an error naming the first one, or under ``--on-bad-row skip`` are left out and
returned in ``EncodedBatch.rejected`` (see ``bad_rows.py``). Under ``--overflow truncate`` an
example with no trained token within ``--max-len`` is dropped and counted.
"""

from __future__ import annotations

import array
import functools
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.encode.bad_rows import DROPPED_WHOLE, BadRow, Reason, RowProblem
from pipeline.encode.chat import Conversation, as_read, conversation, count_turns, data_text, tool_call_names, written
from pipeline.encode.tokenizer import LoadedTokenizer, control_tokens
from pipeline.errors import ConfigError, InputError
from pipeline.ranges import gather_index
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import BatchRows, select_columns
from schemas import BadRowPolicy, Overflow

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A special marker as chat templates write them: <|im_start|>, <|eot_id|>, <start_of_turn>, </s>;
# not Llama 2's <<SYS>>, which is text.
_MARKER = re.compile(r"(?<!<)(?:<\|[^<>|\s]{1,64}\|>|</?[A-Za-z_][A-Za-z0-9_]{0,63}>)(?!>)")
# The conversation a chat template is checked on before anything is read.
PROBE_CHAT = (
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Sure"},
)
# The system prompt a chat template is checked on: a template that does not write it has no system turn.
PROBE_SYSTEM = "Answer in one word."
# The tool call a chat template is checked on: a template that does not write its name writes no tool calls.
PROBE_TOOL_CALL = (
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe_function_name", "arguments": {"x": 1}}}
    ]},
    {"role": "tool", "content": "2"},
    {"role": "assistant", "content": "Sure"},
)


def special_text_line(token: str) -> str:
    """What holding a special token's text in the data means, for warnings and errors."""
    return f"the data text holds {token!r}, the text of a special token, and is tokenized as that token, not as text"


@dataclass
class EncodedBatch:
    """Examples as one flat buffer: example ``i`` is ``tokens[starts[i]:starts[i] + lengths[i]]``.

    ``rows`` gives each example's row within the batch (rows left out have no example; None:
    one example per row). ``rejected`` lists the batch's rows left out under ``--on-bad-row
    skip``; ``untrained`` counts the examples and tokens ``--overflow truncate`` left with
    nothing to train on; ``turns`` counts chat turns read, used and dropped (``chat.count_turns``).
    """

    lengths: np.ndarray  # int64 [examples]
    tokens: np.ndarray  # [sum(lengths)]: uint16 when the vocabulary fits, else int32 (see token_dtype)
    loss_mask: np.ndarray  # uint8 [sum(lengths)]
    rows: np.ndarray | None = None  # int64 [examples], ascending
    rejected: list[BadRow] = field(default_factory=list)
    untrained: tuple[int, int] = (0, 0)
    turns: Counter[str] = field(default_factory=Counter)
    prompt_cut: tuple[int, int] = (0, 0)  # examples that fit once --truncate-side left cut their prompt, tokens cut
    # Special tokens whose text the data holds: {token: (examples, the first one's row)} (see special_text).
    special_text: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Preference pairs: each token's role (schemas.Role), from which a pair's segments are cut when its row is built.
    roles: np.ndarray | None = None  # uint8 [sum(lengths)]

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths

    @property
    def example_rows(self) -> np.ndarray:
        """Each example's row within the batch."""
        return np.arange(self.lengths.size, dtype=np.int64) if self.rows is None else self.rows

    def select(self, keep: np.ndarray) -> EncodedBatch:
        """The examples where boolean ``keep`` is true."""
        index = gather_index(self.starts[keep], self.lengths[keep])
        return EncodedBatch(
            self.lengths[keep], self.tokens[index], self.loss_mask[index], self.example_rows[keep], self.rejected,
            self.untrained, self.turns, self.prompt_cut, self.special_text, None if self.roles is None else self.roles[index],
        )


def _turn_starts(messages: list[dict[str, Any]], text: str, spans: list[tuple[int, int]], kept: int) -> list[int]:
    """Where each of ``messages`` starts in ``text``, the chat rendered: an assistant turn at its span
    (``spans``, those past character ``kept`` left out), any other turn where its own text is found after
    the turn before it, or, when the template writes it otherwise, where the turn before it ends.

    >>> text = "[INST] Hi [/INST] Hello</s>[INST] Tell me more [/INST] No</s>"
    >>> messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
    ...             {"role": "user", "content": "Tell me more"}, {"role": "assistant", "content": "No"}]
    >>> _turn_starts(messages, text, [(18, 27), (55, 61)], len(text))
    [7, 18, 34, 55]
    """
    assistant, starts, after = iter(spans), [], 0
    for message in messages:
        if message["role"] == "assistant":
            start, after = next(assistant, (kept, kept))
        else:
            own = message["content"].strip()
            found = text.find(own, after) if own else -1
            start = after if found < 0 else found
            after = start + len(own) if found >= 0 else after
        starts.append(start)
    return starts


def _trained_spans(
    spans: list[tuple[int, int]], trained: tuple[bool, ...], generation_tags: bool, rows: BatchRows, row: int
) -> list[tuple[int, int]]:
    """The assistant ``spans`` of the turns trained on (``trained``, one per assistant turn): with
    ``{% generation %}`` one span per turn; without, those ``_assistant_spans`` found (the first turns up to
    the characters kept) and the last turn's.

    >>> _trained_spans([(0, 5), (9, 12), (20, 25)], (True, False, True, False), False, BatchRows("t"), 0)
    [(0, 5)]
    """
    if all(trained):
        return spans
    if generation_tags:
        if len(spans) != len(trained):
            raise InputError(
                f"{rows.name(row)}: the chat template marks {len(spans)} {{% generation %}} blocks for {len(trained)} "
                "assistant turns, so the turns of weight 0 cannot be left untrained; mark one block per assistant turn"
            )
        return [span for span, on in zip(spans, trained) if on]
    flags = [*trained[: len(spans) - 1], trained[-1]]
    return [span for span, on in zip(spans, flags) if on]


def special_affixes(tokenizer: LoadedTokenizer) -> tuple[list[int], list[int]]:
    """The token ids that go before and after one example (e.g. ``[1]`` and ``[2]`` for Mistral)."""
    return list(tokenizer.prefix_ids), list(tokenizer.suffix_ids)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype for token ids: tokens cross two shuffles, so 2 bytes instead of 4 matter."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def token_ids(encodings: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The ids of all ``encodings`` as one flat array of ``dtype``, and how many ids each one has."""
    ids = array.array("I")
    # Filling one C array keeps a single id list alive at a time: about 3x faster than
    # flattening the lists of all encodings at once, and tokenizers has no array output.
    for encoding in encodings:
        ids.fromlist(encoding.ids)
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    return np.frombuffer(ids, dtype=np.uintc).astype(dtype), lengths


# Texts per encode_batch call: tokenizers holds about 60 bytes per token of Encoding objects
# until the call returns, so a whole batch at once would cost a few hundred MB at its peak.
ENCODE_CHUNK = 1024


# Texts longer than this are tokenized in pieces of about this many characters where the tokenizer
# allows it exactly (``cuts_between_words``): tokenizers' BPE costs more than linear time in the
# length of one pre-token, and a SentencePiece tokenizer's text is one pre-token.
PIECE_CHARS = 1 << 16


def encode_ids(backend, texts: list[str], dtype: np.dtype, piece_chars: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``token_ids`` of ``texts`` encoded without special tokens, ENCODE_CHUNK texts at a time.

    With ``piece_chars``, texts longer than that are cut into pieces between words
    (``cut_between_words``) and encoded piece by piece; only right for a tokenizer of which
    ``cuts_between_words`` is true.
    """
    pieces, owners = texts, None
    if piece_chars is not None and any(len(text) > piece_chars for text in texts):
        cut = [cut_between_words(text, piece_chars) for text in texts]
        pieces = [piece for text_pieces in cut for piece in text_pieces]
        owners = np.repeat(np.arange(len(texts)), [len(text_pieces) for text_pieces in cut])
    parts = [
        token_ids(backend.encode_batch_fast(pieces[i : i + ENCODE_CHUNK], add_special_tokens=False), dtype)
        for i in range(0, len(pieces), ENCODE_CHUNK)
    ]
    if not parts:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    ids, lengths = np.concatenate([ids for ids, _ in parts]), np.concatenate([lengths for _, lengths in parts])
    if owners is not None:
        lengths = np.bincount(owners, weights=lengths, minlength=len(texts)).astype(np.int64)
    return ids, lengths


def encode_with_boundaries(
    backend, texts: list[str], boundaries: np.ndarray, dtype: np.dtype, piece_chars: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``encode_ids`` of ``texts``, and how many of each text's tokens lie before the character ``boundaries[i]``.

    Each text is tokenized whole (or in pieces cut between words, which is exact, see
    ``encode_ids``); a token holding the boundary character, such as SentencePiece's ``▁Five``
    that starts with the space before it, counts as after it.

    >>> from pipeline.encode.tokenizer import load_tokenizer
    >>> backend = load_tokenizer("mistral-7b-v0.1").backend()
    >>> ids, lengths, before = encode_with_boundaries(backend, ["Answer: 5"], np.array([8]), np.dtype(np.int32))
    >>> [backend.id_to_token(int(i)) for i in ids], int(before[0])
    (['▁Answer', ':', '▁', '5'], 3)
    """
    pieces, owners, piece_starts = texts, np.arange(len(texts)), np.zeros(len(texts), np.int64)
    if piece_chars is not None and any(len(text) > piece_chars for text in texts):
        cut = [cut_between_words(text, piece_chars) for text in texts]
        pieces = [piece for text_pieces in cut for piece in text_pieces]
        owners = np.repeat(np.arange(len(texts)), [len(text_pieces) for text_pieces in cut])
        piece_lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
        first = np.searchsorted(owners, np.arange(len(texts)))
        piece_starts = np.cumsum(piece_lengths) - piece_lengths
        piece_starts -= np.repeat(piece_starts[first], np.diff(np.append(first, len(pieces))))
    local = np.asarray(boundaries, np.int64)[owners] - piece_starts
    parts, before = [], np.zeros(len(pieces), np.int64)
    for i in range(0, len(pieces), ENCODE_CHUNK):
        encodings = backend.encode_batch(pieces[i : i + ENCODE_CHUNK], add_special_tokens=False)
        parts.append(token_ids(encodings, dtype))
        for j, encoding in enumerate(encodings, start=i):
            before[j] = _tokens_before(encoding, int(local[j]), len(pieces[j]))
    if not parts:
        return np.zeros(0, dtype), np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids, lengths = np.concatenate([ids for ids, _ in parts]), np.concatenate([lengths for _, lengths in parts])
    per_text = [np.bincount(owners, weights=values, minlength=len(texts)).astype(np.int64) for values in (lengths, before)]
    return ids, per_text[0], per_text[1]


def _tokens_before(encoding, boundary: int, chars: int) -> int:
    """How many tokens of ``encoding`` (of a text of ``chars`` characters) lie wholly before character ``boundary``."""
    if boundary <= 0:
        return 0
    if boundary >= chars:
        return len(encoding)
    token = encoding.char_to_token(boundary)
    if token is not None:
        return int(token)
    # The boundary character is in no token (a normalizer dropped it): count the tokens that end before it.
    ends = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 1]
    return int(np.count_nonzero(ends <= boundary))


def cut_between_words(text: str, piece_chars: int) -> list[str]:
    """``text`` in pieces of at least ``piece_chars`` characters, each after the first starting at a
    space that follows a character other than a space or ``▁`` (which the space becomes for a
    SentencePiece tokenizer); a text with no such space stays whole.

    >>> cut_between_words("one two  three four▁ five", 3)
    ['one', ' two', '  three', ' four▁ five']
    """
    pieces, start = [], 0
    while True:
        cut = text.find(" ", start + piece_chars)
        while cut > 0 and text[cut - 1] in " ▁":
            cut = text.find(" ", cut + 1)
        if cut < 0:
            return [*pieces, text[start:]]
        pieces.append(text[start:cut])
        start = cut


@functools.lru_cache(maxsize=8)  # per tokenizer object: each worker parses the 1.8 MB JSON once, not once per step
def cuts_between_words(backend) -> bool:
    """Whether tokenizing pieces of a text cut by ``cut_between_words`` gives exactly the tokens of the whole text.

    True for SentencePiece BPE tokenizers as transformers converts them (Mistral, Llama 2): no
    normalizer, a Metaspace pre-tokenizer (each piece after the first starts with a space, so it
    gets no ▁ of its own), a BPE model without dropout with no token holding ▁ after another
    character, and no added token holding a space. BPE then never merges across such a cut, so
    each piece merges as it does inside the whole text.
    """
    config = json.loads(backend.to_str())
    pre_tokenizer, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
    if config.get("normalizer") is not None or pre_tokenizer.get("type") != "Metaspace":
        return False
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return False
    if pre_tokenizer.get("replacement") != "▁":
        return False
    after_other = re.compile("[^▁]▁")
    return not any(after_other.search(token) for token in model.get("vocab", {})) and not any(
        " " in added.get("content", "") for added in config.get("added_tokens", [])
    )


class Encoder:
    """Encodes tables of source rows in one format with one tokenizer; checks every value on the way.

    The format's kind (``read/kinds.py``) renders each batch as texts or chats and hands them
    back to ``encode_texts`` or ``encode_chats``.
    """

    def __init__(
        self,
        tokenizer: LoadedTokenizer,
        example_format: ExampleFormat,
        max_len: int,
        overflow: str,
        on_bad_row: str = BadRowPolicy.ERROR,
        strict: bool = False,
    ):
        self.tokenizer = tokenizer
        self.format = example_format
        self.max_len = max_len
        self.overflow = overflow
        self.on_bad_row = on_bad_row
        self.backend = tokenizer.backend()
        self.prefix, self.suffix = special_affixes(tokenizer)
        self.dtype = token_dtype(self.backend.get_vocab_size(with_added_tokens=True))
        self.piece_chars = PIECE_CHARS if cuts_between_words(self.backend) else None
        self.strict = strict
        self.kind = example_format.example_kind
        self.merges_system = example_format.is_chat and not self._writes("system", PROBE_SYSTEM)
        self.writes_tool_calls = example_format.is_chat and self._writes("tool_calls", "probe_function_name")
        specials = sorted(control_tokens(self.backend), key=len, reverse=True)
        self.specials_pattern = "|".join(re.escape(token) for token in specials)

    def encode(self, table: pa.Table, rows: BatchRows) -> EncodedBatch:
        """Tokens and loss masks of the rows of ``table``, named in messages by ``rows``."""
        table = select_columns(table, self.format.columns, rows.origin)
        problems = {**self._text_problems(table, rows.origin), **self._not_objects(table, rows)}
        rejected, table, source_rows = self._leave_out(problems, table, rows, np.arange(table.num_rows))
        batch, problems = self.kind.encode(self, table, rows, source_rows)
        more, table, source_rows = self._leave_out(problems, table, rows, source_rows)
        rejected += more
        batch.special_text = batch.special_text or self._special_text(table, rows, source_rows)
        empty = np.flatnonzero(batch.lengths == 0)
        if empty.size:
            problems = {int(i): (Reason.NO_TOKENS, "encodes to no tokens") for i in empty}
            more, table, source_rows = self._leave_out(problems, table, rows, source_rows)
            rejected += more
            batch = batch.select(batch.lengths > 0)
        if self.overflow == Overflow.ERROR:
            long = np.flatnonzero(batch.lengths > self.max_len)
            if long.size:
                i = int(long[0])
                raise InputError(
                    f"{rows.name(source_rows[i])}: {int(batch.lengths[i])} tokens, more than --max-len {self.max_len}; "
                    "pass --overflow split, truncate or drop"
                )
        batch.rows = source_rows
        if self.overflow == Overflow.TRUNCATE:
            batch = self._drop_untrained(batch)
        batch.rejected = rejected
        return batch

    def _leave_out(
        self, problems: dict[int, tuple[Reason, str]], table: pa.Table, rows: BatchRows, source_rows: np.ndarray
    ) -> tuple[list[BadRow], pa.Table, np.ndarray]:
        """The bad rows of ``problems`` (index in ``table`` -> reason and message), and ``table`` and
        ``source_rows`` (each row's index in the batch) without them; under ``--on-bad-row error``
        the error for the first one that is broken data (``BadRow.is_bad``)."""
        if not problems:
            return [], table, source_rows
        indices = sorted(problems)
        if self.on_bad_row == BadRowPolicy.ERROR:
            bad = [BadRow(rows.name(source_rows[i]), *problems[i], {}) for i in indices if problems[i][0] not in DROPPED_WHOLE]
            if bad:
                raise bad[0].error()
        messages = self.kind.messages_columns
        values: list[object] = [
            # A JSON line that is not an object is listed as its line holds it, not as the row of nulls Arrow reads.
            rows.as_read(source_rows[i]) if problems[i][0] == Reason.NOT_AN_OBJECT
            else {column: as_read(value) if column in messages else value for column, value in row.items()}
            for i, row in zip(indices, table.take(pa.array(indices, type=pa.int64())).to_pylist())
        ]
        names = rows.names(source_rows[indices])
        bad_rows = [BadRow(where, *problems[i], row, int(source_rows[i])) for i, where, row in zip(indices, names, values)]
        keep = np.ones(table.num_rows, dtype=bool)
        keep[indices] = False
        return bad_rows, table.filter(pa.array(keep)), source_rows[keep]

    def _drop_untrained(self, batch: EncodedBatch) -> EncodedBatch:
        """Drop the examples whose first trained token lies past ``--max-len``: truncation leaves them nothing to learn."""
        starts, ends = batch.starts, np.cumsum(batch.lengths)
        trained = np.flatnonzero(batch.loss_mask)
        example = np.searchsorted(ends, trained, side="right")
        first_trained = np.full(batch.lengths.size, np.iinfo(np.int64).max, dtype=np.int64)
        has, first = np.unique(example, return_index=True)
        first_trained[has] = trained[first] - starts[has]
        untrained = first_trained >= self.max_len
        if not untrained.any():
            return batch
        kept = batch.select(~untrained)
        kept.untrained = (int(untrained.sum()), int(batch.lengths[untrained].sum()))
        return kept

    def _not_objects(self, table: pa.Table, rows: BatchRows) -> dict[int, tuple[Reason, str]]:
        """Rows read from JSON lines that are not objects (``null``, ``5``), by index: Arrow reads them as rows of nulls."""
        all_null = np.ones(table.num_rows, dtype=bool)
        for column in table.columns:
            all_null &= pc.is_null(column).to_numpy(zero_copy_only=False)
        candidates = np.flatnonzero(all_null)
        if not candidates.size:
            return {}
        return {int(i): (Reason.NOT_AN_OBJECT, "not a JSON object") for i in candidates[rows.not_an_object(candidates)]}

    def _special_text(self, table: pa.Table, rows: BatchRows, source_rows: np.ndarray) -> dict[str, tuple[int, str]]:
        """The special tokens whose text the data's own text columns hold (not the template's), tokenized as
        those tokens: for each, the examples holding it and the first one's row; under ``--strict`` an error.
        Chat messages are counted as they are rendered (``encode_chats``)."""
        if self.kind.messages_columns:
            return {}
        found: dict[str, tuple[int, str]] = {}
        for column in self.kind.columns:  # optional ones too (Alpaca's input), and under --as-chat
            values = table.column(column)
            if not pa.types.is_null(values.type):
                self._count_special_text(values, lambda i: rows.name(int(source_rows[i])), found)
        return found

    def _count_special_text(self, texts: pa.Array | pa.ChunkedArray, name: Callable[[int], str], found: dict) -> None:
        """Add to ``found`` the special tokens whose text each of ``texts`` (one per example, named by ``name``)
        holds; under ``--strict`` the first is an error."""
        if not self.specials_pattern:
            return
        hits = pc.match_substring_regex(texts, self.specials_pattern).fill_null(False).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(hits).tolist():
            for token in dict.fromkeys(re.findall(self.specials_pattern, texts[i].as_py())):
                count, first = found.get(token, (0, name(i)))
                found[token] = (count + 1, first)
            if self.strict:
                token, (_, first) = next(iter(found.items()))
                raise InputError(f"{first}: {special_text_line(token)}; remove it from the data, or leave out --strict")

    def _text_problems(self, table: pa.Table, origin: str) -> dict[int, tuple[Reason, str]]:
        """Rows with a null or empty value in a text column (the first problem of each row), by index."""
        problems: dict[int, tuple[Reason, str]] = {}
        for column in self.kind.text_columns:
            values = table.column(column)
            if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type) or pa.types.is_null(values.type)):
                raise InputError(f"{origin}: column {column!r} holds {values.type} values; it must hold strings")
            null = pc.is_null(values).to_numpy(zero_copy_only=False)
            empty = np.zeros_like(null)
            if not pa.types.is_null(values.type):
                empty = pc.equal(pc.binary_length(values), 0).fill_null(False).to_numpy(zero_copy_only=False)
            need = f"every example needs a non-empty {column!r}"
            for i in np.flatnonzero(null).tolist():
                problems.setdefault(i, (Reason.NULL, f"{column!r} is null; {need}"))
            for i in np.flatnonzero(empty).tolist():
                problems.setdefault(i, (Reason.EMPTY_TEXT, f"{column!r} is empty; {need}"))
        return problems

    def encode_texts(self, texts: list[str], trained_from: np.ndarray) -> tuple[EncodedBatch, dict[int, tuple[Reason, str]]]:
        """``[bos] text [eos]``, the text tokenized whole; loss from the token holding character ``trained_from[i]``
        (the response; 0 for plain text) through EOS. No text is refused."""
        ids, text_lengths, prompt_tokens = encode_with_boundaries(self.backend, texts, trained_from, self.dtype, self.piece_chars)
        n, text_starts = len(texts), np.cumsum(text_lengths) - text_lengths
        cut = np.zeros(n, np.int64)
        if self.format.keep_response:
            cut = np.clip(text_lengths + len(self.prefix) + len(self.suffix) - self.max_len, 0, prompt_tokens)
            text_starts, text_lengths, prompt_tokens = text_starts + cut, text_lengths - cut, prompt_tokens - cut
        # Example i is the prefix, its text's tokens and the suffix, gathered from one buffer that
        # holds the prefix, the suffix, then every text's tokens.
        affixes = np.array(self.prefix + self.suffix, dtype=self.dtype)
        piece_starts = np.column_stack([np.zeros(n, np.int64), text_starts + affixes.size, np.full(n, len(self.prefix))])
        piece_lengths = np.column_stack([np.full(n, len(self.prefix)), text_lengths, np.full(n, len(self.suffix))])
        tokens = np.concatenate([affixes, ids])[gather_index(piece_starts.ravel(), piece_lengths.ravel())]
        # The mask in four runs: the prefix, the prompt, the response (or the whole text) and the suffix.
        mask_lengths = np.column_stack([piece_lengths[:, 0], prompt_tokens, text_lengths - prompt_tokens, piece_lengths[:, 2]])
        mask_values = np.tile(np.array([0, int(self.format.train_on_prompt), 1, 1], dtype=np.uint8), n)
        lengths = piece_lengths.sum(axis=1)
        fitted = int(np.count_nonzero((cut > 0) & (lengths <= self.max_len)))
        batch = EncodedBatch(lengths, tokens, np.repeat(mask_values, mask_lengths.ravel()))
        batch.prompt_cut = (fitted, int(cut.sum()))
        return batch, {}

    def encode_chats(
        self, conversations: list, rows: BatchRows, source_rows: np.ndarray
    ) -> tuple[EncodedBatch, dict[int, tuple[Reason, str]]]:
        """The conversations (``source_rows`` of the batch ``rows`` names) rendered with the chat template and
        tokenized, loss on the assistant turns; and those that could not be, by index, with the reason."""
        label = "/".join(self.format.columns)
        chats, rendered, spans, problems = [], [], [], {}
        for i, value in enumerate(conversations):
            row = int(source_rows[i])
            try:
                chat = conversation(value, self.format.drop_dangling_turns)
                self._check_tool_calls(chat, rows, row)
                messages = self._with_system_merged(chat.messages)
                text, assistant = self._render(messages, rows, row)
            except RowProblem as problem:
                problems[i] = (problem.reason, f"{label!r}: {problem.message}")
                continue
            chats.append((chat, messages, row))
            rendered.append(text)
            spans.append(assistant)
        encodings = self.backend.encode_batch(rendered, add_special_tokens=False)
        tokens, lengths = token_ids(encodings, self.dtype)
        masks, turns = [], Counter()
        generation_tags = _GENERATION_TAG.search(self.format.chat_template) is not None
        for (chat, messages, row), text, encoding, assistant in zip(chats, rendered, encodings, spans):
            offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            # The characters that reach the rows: all of them, those before the first token truncation
            # cuts, or none for an example too long for --overflow drop (or error).
            kept = len(text)
            if len(offsets) > self.max_len and self.overflow != Overflow.SPLIT:
                kept = int(offsets[self.max_len, 0]) if self.overflow == Overflow.TRUNCATE else 0
            if not generation_tags:  # located turn by turn, as far as the kept characters reach
                assistant = self._assistant_spans(messages, text, rows, row, kept, assistant[-1])
            if self.format.train_on_prompt:
                mask = np.ones(len(encoding), dtype=np.uint8)
                if self.prefix and encoding.ids[: len(self.prefix)] == self.prefix:
                    mask[: len(self.prefix)] = 0
            else:
                # A token is trained on when any of its characters lies inside an assistant span (a
                # token can hold the template's last character and the answer's first: Mistral's "]{").
                trained = _trained_spans(assistant, chat.trained_turns(), generation_tags, rows, row)
                bounds = np.array([span for span in trained if span[1] > span[0]], dtype=np.int64).ravel()
                first = np.searchsorted(bounds, offsets[:, 0], side="right")
                mask = ((first % 2 == 1) | (np.searchsorted(bounds, offsets[:, 1], side="left") > first)).astype(np.uint8)
            if self.overflow == Overflow.TRUNCATE and not mask[: self.max_len].any():
                kept = 0  # dropped with nothing to train on (_drop_untrained)
            turns += self._count_turns(chat, messages, text, assistant, kept, rows, row)
            masks.append(mask)
        loss_mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
        special_text: dict[str, tuple[int, str]] = {}
        if self.kind.messages_columns:  # the messages' own text; --as-chat rows are counted by their columns
            texts = pa.array([data_text(messages) for _, messages, _ in chats], pa.large_string())
            self._count_special_text(texts, lambda i: rows.name(chats[i][2]), special_text)
        return EncodedBatch(lengths, tokens, loss_mask, turns=turns, special_text=special_text), problems

    def _count_turns(
        self, chat: Conversation, messages: list[dict[str, Any]], text: str, spans: list[tuple[int, int]], kept: int,
        rows: BatchRows, row: int,
    ) -> Counter[str]:
        """``chat``'s turns counted by role as read, used (in the tokens kept: written by the template and
        starting before character ``kept`` of ``text``, the rendered chat: an assistant turn at its span
        ``spans``, another turn where its own text is), left out by the template, and merged, the fields the template
        does not write, and its dropped dangling turns; under ``--strict`` a turn or a field the template
        leaves out is an error naming the row."""
        try:
            turns_written, unwritten = written(messages, self._text)
        except RowProblem:  # the template refuses the marked conversation: look for the texts themselves
            text = self._text(messages)
            turns_written = [all(p in text for p in [m["content"].strip(), *tool_call_names(m)]) for m in messages]
            unwritten = [[] for _ in messages]
        in_tokens = [wrote and start < kept for wrote, start in zip(turns_written, _turn_starts(messages, text, spans, kept))]
        merged = self.merges_system and chat.messages[0]["role"] == "system"
        if merged:  # the system turn is written, and kept, with the first user turn
            turns_written, in_tokens = [turns_written[0], *turns_written], [in_tokens[0], *in_tokens]
            unwritten = [[], *unwritten]
        if self.strict and not all(turns_written):
            k = turns_written.index(False)
            raise InputError(
                f"{rows.name(row)}: the chat template left out a {chat.messages[k]['role']} turn (its content is not in "
                "the rendered text); use a template that writes such turns, or leave out --strict to count them"
            )
        missing = next(((k, names[0]) for k, names in enumerate(unwritten) if names), None)
        if self.strict and missing is not None:
            k, name = missing
            raise InputError(
                f"{rows.name(row)}: the chat template does not write the {name!r} of turn {k + 1} "
                f"({chat.messages[k]['role']}); use a template that writes it, or leave out --strict to count it"
            )
        return count_turns(chat, turns_written, in_tokens, unwritten, merged)

    def _text(self, messages: list[dict[str, Any]]) -> str:
        """The chat template's text for ``messages``."""
        return self._apply_template(messages)[0]

    def _check_tool_calls(self, chat: Conversation, rows: BatchRows, row: int) -> None:
        """Raise InputError, naming the row, for tool calls a template that writes none would lose."""
        calls = [name for message in chat.messages for name in tool_call_names(message)]
        if calls and not self.writes_tool_calls:
            raise InputError(
                f"{rows.name(row)}: the chat template writes no tool calls, so the call to {calls[0]!r} would vanish; "
                "use a template that writes tool calls (the model's own, e.g. Qwen2.5's or Llama 3.1's)"
            )

    def _with_system_merged(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with a system turn merged into the first user turn, for a template that writes none."""
        if not (self.merges_system and messages[0]["role"] == "system"):
            return messages
        system, user, *rest = messages
        return [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *rest]

    def _writes(self, what: str, marker: str) -> bool:
        """Whether the chat template writes system turns (Phi-3's and Gemma's drop or refuse them) or tool calls."""
        probe = [{"role": "system", "content": PROBE_SYSTEM}, *PROBE_CHAT] if what == "system" else list(PROBE_TOOL_CALL)
        try:
            text, _ = self._apply_template(probe)
        except RowProblem:
            return False
        return marker in text

    def chat_end_token(self) -> int:
        """The special token the chat template ends assistant turns with, checked on PROBE_CHAT.

        Raises ConfigError, before any data is read, when a marker the template writes
        (``<|im_start|>``) is not a single added token of the tokenizer, or when an assistant
        turn does not end with a special token: examples would then hold the marker as
        ordinary text, and the model would not learn to stop.
        """
        where = f"--chat-template with tokenizer {self.tokenizer.name}"
        try:
            text, spans = self._render(list(PROBE_CHAT), BatchRows(where), 0)
            if not _GENERATION_TAG.search(self.format.chat_template):
                spans = self._assistant_spans(list(PROBE_CHAT), text, BatchRows(where), 0, len(text), spans[-1])
        except RowProblem as problem:
            raise ConfigError(f"{where}: a plain user/assistant conversation is refused ({problem.message})") from problem
        added = self.backend.get_added_tokens_decoder()
        added_contents = {token.content for token in added.values()}
        for marker in dict.fromkeys(_MARKER.findall(text)):
            if marker not in added_contents:
                pieces = len(self.backend.encode(marker, add_special_tokens=False).ids)
                raise ConfigError(
                    f"{where}: the template writes {marker!r}, which is not a special token of the tokenizer (it would be "
                    f"packed as {pieces} ordinary tokens); use the model's own tokenizer, or add it with --special-tokens"
                )
        special = {i for i, token in added.items() if token.special}
        encoding = self.backend.encode(text, add_special_tokens=False)
        starts = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        ids = np.array(encoding.ids, dtype=np.int64)
        if not spans:
            raise ConfigError(f"{where}: the template marks no assistant turn with {{% generation %}}, so nothing is trained")
        for start, end in spans:
            inside = ids[(starts >= start) & (starts < end)]
            if not inside.size or int(inside[-1]) not in special:
                raise ConfigError(
                    f"{where}: assistant turns end with {text[start:end][-20:]!r}, not with a special token of the "
                    "tokenizer, so the model would not learn to stop; use a template that ends them with the "
                    "tokenizer's end-of-turn token (e.g. --chat-template chatml), or add it with --special-tokens"
                )
        return int(inside[-1])

    def _render(self, messages: list[dict[str, Any]], rows: BatchRows, row: int) -> tuple[str, list[tuple[int, int]]]:
        """The chat rendered as text, and the character spans the assistant turns add, each up to its
        end-of-turn token: whitespace the template writes after it is not trained on, and after the
        last turn it is left out, so the example ends with that token (ChatML's ``<|im_end|>\n``).
        Without ``{% generation %}`` only the last span is found here; ``_assistant_spans`` finds
        the others once the tokens say how much of the text is kept."""
        if _GENERATION_TAG.search(self.format.chat_template):
            text, indices = self._apply_template(messages, with_generation_spans=True)
            spans = [(int(a), int(b)) for a, b in indices]
        else:
            text, _ = self._apply_template(messages)
            last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
            spans = [self._span(messages, last, text, rows, row)]
        spans = [(start, start + len(text[start:end].rstrip())) for start, end in spans]
        if spans and not text[spans[-1][1] :].strip():
            text = text[: spans[-1][1]]
        return text, spans

    def _assistant_spans(
        self, messages: list[dict[str, Any]], text: str, rows: BatchRows, row: int, kept: int, last: tuple[int, int]
    ) -> list[tuple[int, int]]:
        """The character spans of ``text`` (the whole chat) the assistant turns add, found by rendering it
        turn by turn: those that start before character ``kept``, then ``last``, the last turn's. Rendering
        stops at ``kept``, so a long conversation truncated to ``--max-len`` costs the renders of its
        kept part, not its turn count squared."""
        spans = []
        for i in [i for i, message in enumerate(messages) if message["role"] == "assistant"][:-1]:
            span = self._span(messages, i, text, rows, row)
            if span[0] >= kept:
                break
            spans.append(span)
        return [*spans, last]

    def _span(self, messages: list[dict[str, Any]], i: int, text: str, rows: BatchRows, row: int) -> tuple[int, int]:
        """The characters of ``text`` that assistant turn ``messages[i]`` adds, without the whitespace after them."""
        before, _ = self._apply_template(messages[:i], add_generation_prompt=True)
        through, _ = self._apply_template(messages[: i + 1])
        if not (through.startswith(before) and (text.startswith(through) or through.startswith(text))):
            raise InputError(
                f"{rows.name(row)}: the chat template renders earlier turns differently once later turns are added, "
                "so assistant turns cannot be located; mark them with {% generation %} in --chat-template"
            )
        return len(before), len(before) + len(text[len(before) : len(through)].rstrip())

    def _apply_template(
        self, messages: list, add_generation_prompt: bool = False, with_generation_spans: bool = False
    ) -> tuple[str, list]:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[messages],
                chat_template=self.format.chat_template,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=with_generation_spans,
                **self.tokenizer.special_tokens(),
            )
        except TemplateError as err:
            raise RowProblem(Reason.TEMPLATE_REJECTED, f"the chat template rejected the messages: {err}") from err
        return rendered[0], indices[0] if indices else []
