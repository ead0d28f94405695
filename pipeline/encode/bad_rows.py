"""Source rows that cannot make an example, and what ``--on-bad-row`` does with them.

Under ``error`` (the default) the first bad row stops the build with one line naming it. Under
``skip`` bad rows are left out: each is written with its reason to ``rejected.jsonl`` in the
build directory (before the manifest, so only a complete build has one), the report counts them
by reason and the manifest records the counts. ``--max-bad-rows``, a count or a fraction of the
rows read, stops a run whose data is mostly bad.

    {"where": "chats.jsonl line 7", "reason": "starts_with_assistant",
     "message": "the conversation starts with an assistant turn", "row": {"conversations": [...]}}
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pipeline import storage
from pipeline.errors import InputError
from schemas import RejectedRows

REJECTED_NAME = "rejected.jsonl"


class Reason(StrEnum):
    """Why a row cannot make an example."""

    NOT_AN_OBJECT = "not_an_object"
    NULL = "null"
    EMPTY_TEXT = "empty_text"
    NOT_A_CONVERSATION = "not_a_conversation"
    EMPTY_TURN = "empty_turn"
    UNKNOWN_ROLE = "unknown_role"
    STARTS_WITH_ASSISTANT = "starts_with_assistant"
    ROLES_NOT_ALTERNATING = "roles_not_alternating"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    ONLY_DANGLING_TURNS = "only_dangling_turns"
    NO_CHAT_TURNS = "no_chat_turns"
    BAD_TOOL_CALL = "bad_tool_call"
    BAD_WEIGHT = "bad_weight"
    ENDS_WITH_USER = "ends_with_user"
    TEMPLATE_REJECTED = "template_rejected"
    NO_TOKENS = "no_tokens"
    # Preference pairs (pipeline/encode/preference.py).
    CHOSEN_EQUALS_REJECTED = "chosen_equals_rejected"
    EMPTY_COMPLETION = "empty_completion"
    PAIR_TOO_LONG = "pair_too_long"
    NOT_A_PAIR = "not_a_pair"
    PROMPT_NOT_A_PREFIX = "prompt_not_a_prefix"


# Rows the dangling-turn policy drops whole: listed and counted like bad rows, but they are what
# splitting conversations leaves, not broken data, so they stop no build and count against no --max-bad-rows.
# A pair longer than a row is left out the same way under --overflow drop (the default of --format preference).
DROPPED_WHOLE = frozenset({Reason.ONLY_DANGLING_TURNS, Reason.NO_CHAT_TURNS, Reason.PAIR_TOO_LONG})


class RowProblem(Exception):
    """What is wrong with one row: raised while reading it, turned into a BadRow by the encoder."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class BadRow:
    """One bad row: where the user finds it, why it is bad, its values (a JSON line that is not an object: the
    value it holds) and its index in the batch read."""

    where: str
    reason: Reason
    message: str
    row: object
    batch_row: int = 0

    @property
    def is_bad(self) -> bool:
        """Whether the row is broken data, which ``--on-bad-row error`` stops on and ``--max-bad-rows`` bounds."""
        return self.reason not in DROPPED_WHOLE

    def error(self) -> InputError:
        """The error that stops a build under ``--on-bad-row error``."""
        return InputError(f"{self.where}: {self.message}; fix or remove it, or pass --on-bad-row skip to leave such rows out")

    def to_json(self) -> str:
        """One line of ``rejected.jsonl``."""
        record = {"where": self.where, "reason": str(self.reason), "message": self.message, "row": self.row}
        return json.dumps(record, ensure_ascii=False, default=str)


def bound_exceeded(bad: int, rows: int, bound: int | float) -> bool:
    """Whether ``bad`` of ``rows`` is over ``--max-bad-rows`` (a count, or a fraction when a float)."""
    return bad > bound * rows if isinstance(bound, float) else bad > bound


def worker_bound(bound: int | float, known_rows: int | None) -> int | None:
    """The bad rows one worker may meet before the whole build is known to be over ``bound``.

    A count is the count; a fraction needs the rows the build will read (None when unknown).
    """
    if isinstance(bound, int):
        return bound
    return None if known_rows is None else int(bound * known_rows)


def bound_error(bad: int, rows: int | None, bound: int | float, first: BadRow) -> InputError:
    """The error that stops a build with too many bad rows."""
    share = f"{bad:,} of {rows:,} rows read" if rows is not None else f"{bad:,} rows"
    return InputError(
        f"{share} are bad, more than --max-bad-rows {bound} (first: {first.where}: {first.message}); check the "
        "dataset and the column options, or raise --max-bad-rows"
    )


def summarize(by_reason: Counter[str]) -> RejectedRows:
    """The counts the manifest records: rows left out, by reason."""
    return RejectedRows(rows=sum(by_reason.values()), by_reason=dict(sorted(by_reason.items())))


def write_rejected(parts: Sequence[str], out_dir: str) -> None:
    """Write ``rejected.jsonl`` into the build directory from ``parts``, files of its lines in source order (each
    batch's, beside its spill file), atomically; nothing when no row was left out."""
    if not parts:
        return
    with storage.output(storage.join(out_dir, REJECTED_NAME)) as tmp, open(tmp, "wb") as f:
        for part in parts:
            f.write(storage.read_bytes(part))
