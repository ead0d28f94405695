"""Chat rows as they exist: ``{role, content}`` messages or ShareGPT's ``{from, value}`` turns.

``conversation`` turns one row's value into ``[{"role", "content"}, ...]`` with the roles a chat
template knows (ShareGPT's ``human``/``gpt`` become ``user``/``assistant``), or raises RowProblem
for a row that cannot be trained on: not a list, an empty turn, an unknown role, a system turn
after the first, a conversation that starts with the assistant or whose user and assistant turns
do not alternate, or one with no assistant turn.

>>> conversation([{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}])
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
            f"turn {number} has role {speaker!r}; roles are user, assistant and system (ShareGPT: human, gpt, system)",
        )
    if not isinstance(content, str) or not content.strip():
        raise RowProblem(Reason.EMPTY_TURN, f"turn {number} ({role}) is empty")
    return {"role": role, "content": content}


def _check_order(messages: list[dict[str, str]]) -> None:
    """An optional system turn, then user and assistant turns alternating from the user, with an assistant turn."""
    first = 1 if messages[0]["role"] == "system" else 0
    roles = [m["role"] for m in messages[first:]]
    if "system" in roles:
        turn = first + roles.index("system") + 1
        raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {turn} is a system turn; only the first turn may be one")
    if roles and roles[0] == "assistant":
        raise RowProblem(Reason.STARTS_WITH_ASSISTANT, "the conversation starts with an assistant turn")
    repeated = next((k for k in range(1, len(roles)) if roles[k] == roles[k - 1]), None)
    if repeated is not None:
        raise RowProblem(
            Reason.ROLES_NOT_ALTERNATING,
            f"turns {first + repeated} and {first + repeated + 1} are both {roles[repeated]} turns; user and assistant "
            "turns must alternate",
        )
    if "assistant" not in roles:
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "no assistant turn, so nothing to train on")


def conversation(value: Any) -> list[dict[str, str]]:
    """The messages of one chat row, normalised and checked; raises RowProblem for a broken one."""
    if value is None:
        raise RowProblem(Reason.NULL, "the conversation is null")
    if not isinstance(value, list) or not value:
        raise RowProblem(Reason.NOT_A_CONVERSATION, "must be a non-empty list of messages")
    messages = [_turn(message, number) for number, message in enumerate(value, start=1)]
    _check_order(messages)
    return messages
