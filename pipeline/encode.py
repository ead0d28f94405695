"""Turn a batch of source rows into token ids and loss masks, one tokenizer call per batch.

- prompt/response: ``[bos] prompt response [eos]``, joined by ``--prompt-template`` (default
  ``{prompt}\n\n{response}``): the prompt with the template's text before and after it, and the
  response with the text after it, are tokenized separately (in one call), so the mask boundary
  is exact. Mask 0 on BOS and prompt (1 with ``--train-on-prompt``), 1 on response and EOS. With
  ``--as-chat`` they are rendered as a user turn and an assistant turn, like chat data.
- plain text: ``[bos] text [eos]``, mask 1 on every token that can be predicted (not BOS).
- chat: the messages rendered with the chat template and tokenized whole; mask 1 on the
  characters each assistant turn adds (its content and the template's end-of-turn tokens).

BOS and EOS are what the tokenizer's own post-processor adds around one sequence, plus its
EOS token at the end when the post-processor adds nothing there.
"""

from __future__ import annotations

import array
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import InputError
from pipeline.formats import PROMPT_RESPONSE, ExampleFormat, split_prompt_template
from pipeline.shard_writer import gather_index
from pipeline.tokenizer import LoadedTokenizer

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class EncodedBatch:
    """Examples as one flat buffer: example ``i`` is ``tokens[starts[i]:starts[i] + lengths[i]]``."""

    lengths: np.ndarray  # int64 [examples]
    tokens: np.ndarray  # [sum(lengths)]: uint16 when the vocabulary fits, else int32 (see token_dtype)
    loss_mask: np.ndarray  # uint8 [sum(lengths)]

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths


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


def _first(mask: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.index(mask, True).as_py())


class Encoder:
    """Encodes tables of source rows in one format with one tokenizer; checks every value on the way."""

    def __init__(self, tokenizer: LoadedTokenizer, example_format: ExampleFormat, max_len: int, overflow: str):
        self.tokenizer = tokenizer
        self.format = example_format
        self.max_len = max_len
        self.overflow = overflow
        self.backend = tokenizer.backend()
        self.prefix, self.suffix = special_affixes(tokenizer)
        self.dtype = token_dtype(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, table: pa.Table, origin: str, first_row: int) -> EncodedBatch:
        """Tokens and loss masks of the rows of ``table``, which start at row ``first_row`` of ``origin``."""
        if self.format.as_chat:
            batch = self._encode_chat(self._as_messages(table, origin, first_row), "messages", origin, first_row)
        elif self.format.is_chat:
            batch = self._encode_chat(table.column(self.format.columns[0]).to_pylist(), self.format.columns[0], origin, first_row)
        else:
            batch = self._encode_texts(table, origin, first_row)
        empty = np.flatnonzero(batch.lengths == 0)
        if empty.size:
            raise InputError(f"{origin} row {first_row + int(empty[0])}: encodes to no tokens; remove it")
        if self.overflow == "error":
            long = np.flatnonzero(batch.lengths > self.max_len)
            if long.size:
                i = int(long[0])
                raise InputError(
                    f"{origin} row {first_row + i}: {int(batch.lengths[i])} tokens, more than --max-len {self.max_len}; "
                    "pass --overflow split, truncate or drop"
                )
        return batch

    def _texts(self, table: pa.Table, column: str, origin: str, first_row: int) -> pa.ChunkedArray:
        """The values of a text column, which must all be non-empty strings."""
        values = table.column(column)
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type) or pa.types.is_null(values.type)):
            raise InputError(f"{origin}: column {column!r} holds {values.type} values; it must hold strings")
        if values.null_count:
            row = first_row + _first(pc.is_null(values))
            raise InputError(f"{origin} row {row}: {column!r} is null; every example needs a non-empty {column!r}")
        empty = pc.equal(pc.binary_length(values), 0)
        if pc.any(empty).as_py():
            row = first_row + _first(empty)
            raise InputError(f"{origin} row {row}: {column!r} is empty; every example needs a non-empty {column!r}")
        return values

    def _pieces(self, table: pa.Table, origin: str, first_row: int) -> list[str]:
        """The texts to tokenize, column by column: for prompt/response, each joined with its part of the template."""
        columns = [self._texts(table, column, origin, first_row) for column in self.format.columns]
        if self.format.kind == PROMPT_RESPONSE:
            before, between, after = split_prompt_template(self.format.prompt_template)
            prompts, responses = columns
            columns = [pc.binary_join_element_wise(before, prompts, between, ""), pc.binary_join_element_wise(responses, after, "")]
        return [text for values in columns for text in values.to_pylist()]

    def _as_messages(self, table: pa.Table, origin: str, first_row: int) -> list[list[dict[str, str]]]:
        """Prompt/response rows as user/assistant conversations."""
        prompts, responses = (self._texts(table, column, origin, first_row).to_pylist() for column in self.format.columns)
        return [
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            for prompt, response in zip(prompts, responses)
        ]

    def _encode_texts(self, table: pa.Table, origin: str, first_row: int) -> EncodedBatch:
        n, columns = table.num_rows, len(self.format.columns)
        texts = self._pieces(table, origin, first_row)
        ids, text_lengths = token_ids(self.backend.encode_batch_fast(texts, add_special_tokens=False), self.dtype)
        # Example i is its pieces (prefix, its texts, suffix) in a row; they are gathered from
        # one buffer holding the prefix, the suffix, then every text's tokens, column by column.
        affixes = np.array(self.prefix + self.suffix, dtype=self.dtype)
        text_starts = (np.cumsum(text_lengths) - text_lengths + affixes.size).reshape(columns, n).T
        piece_starts = np.column_stack([np.zeros(n, np.int64), text_starts, np.full(n, len(self.prefix))])
        piece_lengths = np.column_stack(
            [np.full(n, len(self.prefix)), text_lengths.reshape(columns, n).T, np.full(n, len(self.suffix))]
        )
        tokens = np.concatenate([affixes, ids])[gather_index(piece_starts.ravel(), piece_lengths.ravel())]
        text_mask = [1 if self.format.train_on_prompt else 0, 1] if self.format.kind == PROMPT_RESPONSE else [1]
        piece_mask = np.tile(np.array([0, *text_mask, 1], dtype=np.uint8), n)
        return EncodedBatch(piece_lengths.sum(axis=1), tokens, np.repeat(piece_mask, piece_lengths.ravel()))

    def _encode_chat(self, conversations: list, column: str, origin: str, first_row: int) -> EncodedBatch:
        rendered, spans = [], []
        for i, messages in enumerate(conversations):
            text, assistant = self._render(messages, f"{origin} row {first_row + i}", column)
            rendered.append(text)
            spans.append(assistant)
        encodings = self.backend.encode_batch(rendered, add_special_tokens=False)
        tokens, lengths = token_ids(encodings, self.dtype)
        masks = []
        for encoding, assistant in zip(encodings, spans):
            if self.format.train_on_prompt:
                mask = np.ones(len(encoding), dtype=np.uint8)
                if self.prefix and encoding.ids[: len(self.prefix)] == self.prefix:
                    mask[: len(self.prefix)] = 0
            else:
                starts = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
                bounds = np.array(assistant, dtype=np.int64).ravel()
                # A token is trained on when its first character lies inside an assistant span.
                mask = (np.searchsorted(bounds, starts, side="right") % 2).astype(np.uint8)
            masks.append(mask)
        loss_mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
        return EncodedBatch(lengths, tokens, loss_mask)

    def _render(self, messages: object, where: str, column: str) -> tuple[str, list[tuple[int, int]]]:
        """The chat rendered as text, and the character spans the assistant turns add."""
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: {column!r} must be a non-empty list of messages")
        for message in messages:
            if not isinstance(message, dict) or not message.get("role") or not message.get("content"):
                raise InputError(f"{where}: every message needs a non-empty 'role' and 'content', got {message!r:.100}")
        if not any(m["role"] == "assistant" for m in messages):
            raise InputError(f"{where}: no assistant message, so nothing to train on; remove the example")
        template = self.format.chat_template
        if _GENERATION_TAG.search(template):
            text, indices = self._apply_template(messages, where, with_generation_spans=True)
            return text, [(int(a), int(b)) for a, b in indices]
        text, _ = self._apply_template(messages, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self._apply_template(messages[:i], where, add_generation_prompt=True)
            through, _ = self._apply_template(messages[: i + 1], where)
            if not (through.startswith(before) and text.startswith(through)):
                raise InputError(
                    f"{where}: the chat template renders earlier turns differently once later turns are added, "
                    "so assistant turns cannot be located; mark them with {% generation %} in --chat-template"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def _apply_template(
        self, messages: list, where: str, add_generation_prompt: bool = False, with_generation_spans: bool = False
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
            raise InputError(f"{where}: the chat template rejected the messages: {err}") from err
        return rendered[0], indices[0] if indices else []
