"""Chat rows as they exist: ``{role, content}`` messages or ShareGPT's ``{from, value}`` turns.

``conversation`` turns one row's value into ``[{"role", "content"}, ...]`` with the roles a chat
template knows (ShareGPT's ``human``/``gpt``/``chatgpt`` and Gemini's ``model`` become
``user``/``assistant``), or raises RowProblem for a row that cannot be trained on: not a list, an
empty turn, an unknown role, a system turn after the first, a conversation that starts with the
assistant or ends with the user, or whose user and assistant turns do not alternate, or one with
no assistant turn.

Conversations split from longer ones often start with an assistant turn or end with a user
turn; with ``drop_dangling_turns`` (``--drop-dangling-turns``) those turns are dropped instead,
as FastChat's preprocessing does:

>>> conversation([{"from": "gpt", "value": "...and so on."}, {"from": "human", "value": "Hi"},
...               {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"}], drop_dangling_turns=True)
[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]
"""

from __future__ import annotations

from typing import Any

from pipeline.encode.bad_rows import Reason, RowProblem

# Speaker names in ShareGPT-style dumps, and the standard roles, mapped to chat-template roles.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


def _turn(message: Any, number: int) -> dict[str, str]:
    """One message as ``{role, content}``, from ``role``/``content`` or ShareGPT's ``from``/``value``."""
    if not isinstance(message, dict):
        raise RowProblem(Reason.NOT_A_CONVERSATION, f"turn {number} is not an object, got {message!r:.60}")
    speaker = message.get("role") if message.get("role") is not None else message.get("from")
    content = message.get("content") if message.get("content") is not None else message.get("value")
    role = ROLES.get(speaker.strip().lower()) if isinstance(speaker, str) else None
    if role is None:
        raise RowProblem(
            Reason.UNKNOWN_ROLE,
            f"turn {number} has role {speaker!r}; roles are user, assistant and system (ShareGPT: human, gpt or "
            "chatgpt, system; model means assistant)",
        )
    if not isinstance(content, str) or not content.strip():
        raise RowProblem(Reason.EMPTY_TURN, f"turn {number} ({role}) is empty")
    return {"role": role, "content": content}


def _without_dangling_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` without the assistant turns before the first user turn and a user turn after the last assistant turn."""
    first = 1 if messages[0]["role"] == "system" else 0
    start = first
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    end = len(messages) - 1 if len(messages) > start and messages[-1]["role"] == "user" else len(messages)
    return messages[:first] + messages[start:end]


def _check_order(messages: list[dict[str, str]]) -> None:
    """An optional system turn, then user and assistant turns alternating from the user and ending with the assistant."""
    first = 1 if messages[0]["role"] == "system" else 0
    roles = [m["role"] for m in messages[first:]]
    if "system" in roles:
        turn = first + roles.index("system") + 1
        raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {turn} is a system turn; only the first turn may be one")
    if roles and roles[0] == "assistant":
        raise RowProblem(
            Reason.STARTS_WITH_ASSISTANT,
            "the conversation starts with an assistant turn; pass --drop-dangling-turns to drop such turns",
        )
    repeated = next((k for k in range(1, len(roles)) if roles[k] == roles[k - 1]), None)
    if repeated is not None:
        raise RowProblem(
            Reason.ROLES_NOT_ALTERNATING,
            f"turns {first + repeated} and {first + repeated + 1} are both {roles[repeated]} turns; user and assistant "
            "turns must alternate",
        )
    if "assistant" not in roles:
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "no assistant turn, so nothing to train on")
    if roles[-1] == "user":
        raise RowProblem(
            Reason.ENDS_WITH_USER,
            "the conversation ends with a user turn, which would stay untrained after the last end-of-turn token; "
            "pass --drop-dangling-turns to drop it",
        )


def conversation(value: Any, drop_dangling_turns: bool = False) -> list[dict[str, str]]:
    """The messages of one chat row, normalised and checked; raises RowProblem for a broken one."""
    if value is None:
        raise RowProblem(Reason.NULL, "the conversation is null")
    if not isinstance(value, list) or not value:
        raise RowProblem(Reason.NOT_A_CONVERSATION, "must be a non-empty list of messages")
    messages = [_turn(message, number) for number, message in enumerate(value, start=1)]
    if drop_dangling_turns:
        messages = _without_dangling_turns(messages)
    _check_order(messages)
    return messages


def as_read(value: Any) -> Any:
    """A chat row's value without the null fields reading gave every message (``role`` and
    ``content`` in a ShareGPT turn): the row as the source holds it, for ``rejected.jsonl``."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
