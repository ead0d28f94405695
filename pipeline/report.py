"""The packing report printed at the end of a run."""

from __future__ import annotations

from schemas import PackingStats


def examples_per_row(stats: PackingStats) -> tuple[float, int, int]:
    """Mean, smallest and largest number of segments (examples or chunks) in a row."""
    counts = {int(k): v for k, v in stats.segments_per_row.items() if v}
    if not counts:
        return 0.0, 0, 0
    rows = sum(counts.values())
    return sum(k * v for k, v in counts.items()) / rows, min(counts), max(counts)


def format_report(
    stats: PackingStats, capacity: int, shards: int, out_dir: str, elapsed_s: float, reused: bool, layout: str = ""
) -> str:
    """A few aligned lines: the example layout, examples, tokens, rows and fill, overflow, examples per row, time, path."""
    mean, low, high = examples_per_row(stats)
    lines = [
        *([("example", layout)] if layout else []),
        ("examples", f"{stats.examples:,}"),
        ("tokens", f"{stats.tokens:,} packed"),
        ("overflow", f"{stats.tokens_split:,} tokens split ({stats.examples_split:,} examples), "
                     f"{stats.tokens_truncated:,} truncated ({stats.examples_truncated:,}), "
                     f"{stats.tokens_dropped:,} dropped ({stats.examples_dropped:,})"),
        ("rows", f"{stats.rows:,} of {capacity:,} tokens in {shards:,} shards"),
        ("fill", f"{100 * stats.fill:.3f}%"),
        ("examples/row", f"{mean:.2f} mean, {low} to {high}"),
        ("elapsed", f"{elapsed_s:.2f} s" + (" (reused)" if reused else "")),
        ("output", out_dir),
    ]
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in lines)
