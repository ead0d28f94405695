"""The packing report printed at the end of a run."""

from __future__ import annotations

from pipeline.config import OnTokenMismatch, VerifyTokens
from pipeline.encode.bad_rows import REJECTED_NAME
from pipeline.encode.chat import ROLE_ORDER
from pipeline.encode.examples import special_text_line
from schemas import PackingStats, RejectedRows

# The chat turns a build drops, as the manifest names them and the report says them (one of each).
DANGLING_TURNS = {
    "leading_assistant": "leading assistant turn",
    "leading_tool": "leading tool turn",
    "trailing_user": "trailing user turn",
    "unanswered_user": "unanswered user turn",
    "empty_system": "empty system turn",
    "empty_user": "empty user turn",
    "answer_to_empty_user": "turn answering an empty user turn",
    "empty_assistant": "empty assistant turn",
    "empty_tool": "empty tool turn",
    "rest_of_empty_answer": "other turn of an answer with an empty turn",
}


def examples_per_row(stats: PackingStats) -> tuple[float, int, int]:
    """Mean, smallest and largest number of segments (examples or chunks) in a row."""
    counts = {int(k): v for k, v in stats.segments_per_row.items() if v}
    if not counts:
        return 0.0, 0, 0
    rows = sum(counts.values())
    return sum(k * v for k, v in counts.items()) / rows, min(counts), max(counts)


def plural(count: int, noun: str) -> str:
    """``1 shard``, ``2 shards``, ``1,024 rows``."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def format_report(
    stats: PackingStats,
    capacity: int,
    shards: int,
    out_dir: str,
    elapsed_s: float,
    reused: bool,
    layout: str = "",
    rejected: RejectedRows | None = None,
    verify_tokens: str = VerifyTokens.SAMPLE,
) -> str:
    """A few aligned lines: the example layout, examples read, kept and dropped, tokens, overflow, rows and fill,
    examples per row, rows left out, chat turns, the inputs read, the check of the tokens, time, path."""
    mean, low, high = examples_per_row(stats)
    lines = [
        *([("example", layout)] if layout else []),
        ("examples", describe_examples(stats, capacity)),
        ("tokens", f"{stats.tokens:,} packed"),
        ("overflow", describe_overflow(stats)),
        ("rows", f"{plural(stats.rows, 'row')} of {capacity:,} tokens in {plural(shards, 'shard')}"),
        ("fill", f"{100 * stats.fill:.3f}%"),
        ("examples/row", f"{mean:.2f} mean, {low} to {high}"),
    ]
    if rejected is not None and rejected.rows:
        lines.append(("rejected", describe_rejected(rejected)))
    if stats.conversations_trimmed:
        lines.append(("trimmed", describe_trimmed(stats)))
    if stats.pairs:
        lines.append(("pairs", describe_pairs(stats)))
    if stats.chat_turns:
        lines.append(("turns", describe_turns(stats)))
    lines += inputs_section(stats)
    for token, found in stats.special_token_text.items():
        lines.append(("special text", f"warning: {token!r} in the data text of {plural(found['examples'], 'example')}, "
                                      f"tokenized as that special token (the first: {found['first_row']})"))
    lines.append(("token check", describe_token_check(stats, verify_tokens, reused)))
    lines += [
        ("elapsed", f"{elapsed_s:.2f} s" + (" (reused)" if reused else "")),
        ("output", out_dir),
    ]
    return aligned(lines)


# Why an example read is not in the rows: the reason's name (in JSON) and its words (in reports).
DROP_REASONS = {
    "too_long": "longer than --max-len {capacity:,} (--overflow drop)",
    "untrained": "with no trained token within --max-len {capacity:,} (--overflow truncate)",
}


def describe_pairs(stats: PackingStats, layout: str | None = None) -> str:
    """A preference build's pairs: packed (in ``layout``), and those left out by reason."""
    left_out = ", ".join(f"{count:,} {reason}" for reason, count in stats.bad_pairs.items()) or "none"
    where = f" in the {layout} layout" if layout else ""
    return f"{plural(stats.pairs, 'pair')} packed whole{where} (each example above is a pair); left out: {left_out}"


def examples_dropped(stats: PackingStats) -> dict[str, int]:
    """The examples read but not kept, by reason (those of DROP_REASONS that occur)."""
    counts = {"too_long": stats.examples_dropped, "untrained": stats.examples_untrained}
    return {reason: count for reason, count in counts.items() if count}


def describe_examples(stats: PackingStats, capacity: int) -> str:
    """Examples read, kept and dropped, with each reason: ``30 read, 20 kept, 10 dropped: 10 longer than ...``."""
    dropped = examples_dropped(stats)
    line = f"{stats.examples_read:,} read, {stats.examples_kept:,} kept, {sum(dropped.values()):,} dropped"
    reasons = [f"{count:,} {DROP_REASONS[reason].format(capacity=capacity)}" for reason, count in dropped.items()]
    return line + (": " + ", ".join(reasons) if reasons else "")


def inputs_section(stats: PackingStats) -> list[tuple[str, str]]:
    """What the build read: the files, the columns that reached the tokens, and those present but not read."""
    if not (stats.source_files or stats.source_columns_used):
        return []
    files = stats.source_files
    shown = ", ".join(files[:5]) + (f", ... ({len(files):,} files)" if len(files) > 5 else "")
    lines = [("files read", shown or "none (generated)"), ("columns", ", ".join(stats.source_columns_used) or "none")]
    if stats.source_columns_unused:
        lines.append(("not read", ", ".join(stats.source_columns_unused) + " (columns present in the source)"))
    return lines


def describe_overflow(stats: PackingStats) -> str:
    """Tokens and examples split, truncated and dropped, and those truncation left untrained."""
    overflow = (
        f"{stats.tokens_split:,} tokens split ({stats.examples_split:,} examples), "
        f"{stats.tokens_truncated:,} truncated ({stats.examples_truncated:,}), "
        f"{stats.tokens_dropped:,} dropped ({stats.examples_dropped:,})"
    )
    if stats.examples_untrained:
        overflow += (
            f"; {plural(stats.examples_untrained, 'example')} ({stats.tokens_untrained:,} tokens) dropped with no "
            "trained token left after truncation"
        )
    return overflow


def built_token_check(stats: PackingStats) -> VerifyTokens:
    """Which examples a build checked: its recorded mode, or, for a build that predates it, what its counts show."""
    if stats.token_check:
        return VerifyTokens(stats.token_check)
    if not stats.examples_checked:
        return VerifyTokens.OFF
    return VerifyTokens.ALL if stats.examples_checked >= stats.examples_read else VerifyTokens.SAMPLE


def reuse_token_check_error(stats: PackingStats, verify_tokens: str, on_token_mismatch: str) -> str | None:
    """Why a finished build cannot stand for this run's check of the tokens, or None when it can: this run
    asks for a stronger check than the build made (all over a sample, any over none), or the build's check
    found differences that this run's ``--on-token-mismatch error`` does not accept."""
    built = built_token_check(stats)
    strength = {VerifyTokens.OFF: 0, VerifyTokens.SAMPLE: 1, VerifyTokens.ALL: 2}
    covered = built == VerifyTokens.ALL or stats.examples_checked >= stats.examples_read
    if strength[VerifyTokens(verify_tokens)] > strength[built] and not (verify_tokens == VerifyTokens.ALL and covered):
        return (
            f"--verify-tokens {verify_tokens} asks for more than this build checked when it was built "
            f"(--verify-tokens {built}, {plural(stats.examples_checked, 'example')} of {stats.examples_read:,}); "
            "pass --force to rebuild it with the check"
        )
    differ = stats.examples_checked - stats.examples_equal
    if differ and on_token_mismatch == OnTokenMismatch.ERROR and verify_tokens != VerifyTokens.OFF:
        return (
            f"{plural(differ, 'example')} of this build {'differs' if differ == 1 else 'differ'} from the token check's "
            "reference in their tokens or loss mask (found when it was built); --on-token-mismatch error refuses it: "
            "pass --force to rebuild and see the first"
        )
    return None


def describe_token_check(stats: PackingStats, verify_tokens: str, reused: bool = False) -> str:
    """The examples checked against the tokenizer's own tokenization of each whole example, and those equal.
    A reused build reports the check it had when it was built, whatever this run asked for."""
    mode = built_token_check(stats) if reused else verify_tokens
    when = " when built" if reused else ""
    if mode == VerifyTokens.OFF:
        return f"off (--verify-tokens off{when}): the tokens were not compared with the tokenizer's own"
    which = "all examples" if mode == VerifyTokens.ALL else "a seeded sample"
    line = (
        f"{plural(stats.examples_checked, 'example')} checked{when} ({which}) against the tokenizer's own "
        f"tokenization, {stats.examples_equal:,} equal"
    )
    differ = stats.examples_checked - stats.examples_equal
    if differ:
        logged = "the first was logged when it was built" if reused else "the warning above counts each kind and shows the first"
        line += f", {differ:,} differ in their tokens or loss mask (--on-token-mismatch count; {logged})"
    return line


def describe_trimmed(stats: PackingStats) -> str:
    """The chat turns dropped, by kind, and from how many conversations.

    >>> stats = PackingStats(conversations_trimmed=144, dangling_turns_dropped={"leading_assistant": 212})
    >>> describe_trimmed(stats)
    'dropped 212 leading assistant turns in 144 conversations (--keep-dangling-turns refuses them)'
    >>> describe_trimmed(PackingStats(conversations_trimmed=3, dangling_turns_dropped={
    ...     "leading_assistant": 2, "empty_user": 1, "answer_to_empty_user": 1})).split(" in ")[0]
    'dropped 2 leading assistant turns, 1 empty user turn and 1 turn answering an empty user turn'
    """
    dropped = stats.dangling_turns_dropped
    turns = [
        f"{dropped[key]:,} {name if dropped[key] == 1 else name.replace('turn', 'turns', 1)}"
        for key, name in DANGLING_TURNS.items()
        if dropped.get(key)
    ]
    listed = " and ".join([", ".join(turns[:-1]), turns[-1]] if len(turns) > 1 else turns)
    return (
        f"dropped {listed or 'dangling turns'} in {plural(stats.conversations_trimmed, 'conversation')} "
        "(--keep-dangling-turns refuses them)"
    )


def describe_turns(stats: PackingStats) -> str:
    """Chat turns by role that reached the tokens, of those read.

    >>> describe_turns(PackingStats(chat_turns={"system": {"read": 2, "used": 2, "merged": 2},
    ...                                         "user": {"read": 3, "used": 3}, "assistant": {"read": 4, "used": 3}}))
    '2 system (merged into the first user turn), 3 user, 3 of 4 assistant'
    >>> describe_turns(PackingStats(chat_turns={"assistant": {"read": 4, "used": 4, "untrained": 1}}))
    '4 assistant (1 of weight 0, not trained on)'
    """
    parts = []
    for role, counts in sorted(stats.chat_turns.items(), key=lambda item: ROLE_ORDER.index(item[0])):
        read, used = counts.get("read", 0), counts.get("used", 0)
        part = f"{used:,} {role}" if used == read else f"{used:,} of {read:,} {role}"
        merged = counts.get("merged", 0)
        if merged:
            part += f" ({'' if merged == read else f'{merged:,} '}merged into the first user turn)"
        if counts.get("untrained"):
            part += f" ({counts['untrained']:,} of weight 0, not trained on)"
        parts.append(part)
    return ", ".join(parts)


def unused_input_warnings(stats: PackingStats) -> list[str]:
    """One line for each chat role of which the chat template left turns out, and for each message field
    (``reasoning_content``) it does not write; ``--strict`` stops on the same."""
    lines = [
        f"warning: {plural(found['examples'], 'example')} (the first: {found['first_row']}): {special_text_line(token)}; "
        "remove it from the data, or pass --strict to stop on this"
        for token, found in stats.special_token_text.items()
    ]
    for role, counts in stats.chat_turns.items():
        if counts.get("left_out"):
            lines.append(
                f"warning: {plural(counts['left_out'], f'{role} turn')} of {counts['read']:,} read left out of the tokens: "
                f"the chat template leaves {role} turns out; use a template that writes them (--chat-template), or pass "
                "--strict to stop on this"
            )
        for key, count in counts.items():
            if key.startswith("unwritten."):
                lines.append(
                    f"warning: the chat template does not write the {key.removeprefix('unwritten.')!r} of "
                    f"{plural(count, f'{role} turn')}; use a template that writes it (--chat-template), or pass --strict "
                    "to stop on this"
                )
    return lines


def describe_rejected(rejected: RejectedRows) -> str:
    """Source rows left out, by reason."""
    reasons = ", ".join(f"{count:,} {reason}" for reason, count in rejected.by_reason.items())
    return f"{plural(rejected.rows, 'row')} ({reasons}), listed in {REJECTED_NAME}"


def aligned(lines: list[tuple[str, str]]) -> str:
    """``label  value`` lines, the values aligned."""
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in lines)
