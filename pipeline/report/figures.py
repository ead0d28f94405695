"""``report.png``: the histograms of a build, one figure readable at a glance.

Three panels: example length before and after overflow handling (with the row capacity
marked), examples per row, and row fill. Drawn with matplotlib's object API (no pyplot state,
no display needed); matplotlib is optional (``pip install 'varpack[plot]'``).
"""

from __future__ import annotations

import numpy as np

from pipeline import storage
from pipeline.report.profile import Profile
from pipeline.report.summary import plural
from schemas import Manifest

REPORT_NAME = "report.png"
_BEFORE, _AFTER, _ROWS, _LIMIT = "#9aa5b1", "#1f6feb", "#2da44e", "#cf222e"


def missing_matplotlib() -> str | None:
    """Why the figure cannot be drawn here, or None when matplotlib is importable."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed; pip install 'varpack[plot]'"
    return None


def _thousands(axis) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))


def draw_report(profile: Profile, manifest: Manifest):
    """The report figure (a ``matplotlib.figure.Figure``)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    stats, capacity = manifest.stats, profile.capacity
    figure = Figure(figsize=(16, 4.8), dpi=110, layout="constrained")
    dataset = manifest.inputs.dataset
    figure.suptitle(
        f"{dataset.id} ({dataset.split}), build {manifest.fingerprint}: {plural(stats.examples_kept, 'example')} "
        f"kept of {stats.examples_read:,} read, "
        f"{plural(stats.rows, 'row')} of {capacity:,} tokens, fill {100 * stats.fill:.2f}%",
        fontsize=13, fontweight="bold",
    )
    lengths, per_row, fill = figure.subplots(1, 3, width_ratios=(1.5, 1, 1))

    # Log-spaced bins on a log axis: lengths span orders of magnitude and have a long tail.
    shortest = max(1, min(int(profile.segment_lengths.min()), capacity // 10))  # a decade at least
    longest = int(max(profile.example_lengths.max(), capacity))
    bins = np.geomspace(shortest, longest * 1.05, 61)
    overflowed = stats.examples_split + stats.examples_truncated + stats.examples_dropped
    if overflowed:
        lengths.hist(profile.example_lengths, bins=bins, color=_BEFORE, label="before overflow handling (examples)")
        lengths.hist(profile.segment_lengths, bins=bins, histtype="step", linewidth=2, color=_AFTER,
                     label=f"after --overflow {manifest.inputs.overflow} (segments)")
    else:
        lengths.hist(profile.segment_lengths, bins=bins, color=_AFTER, label="examples (none over the capacity)")
    lengths.axvline(capacity, color=_LIMIT, linestyle="--", linewidth=1.5, label=f"row capacity {capacity:,}")
    lengths.set_xscale("log")
    lengths.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    lengths.xaxis.set_minor_formatter(NullFormatter())
    lengths.set_title("Example length", fontsize=12)
    lengths.set_xlabel("tokens (log scale)")
    lengths.set_ylabel("examples")
    _thousands(lengths.yaxis)
    lengths.legend(loc="upper left", fontsize=9, framealpha=0.9, edgecolor="none")
    lengths.text(
        0.02, 0.74,
        f"median {np.median(profile.example_lengths):,.0f}, longest {int(profile.example_lengths.max()):,}\n"
        f"split {stats.examples_split:,}, truncated {stats.examples_truncated:,}, dropped {stats.examples_dropped:,}",
        transform=lengths.transAxes, ha="left", va="top", fontsize=9, color="#57606a",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9},
    )

    percent = 100 * profile.row_tokens / capacity
    # 1% bins from the emptiest row's tens: best-fit rows crowd just under 100%.
    lowest = min(10 * int(percent.min() // 10), 90)
    fill.hist(percent, bins=np.arange(lowest, 101), color=_ROWS)
    fill.set_yscale("log")
    fill.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    fill.set_title("Row fill", fontsize=12)
    fill.set_xlim(lowest, 100)
    fill.xaxis.set_major_locator(MaxNLocator(integer=True))
    fill.set_xlabel("tokens in the row, % of capacity")
    fill.set_ylabel("rows (log scale)")
    below = int(np.count_nonzero(percent < 90))
    fill.text(0.03, 0.97, f"mean {100 * stats.fill:.2f}%\n{plural(below, 'row')} under 90%",
              transform=fill.transAxes, ha="left", va="top", fontsize=10,
              bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9})

    counts = np.bincount(profile.row_segments)
    present = np.flatnonzero(counts)
    per_row.bar(present, counts[present], width=0.8, color=_AFTER)
    per_row.set_xlim(0, present.max() + 1)
    per_row.set_title("Examples per row", fontsize=12)
    per_row.set_xlabel("segments (examples or chunks) in the row")
    per_row.set_ylabel("rows")
    _thousands(per_row.xaxis)
    _thousands(per_row.yaxis)
    per_row.text(0.97, 0.95, f"mean {profile.row_segments.mean():.2f}", transform=per_row.transAxes,
                 ha="right", va="top", fontsize=10)
    for axes in (lengths, per_row, fill):
        axes.spines[["top", "right"]].set_visible(False)
    return figure


def write_report(profile: Profile, manifest: Manifest, directory: str) -> str:
    """Draw the report and write it to ``directory/report.png`` atomically; returns its path."""
    figure = draw_report(profile, manifest)
    storage.make_dirs(directory)
    path = storage.join(directory, REPORT_NAME)
    with storage.output(path) as tmp:
        figure.savefig(tmp, format="png")
    return path
