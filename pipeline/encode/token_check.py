"""Every build checks its own tokens: each example (or a seeded sample) against an independent reference.

The reference is what the tokenizer alone makes of the example, outside the build's own encoding:

- prompt/response and text: the whole text, rendered with the build's template (named fields,
  Alpaca's two layouts, the ``--system-prompt``), tokenized at once by the tokenizer alone, with
  the BOS and EOS the build puts around each example;
- chat: the tokenizer's own ``apply_chat_template(messages, tokenize=True)`` (transformers) with
  the build's chat template, less the whitespace the template writes after the last turn (a
  built chat example ends with its end-of-turn token). The messages are those the build uses:
  dangling turns dropped as ``chat.conversation`` documents, prompt/response rows (``--as-chat``)
  as a user and an assistant turn after the ``--system-prompt``, and a system turn merged into the
  first user turn (``system\\n\\nuser``) when the template writes none.

The loss mask of a prompt/response or text example is checked too, where its tokens are equal: 0 over
the BOS and the whole text's tokens that lie wholly before the response's first character, by the
tokenizer's own character offsets (a token holding that character is trained; none untrained under
``--train-on-prompt``; text examples train from their first token), 1 from there through EOS. Under
``--truncate-side left`` a cut that took response tokens is a difference. A chat example's mask is left
to the chat tests. Where the response starts (a character) comes from the same rendering the build
uses: a fault in the rendering itself is not seen by this check.

The check compares each example as encoding made it, before packing: ``--overflow split`` and
``truncate`` cut rows later, so the whole example is compared, and examples ``truncate`` left with
no trained token are not packed and not checked. Under ``--truncate-side left`` an example whose
prompt's head was cut to fit is compared with the reference less as many tokens after its BOS:
its tokens must be the whole text's last ones; where the cut falls (never in the response) is
``--truncate-side``'s own test's to show.

``first_differences`` compares the two, a pure function over token ids. A difference stops the
build with an error naming the example and showing both sequences (``--on-token-mismatch
error``, the default), or is counted in the report and the manifest (``count``); the examples
checked and equal are recorded either way (``stats.examples_checked`` / ``examples_equal``). Under
``count`` the build logs the first difference and how many differ in tokens, in the loss mask alone,
or by a cut that took response tokens (``CheckCounts.mismatch_warning``), which the manifest does not record.

Which examples are checked needs no coordination between workers: with ``--verify-tokens
sample`` (the default) an example is checked when its place in the dataset falls in a seeded
permutation's first SAMPLE_SIZE places, so exactly that many rows of a dataset of known size are
checked, wherever they are read; ``all`` checks every example and ``off`` none.

>>> built, reference = np.array([1, 5, 6, 2, 1, 7, 2]), np.array([1, 5, 6, 2, 1, 7, 7, 2])
>>> first_differences(built, np.array([4, 3]), reference, np.array([4, 4])).tolist()
[-1, 2]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import OnTokenMismatch
from pipeline.encode.bad_rows import RowProblem
from pipeline.encode.chat import conversation
from pipeline.encode.examples import ENCODE_CHUNK, PROBE_CHAT, PROBE_SYSTEM, EncodedBatch, token_ids
from pipeline.encode.tokenizer import LoadedTokenizer
from pipeline.errors import TokenMismatchError
from pipeline.ranges import gather_index
from pipeline.read.formats import ExampleFormat
from pipeline.read.readers import BatchRows, select_columns
from schemas import ExampleKind

# Examples a sampled check covers (all of them in a smaller dataset).
SAMPLE_SIZE = 1000
# Tokens shown on each side of the first difference in a mismatch message.
CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class CheckCounts:
    """Examples of a batch checked and found equal to the reference; of the others, those whose tokens equal it but
    whose loss mask does not and those whose head's cut (``--truncate-side left``) took response tokens; and the
    first one that differs (its message). Only the examples checked and equal go into the manifest: the others'
    kinds are for the warning the build logs."""

    checked: int = 0
    equal: int = 0
    mask_only: int = 0
    response_cut: int = 0
    first_mismatch: str | None = None

    @classmethod
    def summed(cls, counts: Iterable[CheckCounts]) -> CheckCounts:
        """The counts of batches in source order; the first difference is the earliest batch's."""
        counts = list(counts)
        return cls(
            sum(c.checked for c in counts), sum(c.equal for c in counts), sum(c.mask_only for c in counts),
            sum(c.response_cut for c in counts), next((c.first_mismatch for c in counts if c.first_mismatch), None),
        )

    def mismatch_warning(self) -> str | None:
        """What a build under ``--on-token-mismatch count`` logs of the examples that differ: how many, how they
        differ, and the first; None when none does.

        >>> print(CheckCounts(10, 7, mask_only=2, first_mismatch="row 4: ...").mismatch_warning())
        3 of 10 examples checked differ from the token check's reference (1 in tokens, 2 in the loss mask only); the first, row 4: ...
        """
        if self.first_mismatch is None:
            return None
        tokens = self.checked - self.equal - self.mask_only - self.response_cut
        kinds = [
            f"{count:,} {kind}"
            for count, kind in [(tokens, "in tokens"), (self.mask_only, "in the loss mask only"),
                                (self.response_cut, "with response tokens cut by --truncate-side left")]
            if count
        ]
        differ = self.checked - self.equal
        return (
            f"{differ:,} of {self.checked:,} example{'s' * (self.checked != 1)} checked differ{'s' * (differ == 1)} from the "
            f"token check's reference ({', '.join(kinds)}); the first, {self.first_mismatch}"
        )


def first_differences(
    built: np.ndarray, built_lengths: np.ndarray, reference: np.ndarray, reference_lengths: np.ndarray
) -> np.ndarray:
    """For each example, the index of its first token that differs from the reference, or -1 when they are equal.

    Both sides are flat token arrays, example ``i`` being the next ``lengths[i]`` tokens. A
    sequence that is a prefix of the other differs at the shorter one's length.
    """
    common = np.minimum(built_lengths, reference_lengths)
    built_starts = np.cumsum(built_lengths) - built_lengths
    reference_starts = np.cumsum(reference_lengths) - reference_lengths
    unequal = built[gather_index(built_starts, common)].astype(np.int64) != reference[
        gather_index(reference_starts, common)
    ].astype(np.int64)
    found = np.where(built_lengths == reference_lengths, -1, common)
    at = np.flatnonzero(unequal)
    examples, first = np.unique(np.repeat(np.arange(common.size), common)[at], return_index=True)
    found[examples] = (at[first] - (np.cumsum(common) - common)[examples])
    return found


def completion_mask(lengths: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """The loss mask of sequences of ``lengths`` tokens, back to back, each trained after its first ``prompt`` tokens.

    >>> completion_mask(np.array([4, 3]), np.array([2, 1])).tolist()
    [0, 0, 1, 1, 0, 1, 1]
    """
    starts = np.cumsum(lengths) - lengths
    position = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    return (position >= np.repeat(prompt, lengths)).astype(np.uint8)


def _flat(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists as one flat array and their lengths."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    return np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum())), lengths


def tokens_before(
    backend: Any, texts: list[str], trained_from: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The tokens of each of ``texts`` tokenized whole, without special tokens (flat, and how many each text has), and
    how many of them end at or before its character ``trained_from`` (none where that is 0; None without it).

    One tokenization serves both, ENCODE_CHUNK texts at a time; character offsets are asked for only where a text of
    the chunk has a character before the one it is trained from.
    """
    parts = []
    before = np.zeros(len(texts), np.int64)
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = texts[start : start + ENCODE_CHUNK]
        trained = None if trained_from is None else trained_from[start : start + ENCODE_CHUNK]
        if trained is None or not trained.any():
            parts.append(token_ids(backend.encode_batch_fast(chunk, add_special_tokens=False), np.dtype(np.int64)))
            continue
        encodings = backend.encode_batch(chunk, add_special_tokens=False)
        ids, lengths = token_ids(encodings, np.dtype(np.int64))
        offsets = itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encodings))
        ends = np.fromiter(offsets, np.int64, count=2 * ids.size)[1::2]
        limit = np.repeat(trained, lengths)
        text = np.repeat(np.arange(len(chunk)), lengths)
        before[start : start + len(chunk)] = np.bincount(text[(ends <= limit) & (limit > 0)], minlength=len(chunk))
        parts.append((ids, lengths))
    ids = np.concatenate([part[0] for part in parts]) if parts else np.zeros(0, np.int64)
    lengths = np.concatenate([part[1] for part in parts]) if parts else np.zeros(0, np.int64)
    return ids, lengths, None if trained_from is None else before


def sample_mask(example_ids: np.ndarray, known_examples: int | None, seed: int, size: int = SAMPLE_SIZE) -> np.ndarray:
    """Whether each example (by its place in the dataset, ``0 .. known_examples - 1``) is in the seeded sample.

    The sample is the examples an affine permutation of the places, ``(a * id + b) mod N`` with
    ``a`` prime to ``N``, sends below ``size``: exactly ``min(size, N)`` places. Without a known
    ``N``, the first ``size`` places of each read task (``example_ids`` then count within it).
    """
    if known_examples is None:
        return example_ids < size
    n = max(known_examples, 1)
    if n <= size:
        return np.ones(example_ids.size, dtype=bool)
    rng = np.random.default_rng(seed)
    a = int(rng.integers(1, min(n, 1 << 31)))
    while math.gcd(a, n) != 1:
        a += 1
    b = int(rng.integers(0, n))
    places = (example_ids.astype(np.uint64) * np.uint64(a) + np.uint64(b)) % np.uint64(n)
    return places < size


def merged_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a leading system turn merged into the first user turn, ``system\\n\\nuser``.

    >>> merged_system([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    [{'role': 'user', 'content': 'Be brief.\\n\\nHi'}]
    """
    if not messages or messages[0]["role"] != "system":
        return messages
    system, user, *rest = messages
    return [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *rest]


class TokenChecker:
    """Checks the examples of encoded batches against the reference tokenization, batch by batch."""

    def __init__(self, tokenizer: LoadedTokenizer, example_format: ExampleFormat, on_mismatch: str):
        self.tokenizer = tokenizer
        self.format = example_format
        self.on_mismatch = on_mismatch
        self.backend = tokenizer.backend()
        self._chat_tokenizer: Any = None
        self._writes_system: bool | None = None

    def check(self, table: pa.Table, rows: BatchRows, batch: EncodedBatch, selected: np.ndarray) -> CheckCounts:
        """Compare the examples of ``batch`` (encoded from ``table``) for which boolean ``selected`` is true.

        Raises TokenMismatchError for the first that differs under ``--on-token-mismatch error``.
        """
        examples = np.flatnonzero(selected)
        if not examples.size:
            return CheckCounts()
        source_rows = batch.example_rows[examples]
        selected_table = select_columns(table, self.format.columns, rows.origin).take(pa.array(source_rows))
        reference, reference_lengths, untrained_from = self.reference(selected_table)
        built, lengths = self.sequences(batch, examples)
        # Each sequence's example: one each, or two for a preference pair (``preference.PairTokenChecker``).
        source_rows = np.repeat(source_rows, lengths.size // examples.size)
        cut = np.zeros(lengths.size, np.int64)
        if self.format.keep_response and not self.format.is_chat:
            whole_lengths = reference_lengths
            reference, reference_lengths = self.without_cut_heads(reference, reference_lengths, lengths)
            cut = whole_lengths - reference_lengths
        differences = first_differences(built, lengths, reference, reference_lengths)
        # The loss mask is compared where the tokens are equal, and where the reference says where the prompt ends
        # (less the prompt tokens a cut head took, never the prefix).
        prefix = len(self.tokenizer.prefix_ids)
        # A cut head leaves the response whole: one that took response tokens left fewer prompt tokens than none.
        response_cut = np.zeros(lengths.size, np.int64)
        if untrained_from is not None:
            if not self.format.train_on_prompt:  # (its reference prompt is the prefix alone: no cut to compare)
                response_cut = np.maximum(prefix - (untrained_from - cut), 0)
            untrained_from = np.maximum(untrained_from - cut, prefix)
        mask_differences = np.full(lengths.size, -1)
        if untrained_from is not None:
            same = np.flatnonzero(differences < 0)
            built_masks = self.loss_masks(batch, examples)[gather_index((np.cumsum(lengths) - lengths)[same], lengths[same])]
            expected = completion_mask(lengths[same], untrained_from[same])
            mask_differences[same] = first_differences(built_masks, lengths[same], expected, lengths[same])
        differ = np.flatnonzero((differences >= 0) | (mask_differences >= 0) | (response_cut > 0))
        first = None
        if differ.size:
            i = int(differ[0])
            ours = built[int(lengths[:i].sum()) :][: int(lengths[i])].tolist()
            if differences[i] >= 0:
                theirs = reference[int(reference_lengths[:i].sum()) :][: int(reference_lengths[i])].tolist()
                first = self.describe(rows.name(int(source_rows[i])), ours, theirs, int(differences[i]))
            elif response_cut[i] > 0:
                first = (f"{rows.name(int(source_rows[i]))}: its tokens are the whole text's last ones, but the cut of its "
                         f"head (--truncate-side left) took the first {int(response_cut[i])} tokens of its response, which "
                         f"a cut must leave whole; {self.what_then()}")
            else:
                assert untrained_from is not None
                first = self.describe_mask(rows.name(int(source_rows[i])), ours, int(untrained_from[i]), int(mask_differences[i]))
            if self.on_mismatch == OnTokenMismatch.ERROR:
                raise TokenMismatchError(first)
        # Each unequal example (a preference pair: both its sequences) is counted once, under the first kind it shows
        # of: tokens, a response cut, the loss mask alone; the same order as its message's.
        per_example = lengths.size // examples.size
        unequal = np.unique(differ // per_example).size
        tokens_unequal = np.unique(np.flatnonzero(differences >= 0) // per_example).size
        cut_or_tokens = np.unique(np.flatnonzero((differences >= 0) | (response_cut > 0)) // per_example).size
        return CheckCounts(
            int(examples.size), int(examples.size - unequal), int(unequal - cut_or_tokens), int(cut_or_tokens - tokens_unequal),
            first,
        )

    def sequences(self, batch: EncodedBatch, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The built token sequences of ``examples`` (indices into ``batch``) to compare, flat, and their lengths."""
        lengths = batch.lengths[examples]
        return batch.tokens[gather_index(batch.starts[examples], lengths)], lengths

    def loss_masks(self, batch: EncodedBatch, examples: np.ndarray) -> np.ndarray:
        """The loss mask of the sequences ``sequences`` gives, flat, in the same order."""
        return batch.loss_mask[gather_index(batch.starts[examples], batch.lengths[examples])]

    def prompt_lengths(self, table: pa.Table) -> np.ndarray | None:
        """For each sequence of the rows of ``table`` whose rendering (``rendered_texts``) does not say where its
        response starts, where the reference says its prompt ends. None here: the check leaves a chat example's loss
        mask to the chat tests."""
        return None

    def reference(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The reference of the rows of ``table`` (the format's columns, rows that made examples): its tokens as one
        flat array, each sequence's length, and where each sequence's prompt ends (its loss mask must be 0 before and
        1 from there; None where the check leaves the loss mask to the tests of its kind).

        Prompt/response and text: the prefix (the BOS), the whole text's tokens and the suffix (the EOS); the prompt
        is the prefix and the tokens that lie wholly before the character where the response starts (the tokenizer's
        own character offsets; 0 for text), none under ``--train-on-prompt``. A token holding the response's first
        character is trained."""
        if self.format.is_chat:
            return *_flat([self._chat_reference(messages) for messages in self._conversations(table)]), self.prompt_lengths(table)
        texts, trained_from = self.rendered_texts(table)
        if trained_from is not None and self.format.train_on_prompt:
            trained_from = np.zeros(len(texts), np.int64)
        # The tokenizer alone, each text whole: none of the encoder's cutting into pieces or boundaries.
        ids, lengths, before = tokens_before(self.backend, texts, trained_from)
        prefix, suffix = self.tokenizer.prefix_ids, self.tokenizer.suffix_ids
        # Each example is the prefix, its text's tokens and the suffix, gathered from one buffer.
        buffer = np.concatenate([np.array(prefix + suffix, dtype=np.int64), ids])
        n = lengths.size
        piece_starts = np.column_stack(
            [np.zeros(n, np.int64), np.cumsum(lengths) - lengths + len(prefix) + len(suffix), np.full(n, len(prefix))]
        )
        piece_lengths = np.column_stack([np.full(n, len(prefix)), lengths, np.full(n, len(suffix))])
        prompts = self.prompt_lengths(table) if before is None else len(prefix) + before
        return buffer[gather_index(piece_starts.ravel(), piece_lengths.ravel())], piece_lengths.sum(axis=1), prompts

    def without_cut_heads(
        self, reference: np.ndarray, reference_lengths: np.ndarray, built_lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The reference of examples ``--truncate-side left`` shortened, less as many tokens after its
        prefix (the BOS) as the built example is shorter: what the cut example must then equal."""
        cut = np.maximum(reference_lengths - built_lengths, 0)
        head = np.minimum(reference_lengths, len(self.tokenizer.prefix_ids))
        starts = np.cumsum(reference_lengths) - reference_lengths
        piece_starts = np.column_stack([starts, starts + head + cut]).ravel()
        piece_lengths = np.column_stack([head, reference_lengths - head - cut]).ravel()
        return reference[gather_index(piece_starts, piece_lengths)], reference_lengths - cut

    def rendered_texts(self, table: pa.Table) -> tuple[list[str], np.ndarray | None]:
        """Each prompt/response or text example as one whole text: the template's rendering of its fields (and the
        system prompt), prompt and response joined; and the character where each one's response starts (0 for text).
        """
        return self.format.example_kind.render_text(table)

    def _conversations(self, table: pa.Table) -> list[list[dict[str, Any]]]:
        """The messages each example is made of, after the transformations the build documents."""
        if self.format.kind != ExampleKind.CHAT:
            prompts, responses = (table.column(column).to_pylist() for column in self.format.columns)
            system = [] if self.format.system_prompt is None else [{"role": "system", "content": self.format.system_prompt}]
            chats = [[*system, {"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
        else:
            try:
                values = table.column(self.format.columns[0]).to_pylist()
                chats = [conversation(value, self.format.drop_dangling_turns).messages for value in values]
            except RowProblem as problem:  # the encoder took these rows, so it is the two that disagree
                raise TokenMismatchError(
                    f"a conversation the build encoded is refused by the reference: {problem.message}"
                ) from problem
        return self.with_system_merged(chats)

    def with_system_merged(self, chats: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
        """``chats`` with a system turn merged into the first user turn where the template writes none."""
        if self.writes_system_turns():
            return chats
        return [merged_system(messages) for messages in chats]

    def writes_system_turns(self) -> bool:
        """Whether the chat template writes a system turn, tried once through ``apply_chat_template``: one
        that leaves it out or refuses it (Gemma's, Phi-3's) gets it merged into the first user turn."""
        if self._writes_system is None:
            from jinja2 import TemplateError

            probe = [{"role": "system", "content": PROBE_SYSTEM}, *PROBE_CHAT]
            try:
                text = self.chat_tokenizer().apply_chat_template(probe, chat_template=self.format.chat_template, tokenize=False)
                self._writes_system = PROBE_SYSTEM in text
            except TemplateError:
                self._writes_system = False
        return self._writes_system

    def _chat_reference(self, messages: list[dict[str, str]]) -> list[int]:
        """``apply_chat_template(messages, tokenize=True)``, less the whitespace-only tokens after the last turn."""
        ids = list(
            self.chat_tokenizer().apply_chat_template(
                messages, chat_template=self.format.chat_template, tokenize=True, return_dict=False
            )
        )
        while ids and not self.backend.decode(ids[-1:], skip_special_tokens=False).strip():
            ids.pop()
        return ids

    def chat_tokenizer(self) -> Any:
        """The tokenizer as transformers' ``PreTrainedTokenizerFast``, made once: it holds ``apply_chat_template``."""
        if self._chat_tokenizer is None:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            self._chat_tokenizer = PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer.from_str(self.tokenizer.serialized), **self.tokenizer.special_tokens()
            )
        return self._chat_tokenizer

    def describe(self, example: str, built: list[int], reference: list[int], at: int) -> str:
        """The mismatch message: the example, then the built and the reference tokens around the first
        difference and their decoded text, one line each."""
        low, high = max(0, at - CONTEXT_TOKENS), at + CONTEXT_TOKENS

        def window(ids: list[int]) -> str:
            shown = ", ".join(map(str, ids[low:high]))
            return ("..., " if low else "") + shown + (", ..." if len(ids) > high else "")

        def text(ids: list[int]) -> str:
            return repr(self.backend.decode(ids[low:high], skip_special_tokens=False))

        return (
            f"{example}: its tokens differ from the {self.reference_name()} at token {at} "
            f"({len(built)} tokens built, {len(reference)} in the reference); {self.what_then()}\n"
            f"  built:          [{window(built)}]\n"
            f"  reference:      [{window(reference)}]\n"
            f"  built text:     {text(built)}\n"
            f"  reference text: {text(reference)}"
        )

    def describe_mask(self, example: str, built: list[int], prompt: int, at: int) -> str:
        """The message of a loss mask the reference contradicts at token ``at``: the prompt is ``prompt`` tokens."""
        wrong = "trains a prompt token" if at < prompt else "leaves a completion token untrained"
        return (
            f"{example}: its tokens equal the {self.reference_name()}, but its loss mask {wrong} at token {at} (the "
            f"reference's prompt is its first {prompt} of {len(built)} tokens, each later one trained); {self.what_then()}\n"
            f"  token {at}:       {built[at]} {self.backend.decode(built[at : at + 1], skip_special_tokens=False)!r}"
        )

    def what_then(self) -> str:
        """What a difference does under ``--on-token-mismatch``, for its message: stop the build, or be counted."""
        if self.on_mismatch == OnTokenMismatch.ERROR:
            return "pass --on-token-mismatch count to pack anyway and count such examples"
        return "packed as built and counted (--on-token-mismatch count)"

    def reference_name(self) -> str:
        """What the examples are checked against, for messages and the report."""
        if self.format.is_chat:
            return "tokenizer's apply_chat_template"
        return "whole text tokenized at once"
