"""Progress bars for long runs, shown by the process that runs the command.

Steps call ``advance``; it draws a tqdm bar only once the command has called ``enable`` in
this process, so steps running in worker processes (multi-process or cluster runners) stay
quiet and report through Beam counters instead. A bar is closed, and its line cleared, as soon
as its count reaches its total, so one bar is drawn at a time on one line: two bars would
stack, and clearing the lower one moves the cursor into lines printed after it.
"""

from __future__ import annotations

import sys
from typing import Any

_enabled = False
_bars: dict[str, Any] = {}


def enable() -> None:
    """Draw bars in this process from now on."""
    global _enabled
    _enabled = True


def advance(label: str, amount: int, total: int | None = None, unit: str = "") -> None:
    """Add ``amount`` to the bar called ``label`` (created on first use, with ``total`` if known)."""
    if not _enabled:
        return
    bar = _bars.get(label)
    if bar is None:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs, CI).
        bar = _bars[label] = tqdm(
            desc=label, total=total, unit=unit, unit_scale=True, file=sys.stderr, leave=False, disable=None
        )
    bar.update(amount)
    if total is not None and bar.n >= total:
        bar.close()
        del _bars[label]


def close() -> None:
    """Close every bar and stop drawing."""
    global _enabled
    for bar in _bars.values():
        bar.close()
    _bars.clear()
    _enabled = False
