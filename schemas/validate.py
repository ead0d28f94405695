"""Checks of settings shared by the write side and the read side."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

import numpy as np

Policy = TypeVar("Policy", bound=StrEnum)


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


def one_of(name: str, value: Any, policy: type[Policy], error: type[Exception] = ValueError) -> Policy:
    """The member of ``policy`` that ``value`` names, or ``error`` listing the values ``name`` takes.

    >>> from schemas import Overflow
    >>> one_of("overflow", "drop", Overflow)
    <Overflow.DROP: 'drop'>
    >>> one_of("overflow", "wrap", Overflow)
    Traceback (most recent call last):
    ...
    ValueError: overflow must be one of split, truncate, drop, error, got 'wrap'
    """
    if value not in list(policy):
        raise error(f"{name} must be one of {', '.join(policy)}, got {value!r}")
    return policy(value)
