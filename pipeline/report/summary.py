"""The packing report printed at the end of a run."""

from __future__ import annotations

from pipeline.config import VerifyTokens
from pipeline.encode.bad_rows import REJECTED_NAME
from schemas import PackingStats, RejectedRows


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
    """A few aligned lines: the example layout, examples, tokens, rows and fill, overflow, examples per row,
    rows left out, the check of the tokens, time, path."""
    mean, low, high = examples_per_row(stats)
    lines = [
        *([("example", layout)] if layout else []),
        ("examples", f"{stats.examples:,}"),
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
    lines.append(("token check", describe_token_check(stats, verify_tokens)))
    lines += [
        ("elapsed", f"{elapsed_s:.2f} s" + (" (reused)" if reused else "")),
        ("output", out_dir),
    ]
    return aligned(lines)


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


def describe_token_check(stats: PackingStats, verify_tokens: str) -> str:
    """The examples checked against the tokenizer's own tokenization of each whole example, and those equal."""
    if verify_tokens == VerifyTokens.OFF:
        return "off (--verify-tokens off): the tokens were not compared with the tokenizer's own"
    which = "all examples" if verify_tokens == VerifyTokens.ALL else "a seeded sample"
    line = (
        f"{plural(stats.examples_checked, 'example')} checked ({which}) against the tokenizer's own tokenization, "
        f"{stats.examples_equal:,} equal"
    )
    differ = stats.examples_checked - stats.examples_equal
    if differ:
        line += f", {differ:,} differ (--on-token-mismatch count; the first is logged above)"
    return line


def describe_trimmed(stats: PackingStats) -> str:
    """Conversations --drop-dangling-turns shortened."""
    return (
        f"{plural(stats.conversations_trimmed, 'conversation')} of a leading assistant or trailing user turn "
        "(--drop-dangling-turns)"
    )


def describe_rejected(rejected: RejectedRows) -> str:
    """Source rows left out, by reason."""
    reasons = ", ".join(f"{count:,} {reason}" for reason, count in rejected.by_reason.items())
    return f"{plural(rejected.rows, 'row')} ({reasons}), listed in {REJECTED_NAME}"


def aligned(lines: list[tuple[str, str]]) -> str:
    """``label  value`` lines, the values aligned."""
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in lines)
