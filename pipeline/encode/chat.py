"""Chat rows as they exist: ``{role, content}`` messages or ShareGPT's ``{from, value}`` turns.

``conversation`` turns one row's value into ``[{"role", "content"}, ...]`` with the roles a chat
template knows (ShareGPT's ``human``/``gpt``/``chatgpt`` and Gemini's ``model`` become
``user``/``assistant``), or raises RowProblem for a row that cannot be trained on: not a list, an
empty turn, an unknown role, a system turn after the first, a conversation that starts with the
assistant or ends with the user, or whose user and assistant turns do not alternate, or one with
no assistant turn. A ``tool`` turn (a tool's output) follows an assistant turn or another tool
turn, and the assistant speaks again after it. ShareGPT's function calling turns (glaive,
LLaMA-Factory) become tool calls: a ``function_call`` turn, whose value is a JSON object with
``name`` and ``arguments``, is an assistant turn with ``tool_calls``, as chat templates take
them, and an ``observation`` turn is a ``tool`` turn.

ShareGPT dumps hold conversations split from longer ones, which often start with an assistant
turn or end with a user turn. In ShareGPT data those dangling turns are dropped, as FastChat's
preprocessing and axolotl's ShareGPT strategies do, and counted (``Conversation.dropped_leading``,
``dropped_trailing``); ``--keep-dangling-turns`` refuses such rows instead, and
``--drop-dangling-turns`` drops them in ``{role, content}`` data too:

>>> conversation([{"from": "gpt", "value": "...and so on."}, {"from": "human", "value": "Hi"},
...               {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"}]).messages
[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
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
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
# The roles in the order the report lists them.
ROLE_ORDER = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One row's messages, normalised and checked, and the dangling turns dropped from it."""

    messages: list[dict[str, Any]]
    read: list[dict[str, Any]]  # every turn of the row, dangling ones included
    dropped_leading: int = 0
    dropped_trailing: int = 0


def _turn(message: Any, number: int) -> dict[str, Any]:
    """One message as ``{role, content}``, from ``role``/``content`` or ShareGPT's ``from``/``value``."""
    if not isinstance(message, dict):
        raise RowProblem(Reason.NOT_A_CONVERSATION, f"turn {number} is not an object, got {message!r:.60}")
    speaker = message.get("role") if message.get("role") is not None else message.get("from")
    content = message.get("content") if message.get("content") is not None else message.get("value")
    role = ROLES.get(speaker.strip().lower()) if isinstance(speaker, str) else None
    if role is None:
        raise RowProblem(
            Reason.UNKNOWN_ROLE,
            f"turn {number} has role {speaker!r}; roles are user, assistant, system and tool (ShareGPT: human, gpt or "
            "chatgpt, system; model means assistant)",
        )
    if not isinstance(content, str) or not content.strip():
        raise RowProblem(Reason.EMPTY_TURN, f"turn {number} ({role}) is empty")
    if speaker.strip().lower() == "function_call":
        return {"role": role, "content": "", "tool_calls": [{"type": "function", "function": _function(content, number)}]}
    return {"role": role, "content": content}


def _function(value: str, number: int) -> dict[str, Any]:
    """A ``function_call`` turn's value as the ``function`` of a tool call: ``{"name", "arguments"}``."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        call = None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict | str)):
        raise RowProblem(
            Reason.BAD_TOOL_CALL,
            f"turn {number} (function_call) must be a JSON object with a 'name' and 'arguments', got {value!r:.60}",
        )
    arguments = call["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # arguments a model wrote as text stay text
    return {"name": call["name"], "arguments": arguments}


def tool_call_names(message: dict[str, Any]) -> list[str]:
    """The names of the functions an assistant turn calls."""
    return [call["function"]["name"] for call in message.get("tool_calls", ())]


def _is_sharegpt(value: list) -> bool:
    """Whether the row's turns are ShareGPT's ``{from, value}`` rather than ``{role, content}`` messages."""
    return any(isinstance(m, dict) and m.get("role") is None and m.get("from") is not None for m in value)


def _without_dangling_turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
    """``messages`` without the assistant turns before the first user turn and the user turns after the
    last assistant turn, and how many of each were dropped."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    start = first
    while start < len(messages) and messages[start]["role"] in ("assistant", "tool"):
        start += 1
    end = len(messages)
    while end > start and messages[end - 1]["role"] == "user":
        end -= 1
    return messages[:first] + messages[start:end], start - first, len(messages) - end


def _check_order(messages: list[dict[str, Any]], dropped: int) -> None:
    """An optional system turn, then user and assistant turns alternating from the user and ending with
    the assistant; tool turns follow an assistant turn (or a tool turn) and are followed by one."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    roles = [m["role"] for m in messages[first:]]
    if "system" in roles:
        turn = first + roles.index("system") + 1
        raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {turn} is a system turn; only the first turn may be one")
    _check_ends(roles, dropped)
    _check_alternation(roles, first)


def _check_ends(roles: list[str], dropped: int) -> None:
    """The turns after the system turn hold an assistant turn, start with the user and end with the assistant."""
    if "assistant" not in roles:
        if dropped:
            raise RowProblem(
                Reason.ONLY_DANGLING_TURNS,
                "nothing is left to train on once its dangling turns (assistant turns before the first user turn, "
                "user turns after the last assistant turn) are dropped",
            )
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "no assistant turn, so nothing to train on")
    if roles[0] != "user":
        raise RowProblem(
            Reason.STARTS_WITH_ASSISTANT,
            f"the conversation starts with {'an assistant' if roles[0] == 'assistant' else 'a tool'} turn; pass "
            "--drop-dangling-turns to drop such turns",
        )
    if roles[-1] == "user":
        raise RowProblem(
            Reason.ENDS_WITH_USER,
            "the conversation ends with a user turn, which would stay untrained after the last end-of-turn token; "
            "pass --drop-dangling-turns to drop it",
        )
    if roles[-1] == "tool":
        raise RowProblem(
            Reason.ROLES_NOT_ALTERNATING, "the conversation ends with a tool turn; the assistant must answer after it"
        )


def _check_alternation(roles: list[str], first: int) -> None:
    """User and assistant turns alternate; tool turns, and the assistant turn after them, continue the assistant's."""
    after_tool = [k > 0 and roles[k - 1] == "tool" for k in range(len(roles))]
    stray = next((k for k, role in enumerate(roles) if role == "tool" and roles[k - 1] not in ("assistant", "tool")), None)
    if stray is not None:
        raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {first + stray + 1} is a tool turn that follows no assistant turn")
    speakers = [(k, role) for k, role in enumerate(roles) if role != "tool" and not after_tool[k]]
    repeated = next((j for j in range(1, len(speakers)) if speakers[j][1] == speakers[j - 1][1]), None)
    if repeated is not None:
        (a, role), (b, _) = speakers[repeated - 1], speakers[repeated]
        raise RowProblem(
            Reason.ROLES_NOT_ALTERNATING,
            f"turns {first + a + 1} and {first + b + 1} are both {role} turns; user and assistant turns must alternate",
        )


def conversation(value: Any, drop_dangling_turns: bool | None = None) -> Conversation:
    """The messages of one chat row, normalised and checked; raises RowProblem for a broken one.

    ``drop_dangling_turns``: True drops dangling turns, False refuses them, None (the default)
    drops them in ShareGPT data and refuses them in ``{role, content}`` data.
    """
    if value is None:
        raise RowProblem(Reason.NULL, "the conversation is null")
    if not isinstance(value, list) or not value:
        raise RowProblem(Reason.NOT_A_CONVERSATION, "must be a non-empty list of messages")
    read = [_turn(message, number) for number, message in enumerate(value, start=1)]
    if all(message["role"] != "assistant" for message in read):
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "no assistant turn, so nothing to train on")
    messages, leading, trailing = read, 0, 0
    if drop_dangling_turns or (drop_dangling_turns is None and _is_sharegpt(value)):
        messages, leading, trailing = _without_dangling_turns(read)
    _check_order(messages, leading + trailing)
    return Conversation(messages, read, leading, trailing)


def count_turns(chat: Conversation, used: list[bool], system_merged: bool) -> Counter[str]:
    """The counts one conversation adds to a build's: its turns by role as ``ROLE.read`` and ``ROLE.used``
    (``used`` says, for each of ``chat.messages``, whether its content reached the tokens),
    ``system.merged``, and its dropped dangling turns."""
    counts = Counter(f"{m['role']}.read" for m in chat.read)
    counts.update(f"{m['role']}.used" for m, reached in zip(chat.messages, used) if reached)
    counts["system.merged"] += system_merged
    counts["dropped.leading_assistant"] += chat.dropped_leading
    counts["dropped.trailing_user"] += chat.dropped_trailing
    counts["dropped.conversations"] += bool(chat.dropped_leading or chat.dropped_trailing)
    return +counts


def turn_stats(counts: Counter[str]) -> tuple[dict[str, dict[str, int]], dict[str, int], int]:
    """A build's turn counts as the manifest records them: ``{role: {"read", "used"[, "merged"]}}`` in
    ROLE_ORDER, the dangling turns dropped (``leading_assistant``, ``trailing_user``), and the
    conversations they were dropped from.

    >>> turn_stats(Counter({"user.read": 2, "user.used": 1, "dropped.trailing_user": 1, "dropped.conversations": 1}))
    ({'user': {'read': 2, 'used': 1}}, {'trailing_user': 1}, 1)
    """
    roles = {}
    for role in ROLE_ORDER:
        if counts[f"{role}.read"]:
            roles[role] = {"read": counts[f"{role}.read"], "used": counts[f"{role}.used"]}
            if counts[f"{role}.merged"]:
                roles[role]["merged"] = counts[f"{role}.merged"]
    dropped = {kind: counts[f"dropped.{kind}"] for kind in ("leading_assistant", "trailing_user") if counts[f"dropped.{kind}"]}
    return roles, dropped, counts["dropped.conversations"]


def as_read(value: Any) -> Any:
    """A chat row's value without the null fields reading gave every message (``role`` and
    ``content`` in a ShareGPT turn): the row as the source holds it, for ``rejected.jsonl``."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
