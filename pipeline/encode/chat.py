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
them (a null or empty one is an empty assistant turn), and an ``observation`` turn is a ``tool`` turn.
A turn's ``weight`` (axolotl's ShareGPT convention) of 0 keeps an assistant turn untrained
(``Conversation.trained``); any other weight but 1 is a bad row. A ``{role, content}`` message keeps its
other fields (``tool_calls``, whose ``content`` may be null, ``tool_call_id``, ``name``,
``reasoning_content``) for the chat template; ``written`` finds which of them a template writes.

ShareGPT dumps hold conversations split from longer ones, which often start with an assistant
(or tool) turn or end with a user turn, and turns whose text the dump lost. In ShareGPT data those
turns are dropped, as FastChat's preprocessing and axolotl's ShareGPT strategies drop the dangling
ones, and each is counted by kind (``Conversation.dropped``, ``DROPPED``): an exchange (a user turn
and the assistant's answer, tool turns included) that holds an empty turn is dropped whole, since an
answer to a lost question, or a question whose answer was lost, teaches nothing true; a user turn
answered by another user turn is dropped; an empty system turn is dropped. ``--keep-dangling-turns``
refuses such rows instead, and ``--drop-dangling-turns`` drops them in ``{role, content}`` data too:

>>> chat = conversation([{"from": "gpt", "value": "...and so on."}, {"from": "human", "value": "Hi"},
...                      {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": ""},
...                      {"from": "gpt", "value": "As I said..."}, {"from": "human", "value": "Bye"}])
>>> chat.messages
[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]
>>> chat.dropped
('leading_assistant', 'empty_user', 'answer_to_empty_user', 'trailing_user')
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from collections.abc import Callable
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
    """One row's messages, normalised and checked, and the turns dropped from it."""

    messages: list[dict[str, Any]]
    read: list[dict[str, Any]]  # every turn of the row, dropped ones included
    dropped: tuple[str, ...] = ()  # the kind (one of DROPPED) of each turn dropped
    # Whether each assistant turn of ``messages``, in order, is trained on (False: ``weight`` 0); () when all are.
    trained: tuple[bool, ...] = ()

    def trained_turns(self) -> tuple[bool, ...]:
        """Whether each assistant turn of ``messages`` is trained on."""
        return self.trained or (True,) * sum(m["role"] == "assistant" for m in self.messages)


# The keys that hold a turn's speaker and text; every other non-null key of a message (``tool_calls``,
# ``reasoning_content``, ``tool_call_id``, ``name``) but its ``weight`` is passed to the chat template as it is.
SPEAKER_KEYS = ("role", "from")
TEXT_KEYS = ("content", "value")
# A turn's weight, as axolotl's ShareGPT strategies read it: 0, an assistant turn not trained on; 1 (or none), trained.
WEIGHT_KEY = "weight"


def _turn(message: Any, number: int, empty_allowed: bool) -> dict[str, Any]:
    """One message as ``{role, content, ...}``, from ``role``/``content`` or ShareGPT's ``from``/``value``,
    with its other fields (``tool_calls``, ``reasoning_content``) kept for the chat template; an empty
    (or null) text is a bad row unless ``empty_allowed``, when it is read as ``""``."""
    if not isinstance(message, dict):
        raise RowProblem(Reason.NOT_A_CONVERSATION, f"turn {number} is not an object, got {message!r:.60}")
    speaker = message.get("role") if message.get("role") is not None else message.get("from")
    content = message.get("content") if message.get("content") is not None else message.get("value")
    role = _role(speaker, number)
    weight = _weight(message.get(WEIGHT_KEY), number, role)
    extra = _template_fields(message, number, role)
    content = _text(content, number, role, "tool_calls" in extra, empty_allowed)
    if speaker.strip().lower() == "function_call":
        extra, content = _function_call_fields(content, number), ""
    return {"role": role, "content": content, **extra, **weight}


def _role(speaker: Any, number: int) -> str:
    """The chat-template role of a turn's speaker (``ROLES``); an unknown speaker is a bad row."""
    role = ROLES.get(speaker.strip().lower()) if isinstance(speaker, str) else None
    if role is None:
        raise RowProblem(
            Reason.UNKNOWN_ROLE,
            f"turn {number} has role {speaker!r}; roles are user, assistant, system and tool (ShareGPT: human, gpt or "
            "chatgpt, system; model means assistant)",
        )
    return role


def _template_fields(message: dict[str, Any], number: int, role: str) -> dict[str, Any]:
    """The fields of a message other than its speaker, text and weight, for the chat template: its tool
    calls checked, with their arguments as objects."""
    # Null fields are fields the row does not have (reading gives every message all of them); so is an empty call list.
    extra = {
        k: v for k, v in message.items() if k not in (*SPEAKER_KEYS, *TEXT_KEYS, WEIGHT_KEY) and v is not None and v != []
    }
    if "tool_calls" in extra:
        _check_tool_calls(extra["tool_calls"], number, role)
        extra["tool_calls"] = [_with_arguments_object(call) for call in extra["tool_calls"]]
    return extra


def _text(content: Any, number: int, role: str, calls_tools: bool, empty_allowed: bool) -> str:
    """A turn's text: a null one is ``""`` in a turn that calls tools (OpenAI writes a call without text as
    content null) or when ``empty_allowed``; an empty one is a bad row unless either holds."""
    if content is None and (calls_tools or empty_allowed):
        content = ""
    if not isinstance(content, str) or not (content.strip() or calls_tools or empty_allowed):
        raise RowProblem(Reason.EMPTY_TURN, f"turn {number} ({role}) is empty")
    return content


def _function_call_fields(value: str, number: int) -> dict[str, Any]:
    """The fields of the assistant turn a ShareGPT ``function_call`` turn is: its one tool call, or none
    for an empty call (an empty assistant turn, dropped with its exchange)."""
    if not value.strip():
        return {}
    return {"tool_calls": [{"type": "function", "function": _function(value, number)}]}


def _weight(weight: Any, number: int, role: str) -> dict[str, int]:
    """``{"weight": 0}`` for an assistant turn not trained on, else ``{}``; a weight other than 0 or 1, or
    weight 1 on a turn that is not the assistant's, is a bad row."""
    if weight is None or (weight == 0 and role != "assistant"):
        return {}
    if weight not in (0, 1) or (weight == 1 and role != "assistant"):
        raise RowProblem(
            Reason.BAD_WEIGHT,
            f"turn {number} ({role}) has weight {weight!r}; a weight is 0 (an assistant turn not trained on) or 1 "
            "(an assistant turn trained on), and only assistant turns are trained on",
        )
    return {WEIGHT_KEY: 0} if weight == 0 else {}


def _check_tool_calls(calls: Any, number: int, role: str) -> None:
    """``tool_calls`` as chat templates take them: a list of ``{"function": {"name", "arguments"}}``."""
    good = role == "assistant" and isinstance(calls, list) and bool(calls) and all(
        isinstance(call, dict) and isinstance(call.get("function"), dict) and isinstance(call["function"].get("name"), str)
        for call in calls
    )
    if not good:
        raise RowProblem(
            Reason.BAD_TOOL_CALL,
            f"turn {number} ({role}) has tool_calls {calls!r:.60}; only an assistant turn calls tools, with a list of "
            '{"type": "function", "function": {"name", "arguments"}}',
        )


def _with_arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call without its null fields, its ``arguments`` an object, as chat templates take them
    (OpenAI writes them as JSON text; text that is not JSON stays text)."""
    call = {k: v for k, v in call.items() if v is not None}
    function = {k: v for k, v in call["function"].items() if v is not None}
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # arguments a model wrote as text stay text
    return {**call, "function": function}


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


def data_text(messages: list[dict[str, Any]]) -> str:
    """The text of ``messages`` the data holds, one line per field: every text field (``content``,
    ``reasoning_content``, ...) and each tool call as JSON, for finding special tokens' text in it.

    >>> data_text([{"role": "user", "content": "Use <s>old</s>"}, {"role": "assistant", "content": "Done",
    ...            "tool_calls": [{"function": {"name": "strike", "arguments": {"tag": "</s>"}}}]}])
    'Use <s>old</s>\\nDone\\n{"function": {"name": "strike", "arguments": {"tag": "</s>"}}}'
    """
    return "\n".join(
        text
        for message in messages
        for text in [
            *(value for name, value in message.items() if name != "role" and isinstance(value, str) and value),
            *(json.dumps(call, ensure_ascii=False) for call in message.get("tool_calls", ())),
        ]
    )


def _is_sharegpt(value: list) -> bool:
    """Whether the row's turns are ShareGPT's ``{from, value}`` rather than ``{role, content}`` messages."""
    return any(isinstance(m, dict) and m.get("role") is None and m.get("from") is not None for m in value)


# The kinds of turns dropped from a conversation, in the order the manifest and the report list them:
# dangling turns (the assistant's before the first user turn, the user's after the last answer), a user
# turn answered by another user turn, empty turns, and the other turns of an exchange that holds an empty one.
DROPPED = (
    "leading_assistant",
    "leading_tool",
    "trailing_user",
    "unanswered_user",
    "empty_system",
    "empty_user",
    "answer_to_empty_user",
    "empty_assistant",
    "empty_tool",
    "rest_of_empty_answer",
)


def _is_empty(message: dict[str, Any]) -> bool:
    """Whether a turn says nothing: no text but whitespace, and no tool calls."""
    return not (message["content"].strip() or message.get("tool_calls"))


def _exchange_kinds(user: dict[str, Any], answer: list[dict[str, Any]], trailing: bool) -> list[str] | None:
    """Why each turn of an exchange (a user turn and the assistant's answer after it, tool turns included)
    is dropped, or None when it is kept."""
    if trailing:
        return ["trailing_user"]
    if _is_empty(user):
        return ["empty_user"] + ["answer_to_empty_user"] * len(answer)
    if not answer:
        return ["unanswered_user"]
    if any(_is_empty(m) for m in answer):
        return ["unanswered_user"] + [f"empty_{m['role']}" if _is_empty(m) else "rest_of_empty_answer" for m in answer]
    return None


def _without_untrainable_turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """``messages`` without the turns nothing true can be learnt from, and the kind of each turn dropped
    (``DROPPED``): empty system turns, dangling turns, user turns left unanswered, and exchanges that hold
    an empty turn. Anything else out of order (a system turn after the first) is kept for ``_check_order``.

    >>> u, a, e = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": ""}
    >>> _without_untrainable_turns([a, u, u, a, e, a, u])[1]
    ['leading_assistant', 'unanswered_user', 'empty_user', 'answer_to_empty_user', 'trailing_user']
    """
    dropped = ["empty_system" if m["role"] == "system" and _is_empty(m) else "" for m in messages]
    turns = [m for m, why in zip(messages, dropped) if not why]
    first = 1 if turns and turns[0]["role"] == "system" else 0
    start = _answer_end(turns, first)
    kept, kinds = _kept_exchanges(turns, start)
    leading = [f"leading_{m['role']}" for m in turns[first:start]]
    return turns[:first] + kept, [why for why in dropped if why] + leading + kinds


def _answer_end(turns: list[dict[str, Any]], start: int) -> int:
    """Where the run of assistant and tool turns from ``start`` on ends."""
    end = start
    while end < len(turns) and turns[end]["role"] in ("assistant", "tool"):
        end += 1
    return end


def _kept_exchanges(turns: list[dict[str, Any]], start: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The turns from ``start`` on (each a user turn and its answer, or a turn out of order) less the exchanges
    nothing true can be learnt from, and the kind of each turn dropped."""
    last_answer = max((k for k, m in enumerate(turns) if m["role"] in ("assistant", "tool")), default=-1)
    kept: list[dict[str, Any]] = []
    kinds: list[str] = []
    k = start
    while k < len(turns):
        end = _answer_end(turns, k + 1)
        why = _exchange_kinds(turns[k], turns[k + 1 : end], k > last_answer) if turns[k]["role"] == "user" else None
        if why is None:
            kept.extend(turns[k:end])
        kinds.extend(why or [])
        k = end
    return kept, kinds


def _check_order(messages: list[dict[str, Any]], dropped: list[str]) -> None:
    """An optional system turn, then user and assistant turns alternating from the user and ending with
    the assistant; tool turns follow an assistant turn (or a tool turn) and are followed by one."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    roles = [m["role"] for m in messages[first:]]
    if "system" in roles:
        turn = first + roles.index("system") + 1
        raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {turn} is a system turn; only the first turn may be one")
    _check_ends(roles, dropped)
    _check_alternation(roles, first)


def _check_ends(roles: list[str], dropped: list[str]) -> None:
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
    """User and assistant turns alternate; tool turns follow an assistant (or tool) turn, and the
    assistant speaks again after them, continuing its turn.

    >>> _check_alternation(["user", "assistant", "tool", "user", "assistant"], 0)
    Traceback (most recent call last):
    ...
    pipeline.encode.bad_rows.RowProblem: turn 4 is a user turn after tool turn 3; the assistant must answer a tool turn
    """
    for k, role in enumerate(roles):
        if role == "tool" and roles[k - 1] not in ("assistant", "tool"):
            raise RowProblem(Reason.ROLES_NOT_ALTERNATING, f"turn {first + k + 1} is a tool turn that follows no assistant turn")
        if k and roles[k - 1] == "tool" and role not in ("assistant", "tool"):
            raise RowProblem(
                Reason.ROLES_NOT_ALTERNATING,
                f"turn {first + k + 1} is a {role} turn after tool turn {first + k}; the assistant must answer a tool turn",
            )
    # The assistant turn that answers tool turns continues the assistant's turn before them.
    speakers: list[tuple[int, str]] = []
    for k, role in enumerate(roles):
        if role == "tool":
            continue
        if k and roles[k - 1] == "tool":
            speakers[-1] = (k, role)  # the assistant answering tool turns goes on with its turn
        else:
            speakers.append((k, role))
    repeated = next((j for j in range(1, len(speakers)) if speakers[j][1] == speakers[j - 1][1]), None)
    if repeated is not None:
        (a, role), (b, _) = speakers[repeated - 1], speakers[repeated]
        raise RowProblem(
            Reason.ROLES_NOT_ALTERNATING,
            f"turns {first + a + 1} and {first + b + 1} are both {role} turns; user and assistant turns must alternate",
        )


def _check_something_left(read: list[dict[str, Any]], messages: list[dict[str, Any]], dropped: list[str]) -> None:
    """Raise the empty-turn error, naming the first empty user, assistant or tool turn, for a conversation
    that has nothing left to train on once the exchanges holding empty turns are dropped."""
    if all(m["role"] != "assistant" for m in messages) and {"empty_user", "empty_assistant", "empty_tool"} & set(dropped):
        empty = next(k for k, m in enumerate(read, start=1) if m["role"] != "system" and _is_empty(m))
        raise RowProblem(
            Reason.EMPTY_TURN,
            f"turn {empty} ({read[empty - 1]['role']}) is empty, and nothing is left to train on once the exchanges "
            "that hold empty turns are dropped",
        )


def conversation(value: Any, drop_dangling_turns: bool | None = None) -> Conversation:
    """The messages of one chat row, normalised and checked; raises RowProblem for a broken one.

    ``drop_dangling_turns``: True drops dangling turns, unanswered user turns and exchanges holding an
    empty turn, False refuses them, None (the default) drops them in ShareGPT data and refuses them in
    ``{role, content}`` data; an empty list, or one of system turns only, is then ``no_chat_turns``.
    """
    read, dropping = _read_turns(value, drop_dangling_turns)
    messages, dropped = read, []
    if dropping:
        messages, dropped = _without_untrainable_turns(read)
        _check_something_left(read, messages, dropped)
    _check_order(messages, dropped)
    return _with_trained_turns(messages, read, dropped)


def _read_turns(value: Any, drop_dangling_turns: bool | None) -> tuple[list[dict[str, Any]], bool]:
    """Every turn of a chat row, normalised (``_turn``), and whether its untrainable turns are dropped;
    raises RowProblem for a row that is not a list of turns or has no assistant turn."""
    if value is None:
        raise RowProblem(Reason.NULL, "the conversation is null")
    if not isinstance(value, list):
        raise RowProblem(Reason.NOT_A_CONVERSATION, "must be a non-empty list of messages")
    # An empty list, whose format cannot be told, is treated as ShareGPT's split leaves it.
    dropping = bool(drop_dangling_turns or (drop_dangling_turns is None and (not value or _is_sharegpt(value))))
    read = [_turn(message, number, dropping) for number, message in enumerate(value, start=1)]
    if dropping and all(message["role"] == "system" for message in read):
        raise RowProblem(Reason.NO_CHAT_TURNS, "no user or assistant turn (what splitting a conversation can leave)")
    if not read:
        raise RowProblem(Reason.NOT_A_CONVERSATION, "must be a non-empty list of messages")
    if all(message["role"] != "assistant" for message in read):
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "no assistant turn, so nothing to train on")
    return read, dropping


def _with_trained_turns(messages: list[dict[str, Any]], read: list[dict[str, Any]], dropped: list[str]) -> Conversation:
    """The conversation of ``messages``, recording which assistant turns are trained on (weight 0: not),
    without their weights; one whose every assistant turn has weight 0 is a bad row."""
    trained = tuple(WEIGHT_KEY not in m for m in messages if m["role"] == "assistant")
    if not any(trained):
        raise RowProblem(Reason.NO_ASSISTANT_TURN, "every assistant turn has weight 0, so nothing to train on")
    if all(trained):
        return Conversation(messages, read, tuple(dropped))
    messages = [{k: v for k, v in m.items() if k != WEIGHT_KEY} for m in messages]
    return Conversation(messages, read, tuple(dropped), trained)


def _probe(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each non-empty text field, and each tool call's name, replaced by a marker naming
    the message and the field (``zq2zcontent``): letters and digits, which ``| trim`` and ``| tojson`` keep."""
    probe = []
    for k, message in enumerate(messages):
        turn = dict(message)
        for name, value in message.items():
            if name == "tool_calls":
                turn[name] = [
                    {**call, "function": {**call["function"], "name": f"zq{k}ztoolcalls{j}"}} for j, call in enumerate(value)
                ]
            elif name != "role" and isinstance(value, str) and value.strip():
                turn[name] = f"zq{k}z{name.replace('_', '')}"
        probe.append(turn)
    return probe


def _pattern(messages: list[dict[str, Any]]) -> tuple:
    """What decides which parts of ``messages`` a chat template writes: roles, fields and tool calls."""
    return tuple(
        (m["role"], tuple(sorted(k for k, v in m.items() if v not in ("", None))), len(m.get("tool_calls", ())))
        for m in messages
    )


_WRITTEN: dict[tuple, tuple[list[bool], list[list[str]]]] = {}


def written(messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]) -> tuple[list[bool], list[list[str]]]:
    """Whether ``render`` (a chat template) writes each of ``messages``, and the fields of each it leaves out.

    The template renders the conversation once with markers for its texts (``_probe``), and each
    marker is looked for in the output: a turn whose content is not there is left out, whatever text
    happens to match elsewhere, and a turn written through a filter (``| tojson``) is found. The
    answer depends only on the roles and fields, so it is worked out once per such pattern.
    """
    key = (render, _pattern(messages))
    if key not in _WRITTEN:
        if len(_WRITTEN) > 4096:
            _WRITTEN.clear()
        probe = _probe(messages)
        text = render(probe)
        turns, fields = [], []
        for k, (message, marked) in enumerate(zip(messages, probe)):
            missing = [
                name
                for name, value in marked.items()
                if (name == "tool_calls" or (name != "role" and value != message[name]))
                and not all(f"zq{k}z{part}" in text for part in _markers(name, value))
            ]
            if marked["content"] != message["content"]:
                turns.append("content" not in missing)
            else:  # no text: a tool call's turn is written when its calls are
                turns.append("tool_calls" not in missing)
            fields.append([name for name in missing if name != "content"])
        _WRITTEN[key] = (turns, fields)
    turns, fields = _WRITTEN[key]
    return list(turns), [list(names) for names in fields]


def _markers(name: str, value: Any) -> list[str]:
    """The markers ``_probe`` put into field ``name``."""
    if name == "tool_calls":
        return [f"toolcalls{j}" for j in range(len(value))]
    return [name.replace("_", "")]


def count_turns(
    chat: Conversation, turns_written: list[bool], in_tokens: list[bool], fields_unwritten: list[list[str]], system_merged: bool
) -> Counter[str]:
    """The counts one conversation adds to a build's, for each of ``chat.messages``: its turns by role as
    ``ROLE.read``, ``ROLE.used`` (its text is in the example's tokens, ``in_tokens``), ``ROLE.left_out``
    (the chat template does not write it), ``assistant.untrained`` (weight 0) and ``ROLE.unwritten.FIELD`` (a field such as
    ``reasoning_content`` the template does not write), ``system.merged``, and its dropped dangling turns."""
    counts = Counter(f"{m['role']}.read" for m in chat.read)
    counts.update(f"{m['role']}.used" for m, reached in zip(chat.messages, in_tokens) if reached)
    counts.update(f"{m['role']}.left_out" for m, wrote in zip(chat.messages, turns_written) if not wrote)
    counts.update(f"{m['role']}.unwritten.{name}" for m, names in zip(chat.messages, fields_unwritten) for name in names)
    counts["assistant.untrained"] += chat.trained_turns().count(False)
    counts["system.merged"] += system_merged
    counts.update(f"dropped.{kind}" for kind in chat.dropped)
    counts["dropped.conversations"] += bool(chat.dropped)
    return +counts


def turn_stats(counts: Counter[str]) -> tuple[dict[str, dict[str, int]], dict[str, int], int]:
    """A build's turn counts as the manifest records them: ``{role: {"read", "used"[, "merged", "left_out",
    "unwritten.FIELD"]}}`` in ROLE_ORDER, the turns dropped by kind (``DROPPED``:
    ``leading_assistant``, ``trailing_user``, ``empty_user``, ...), and the conversations they were dropped from.

    >>> turn_stats(Counter({"user.read": 2, "user.used": 1, "dropped.trailing_user": 1, "dropped.conversations": 1}))
    ({'user': {'read': 2, 'used': 1}}, {'trailing_user': 1}, 1)
    >>> turn_stats(Counter({"assistant.read": 2, "assistant.used": 2, "assistant.unwritten.reasoning_content": 1}))[0]
    {'assistant': {'read': 2, 'used': 2, 'unwritten.reasoning_content': 1}}
    """
    roles = {}
    for role in ROLE_ORDER:
        if counts[f"{role}.read"]:
            roles[role] = {"read": counts[f"{role}.read"], "used": counts[f"{role}.used"]}
            kinds = tuple(f"{role}.{kind}" for kind in ("merged", "left_out", "untrained", "unwritten."))
            extra = sorted(k.removeprefix(f"{role}.") for k in counts if k.startswith(kinds) and counts[k])
            roles[role].update({name: counts[f"{role}.{name}"] for name in extra})
    dropped = {kind: counts[f"dropped.{kind}"] for kind in DROPPED if counts[f"dropped.{kind}"]}
    return roles, dropped, counts["dropped.conversations"]


def as_read(value: Any) -> Any:
    """A chat row's value as the source holds it, for ``rejected.jsonl``: each message without the null fields
    reading gave every message (``role`` and ``content`` in a ShareGPT turn), but with a null text of its own
    (``"value": null``), which may be why the row was rejected.

    >>> as_read([{"from": "gpt", "value": None, "role": None, "content": None, "tool_calls": None}])
    [{'from': 'gpt', 'value': None}]
    """
    if not isinstance(value, list):
        return value
    return [_message_as_read(m) if isinstance(m, dict) else m for m in value]


def _message_as_read(message: dict[str, Any]) -> dict[str, Any]:
    """One message without the null fields it was not written with: its own text field stays, null or not."""
    own = next((text for speaker, text in zip(SPEAKER_KEYS, TEXT_KEYS) if message.get(speaker) is not None), None)
    return {k: v for k, v in message.items() if v is not None or k == own}
