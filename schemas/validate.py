"""Checks of settings shared by the write side and the read side."""

from __future__ import annotations

from typing import Any

import numpy as np


def positive_int(name: str, value: Any, error: type[Exception] = ValueError) -> int:
    """``value`` as an int, or ``error`` saying that ``name`` must be a positive integer.

    Booleans are refused although Python counts them as integers; numpy integers are accepted.

    >>> positive_int("capacity", 4)
    4
    >>> positive_int("capacity", 0)
    Traceback (most recent call last):
    ...
    ValueError: capacity must be a positive integer, got 0
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)
