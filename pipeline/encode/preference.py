"""Preference pairs: a prompt, a chosen and a rejected completion, tokenized and laid out for one row.

Each completion is tokenized whole with its prompt, as SFT tokenizes an example: ``[bos] prompt
completion [eos]`` rendered with ``--prompt-template``, or the chat template's rendering of the
conversation, ending with the completion's end-of-turn token. The prompt alone is tokenized too
(a chat prompt with the generation prompt added), and must be where each whole sequence starts:
a template that renders the prompt differently once a completion follows, or a tokenizer that
merges the prompt's last characters with the completion's first, gives no exact split, and the
pair is a bad row (``prompt_not_a_prefix``) rather than a wrong one.

A pair becomes one item for the packer, its tokens in its layout, each token with its role:

- ``separate``: ``P + C`` (role 1), ``P + R`` (role 2);
- ``shared-prompt``: ``P[:-1]`` (role 0), ``P[-1:] + C`` (1), ``P[-1:] + R`` (2); the prompt's last
  token heads each branch, so the logit that predicts a completion's first token is the branch's.
  A prompt of one token leaves no prompt segment: such a pair is written in the separate shape.

The loss mask is 1 on the completions' tokens (their EOS or end-of-turn token included), never on
a prompt token. A prompt of 2 tokens, completions of 2 and 1 (EOS = 2)::

    separate:       [5, 6, 7, 2 | 5, 6, 2]   roles [1, 2]      mask [0, 0, 1, 1 | 0, 0, 1]
    shared-prompt:  [5 | 6, 7, 2 | 6, 2]     roles [0, 1, 2]   mask [0 | 0, 1, 1 | 0, 1]

Bad pairs, left out and listed in ``rejected.jsonl`` with their reason: chosen equal to rejected,
an empty completion, conversations that do not end in one assistant turn after shared turns
(``not_a_pair``), a prompt that is not a prefix, and under ``--overflow drop`` (the default) a pair
longer than a row, measured in its layout. The rows SFT refuses are refused here too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.encode.bad_rows import Reason, RowProblem
from pipeline.encode.chat import conversation, data_text
from pipeline.encode.examples import ENCODE_CHUNK, EncodedBatch, Encoder, encode_ids, token_ids
from pipeline.encode.token_check import TokenChecker
from pipeline.errors import InputError
from pipeline.ranges import gather_index
from pipeline.read.readers import BatchRows
from schemas import Overflow, PreferenceLayout, Role

Problems = dict[int, tuple[Reason, str]]


class PairEncoder(Encoder):
    """Encodes rows of preference pairs: the Encoder of SFT, whose kinds hand it pairs (``read/kinds.py``)."""

    def __init__(self, *args: Any, layout: str = PreferenceLayout.SEPARATE, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.layout = layout

    def encode_text_pairs(
        self, prompts: list[str], chosen: list[str | None], rejected: list[str | None], rows: BatchRows, source_rows: np.ndarray
    ) -> tuple[EncodedBatch, Problems]:
        """Pairs of texts: the rendered prompt, and each completion as the template renders it (None: blank)."""
        problems = _completion_problems(chosen, rejected)
        good = [i for i in range(len(prompts)) if i not in problems]
        texts = [text for i in good for text in (prompts[i], prompts[i] + chosen[i], prompts[i] + rejected[i])]  # type: ignore[operator]
        ids, lengths = encode_ids(self.backend, texts, self.dtype, self.piece_chars)
        prefix, suffix = np.array(self.prefix, self.dtype), np.array(self.suffix, self.dtype)
        # Each sequence with its affixes: the prompt with the prefix, each whole sequence with both.
        starts = np.cumsum(lengths) - lengths
        affixes = np.concatenate([prefix, suffix])
        buffer = np.concatenate([affixes, ids])
        n = lengths.size
        with_suffix = np.tile([0, 1, 1], n // 3).astype(bool)
        piece_starts = np.column_stack([np.zeros(n, np.int64), starts + affixes.size, np.full(n, prefix.size)])
        piece_lengths = np.column_stack([np.full(n, prefix.size), lengths, np.where(with_suffix, suffix.size, 0)])
        tokens = buffer[gather_index(piece_starts.ravel(), piece_lengths.ravel())]
        return self._pairs(tokens, piece_lengths.sum(axis=1), good, problems, rows, source_rows)

    def encode_message_pairs(
        self, chosen: list, rejected: list, rows: BatchRows, source_rows: np.ndarray
    ) -> tuple[EncodedBatch, Problems]:
        """Pairs of conversations: their shared leading turns are the prompt, each one's last turn its completion."""
        label = "/".join(self.format.columns)
        problems: Problems = {}
        texts, good, data = [], [], []
        for i, (chosen_value, rejected_value) in enumerate(zip(chosen, rejected)):
            try:
                rendered, turns = self._render_pair(chosen_value, rejected_value, rows, int(source_rows[i]))
            except RowProblem as problem:
                problems[i] = (problem.reason, f"{label!r}: {problem.message}")
                continue
            texts += rendered
            good.append(i)
            data.append(data_text([*turns[0], turns[1][-1]]))  # the prompt's turns once, and both completions
        encodings = [
            encoding for start in range(0, len(texts), ENCODE_CHUNK)
            for encoding in self.backend.encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)
        ]
        tokens, lengths = token_ids(encodings, self.dtype)
        batch, problems = self._pairs(tokens, lengths, good, problems, rows, source_rows)
        if self.kind.messages_columns:  # the messages' own text, as chat examples count it; --as-chat pairs by their columns
            kept = [k for k, i in enumerate(good) if i not in problems]
            texts_kept = pa.array([data[k] for k in kept], pa.large_string())
            self._count_special_text(texts_kept, lambda k: rows.name(int(source_rows[good[kept[k]]])), batch.special_text)
        return batch, problems

    def _render_pair(self, chosen: Any, rejected: Any, rows: BatchRows, row: int) -> tuple[list[str], list[list[dict]]]:
        """The prompt with the generation prompt, and the whole conversation of each completion, as the chat template
        renders them, and the two conversations' turns; raises RowProblem for a row that is no pair."""
        for value in (chosen, rejected):
            if _blank_completion(value):
                raise RowProblem(Reason.EMPTY_COMPLETION, "a completion (the last turn) is empty")
        conversations = [conversation(value, self.format.drop_dangling_turns) for value in (chosen, rejected)]
        for chat in conversations:
            self._check_tool_calls(chat, rows, row)
        turns = [self._with_system_merged(chat.messages) for chat in conversations]
        if turns[0] == turns[1]:
            raise RowProblem(Reason.CHOSEN_EQUALS_REJECTED, "the chosen and the rejected conversations are equal")
        shared = next((k for k, (a, b) in enumerate(zip(*turns)) if a != b), min(map(len, turns)))
        if shared == 0 or any(len(messages) != shared + 1 or messages[-1]["role"] != "assistant" for messages in turns):
            raise RowProblem(
                Reason.NOT_A_PAIR,
                "chosen and rejected must be the same leading turns (the prompt) then one assistant turn each",
            )
        prompt, _ = self._apply_template(turns[0][:shared], add_generation_prompt=True)
        texts = [prompt]
        for messages in turns:
            text, _ = self._apply_template(messages)
            if not text.startswith(prompt):
                raise RowProblem(
                    Reason.PROMPT_NOT_A_PREFIX,
                    "the chat template renders the prompt differently once a completion follows, so the pair has no "
                    "exact prompt/completion split",
                )
            # Ending with the completion's end-of-turn token, as a chat example does: whitespace after it is left out.
            texts.append(prompt + text[len(prompt) :].rstrip())
        return texts, turns

    def _pairs(
        self, tokens: np.ndarray, lengths: np.ndarray, good: list[int], problems: Problems, rows: BatchRows,
        source_rows: np.ndarray,
    ) -> tuple[EncodedBatch, Problems]:
        """The pairs ``good`` (row indices) from their sequences (prompt, prompt + chosen, prompt + rejected, each
        ``lengths[i]`` of ``tokens``) laid out for a row; ``problems`` with the pairs left out here added."""
        sizes = lengths.reshape(-1, 3)
        starts = (np.cumsum(lengths) - lengths).reshape(-1, 3)
        prompt = sizes[:, 0]
        # The prompt's tokens must start both whole sequences.
        both = np.minimum(prompt[:, None], sizes[:, 1:])
        index = gather_index(starts[:, 1:].ravel(), both.ravel())
        expected = tokens[gather_index(np.repeat(starts[:, 0], 2), both.ravel())]
        owner = np.repeat(np.arange(both.size) // 2, both.ravel())
        differs = np.bincount(owner[tokens[index] != expected], minlength=len(good)) > 0
        split = ~differs & np.all(sizes[:, 1:] > prompt[:, None], axis=1)
        same = _same_tokens(tokens, starts[:, 1], starts[:, 2], sizes[:, 1], sizes[:, 2])
        shared = self.layout == PreferenceLayout.SHARED_PROMPT
        head = np.maximum(prompt - 1, 0) if shared else np.zeros_like(prompt)
        pair_lengths = sizes[:, 1] + sizes[:, 2] - head
        fits = pair_lengths <= self.max_len
        for k in np.flatnonzero(~(split & fits) | same).tolist():
            problems[good[k]] = self._pair_problem(
                bool(differs[k]), bool(split[k]), bool(same[k]), int(pair_lengths[k]), rows, source_rows[good[k]]
            )
        keep = split & fits & ~same
        # Runs of each kept pair: its prompt segment, then per branch the prompt's repeated part and the completion.
        runs = np.column_stack([head, prompt - head, sizes[:, 1] - prompt, prompt - head, sizes[:, 2] - prompt])[keep]
        pieces = np.column_stack([starts[:, 1], starts[:, 1] + head, starts[:, 2] + head])[keep]
        piece_lengths = np.column_stack([head, sizes[:, 1] - head, sizes[:, 2] - head])[keep]
        laid_out = tokens[gather_index(pieces.ravel(), piece_lengths.ravel())]
        k = runs.shape[0]
        mask = np.repeat(np.tile(np.array([0, 0, 1, 0, 1], np.uint8), k), runs.ravel())
        run_roles = np.array([Role.PROMPT, Role.CHOSEN, Role.CHOSEN, Role.REJECTED, Role.REJECTED], np.uint8)
        roles = np.repeat(np.tile(run_roles, k), runs.ravel())
        batch = EncodedBatch(pair_lengths[keep].astype(np.int64), laid_out, mask, roles=roles)
        # Pairs are encoded in row order; the encoder leaves out the rows of ``problems`` to match.
        return batch, problems

    def _pair_problem(
        self, differs: bool, split: bool, same: bool, length: int, rows: BatchRows, row: int
    ) -> tuple[Reason, str]:
        """Why a pair cannot be laid out; under ``--overflow error`` a pair too long stops the build."""
        if differs:
            return (
                Reason.PROMPT_NOT_A_PREFIX,
                "the prompt's tokens differ from the first tokens of prompt + completion tokenized together (the "
                "tokenizer merges across the boundary), so the pair has no exact prompt/completion split",
            )
        if not split:
            return Reason.EMPTY_COMPLETION, "a completion adds no token after the prompt"
        if same:
            return (
                Reason.CHOSEN_EQUALS_REJECTED,
                "the chosen and the rejected completions differ in their text but not in their tokens (the template "
                "or the tokenizer makes them one), so the pair prefers nothing",
            )
        if self.overflow == Overflow.ERROR:
            raise InputError(
                f"{rows.name(row)}: the pair is {length} tokens in the {self.layout} layout, more than --max-len "
                f"{self.max_len}; a pair is never split: pass --overflow drop to leave such pairs out, or a larger --max-len"
            )
        return Reason.PAIR_TOO_LONG, f"the pair is {length} tokens in the {self.layout} layout, more than --max-len {self.max_len}"


def _same_tokens(tokens: np.ndarray, a: np.ndarray, b: np.ndarray, a_lengths: np.ndarray, b_lengths: np.ndarray) -> np.ndarray:
    """Whether sequence ``tokens[a[i] : a[i] + a_lengths[i]]`` equals the one at ``b[i]``, for each ``i``.

    >>> _same_tokens(np.array([5, 6, 5, 6, 5, 7]), np.array([0, 0]), np.array([2, 4]), np.array([2, 2]), np.array([2, 2]))
    array([ True, False])
    """
    same = a_lengths == b_lengths
    lengths = np.where(same, a_lengths, 0)
    owner = np.repeat(np.arange(lengths.size), lengths)
    unequal = tokens[gather_index(a, lengths)] != tokens[gather_index(b, lengths)]
    return same & (np.bincount(owner[unequal], minlength=lengths.size) == 0)


def _completion_problems(chosen: list[str | None], rejected: list[str | None]) -> Problems:
    """Text pairs with a blank completion, or with chosen equal to rejected, by index."""
    problems: Problems = {}
    for i, (a, b) in enumerate(zip(chosen, rejected)):
        if a is None or b is None:
            problems[i] = (Reason.EMPTY_COMPLETION, f"the {'chosen' if a is None else 'rejected'} completion is empty")
        elif a == b:
            problems[i] = (Reason.CHOSEN_EQUALS_REJECTED, "the chosen and the rejected completions are equal")
    return problems


def _blank_completion(value: Any) -> bool:
    """Whether a conversation's last turn (``{role, content}`` or ShareGPT's ``{from, value}``) has no text and no tool call."""
    if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
        return False
    last = value[-1]
    text = last.get("content") if last.get("content") is not None else last.get("value")
    return not (text or "").strip() and not last.get("tool_calls")


class PairTokenChecker(TokenChecker):
    """Checks each stored prompt + completion of a pair against the reference of that whole sequence: the text
    tokenized at once, or the tokenizer's ``apply_chat_template`` of the whole conversation."""

    def sequences(self, batch: EncodedBatch, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's prompt + chosen and prompt + rejected as stored, one after the other: a branch holds the
        prompt's tokens it does not share (``roles``), so each is its prompt segment's tokens and its own."""
        index, lengths = self._whole_sequences(batch, examples)
        return batch.tokens[index], lengths

    def loss_masks(self, batch: EncodedBatch, examples: np.ndarray) -> np.ndarray:
        """The loss mask of each whole sequence ``sequences`` gives."""
        return batch.loss_mask[self._whole_sequences(batch, examples)[0]]

    def _whole_sequences(self, batch: EncodedBatch, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where in ``batch`` the tokens of each pair's prompt + chosen and prompt + rejected lie, and their lengths."""
        if batch.roles is None:
            raise ValueError("preference pairs carry their tokens' roles")
        lengths = batch.lengths[examples]
        index = gather_index(batch.starts[examples], lengths)
        roles = batch.roles[index]
        pair = np.repeat(np.arange(examples.size), lengths)
        chosen, rejected = np.flatnonzero(roles != Role.REJECTED), np.flatnonzero(roles != Role.CHOSEN)
        keys = np.concatenate([2 * pair[chosen], 2 * pair[rejected] + 1])
        order = np.argsort(keys, kind="stable")
        return index[np.concatenate([chosen, rejected])[order]], np.bincount(keys, minlength=2 * examples.size)

    def prompt_lengths(self, table: pa.Table) -> np.ndarray:
        """Where each whole sequence's prompt ends in the reference: the prompt alone, tokenized as the text's head
        (with the BOS), or ``apply_chat_template`` of the shared turns with the generation prompt."""
        if self.format.is_chat:
            prompts = [
                len(self.chat_tokenizer().apply_chat_template(
                    chat[:-1], chat_template=self.format.chat_template, tokenize=True, add_generation_prompt=True,
                    return_dict=False,
                ))
                for chat in self._conversations(table)[::2]
            ]
            return np.repeat(np.array(prompts, np.int64), 2)
        template, system = self.format.prompt_response(), self.format.system_prompt or ""
        prompt, chosen, _ = table.columns
        texts = template.render(pa.table([prompt, chosen], names=["p", "c"]), system)[0].to_pylist()
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.array([len(encoding.ids) for encoding in encodings], np.int64) + len(self.tokenizer.prefix_ids)
        return np.repeat(lengths, 2)

    def rendered_texts(self, table: pa.Table) -> tuple[list[str], None]:
        """Prompt + chosen and prompt + rejected of each pair, rendered whole by the template (where each prompt
        ends is ``prompt_lengths``'s)."""
        template, system = self.format.prompt_response(), self.format.system_prompt or ""
        prompt, chosen, rejected = table.columns
        texts = []
        for completion in (chosen, rejected):
            parts = template.render(pa.table([prompt, completion], names=["p", "c"]), system)
            texts.append([p + c for p, c in zip(parts[0].to_pylist(), parts[1].to_pylist())])
        return [text for pair in zip(*texts) for text in pair], None

    def _conversations(self, table: pa.Table) -> list[list[dict[str, Any]]]:
        """The chosen and the rejected conversation of each pair, whole."""
        if self.format.as_chat:
            prompt, chosen, rejected = (column.to_pylist() for column in table.columns)
            system = [] if self.format.system_prompt is None else [{"role": "system", "content": self.format.system_prompt}]
            chats = [
                [*system, {"role": "user", "content": p}, {"role": "assistant", "content": c}]
                for p, pair in zip(prompt, zip(chosen, rejected)) for c in pair
            ]
        else:
            values = [value for pair in zip(*(column.to_pylist() for column in table.columns)) for value in pair]
            chats = [conversation(value, self.format.drop_dangling_turns).messages for value in values]
        return self.with_system_merged(chats)
