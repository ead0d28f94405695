"""Which source feeds the next row of a mixture: Earliest Eligible Virtual Deadline First (EEVDF).

Pure functions over integer arrays, no files: each source's upcoming rows come in as their
sizes in the mixture's unit (real tokens, loss tokens or 1 per row), the schedule comes out as
the source of each pick. After ``T`` units in all, source ``i`` with weight ``w_i`` (the weights
sum to 1) has taken ``c_i`` units and is owed ``w_i * T - c_i``; these lags sum to 0. A source
is *eligible* while it is not ahead of its share, ``c_i <= w_i * T``, so some source always is.
The next row comes from the eligible source whose *virtual deadline* ``(c_i + r_i) / w_i`` is
earliest, ``r_i`` being the units of its next row; ties go to the lower source index. Both
tests are exact, in integers: the units are whole numbers and each weight is read as a fraction
(``integer_weights``: the float 0.3 as 3/10). Megatron-Core's ``BlendedDataset`` takes the
source with the largest deficit ``w_i * T - c_i``; eligibility and deadlines tighten its bounds
(one row ahead, ``k - 1`` rows behind with ``k`` sources) to one row each way.

What every prefix of the schedule keeps, with ``R`` the largest row (in the unit) of any source
and ``r`` the last row source ``i`` took:

- every source is less than a row behind its share: ``w_i * T - c_i < R``;
- every source is ahead of it by less than its own last row: ``c_i - w_i * T <= (1 - w_i) * r``
  (not at all before its first pick or after a row of 0 units).

Why: a source is picked only while it is not ahead, a row of ``r`` units puts it at most
``(1 - w_i) * r`` ahead, and until its next pick it only falls back. A source a whole row ``R``
behind would have let its deadline pass; serving the eligible source with the earliest deadline,
with weights that sum to 1, lets no lag reach the largest request: EEVDF's lag theorem (I.
Stoica, H. Abdel-Wahab, K. Jeffay, S. Baruah, J. Gehrke, C. G. Plaxton, "A Proportional Share
Resource Allocation Algorithm for Real-Time, Time-Shared Systems", RTSS 1996), here with rows
as the requests. For rows of one unit it is the earliest-deadline rule of Tijdeman's chairman
assignment (R. Tijdeman, "The chairman assignment problem", Discrete Mathematics 32, 1980),
which keeps every count within one row of its share.

Three sources of rows (unit ``"rows"``) at 0.5, 0.3 and 0.2; after seven rows sources 1 and
2 are both eligible and both due when 10 rows are taken, and the tie goes to source 1:

>>> blend([np.ones(10, dtype=np.int64)] * 3, np.array([0.5, 0.3, 0.2]), BlendState.start(3), until=10)[0].tolist()
[0, 1, 0, 2, 0, 1, 0, 1, 0, 2]
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BlendState:
    """Where a schedule stands: the units taken from each source and in all."""

    consumed: tuple[int, ...]
    total: int

    @classmethod
    def start(cls, num_sources: int) -> BlendState:
        return cls(consumed=(0,) * num_sources, total=0)


def check_weights(weights: Mapping[str, Any], sources: Sequence[str]) -> np.ndarray:
    """The weights of ``sources``, in that order, normalised to sum to 1; ValueError naming a bad one.

    Any positive finite numbers: they are scaled by the largest before they are added up, so that
    their sum cannot overflow. A weight too small beside the largest to keep a share is refused.
    """
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be {{source name: positive weight}}, got {reprlib.repr(weights)}")
    unknown = sorted(set(weights) - set(sources))
    if unknown:
        raise ValueError(f"weights name {unknown[0]!r}, which is not a source of the mixture (sources: "
                         f"{', '.join(sources)}); fix the name or add the source")
    missing = [name for name in sources if name not in weights]
    if missing:
        raise ValueError(f"source {missing[0]!r} has no weight; give every source a positive weight")
    values = np.array([_positive_weight(name, weights[name]) for name in sources])
    shares = values / values.max()
    shares /= shares.sum()
    if not shares.min() > 0:
        name = sources[int(shares.argmin())]
        raise ValueError(f"source {name!r} has weight {weights[name]!r}, too small beside the largest "
                         f"({float(values.max())!r}) to get any share; raise it or drop the source")
    return shares


def _positive_weight(name: str, value: Any) -> float:
    """``value`` as a positive finite float; ValueError naming the source otherwise."""
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)):
        try:
            number = float(value)
        except OverflowError:  # an integer past the largest float
            number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"source {name!r} has weight {reprlib.repr(value)}; weights must be positive finite numbers")
    return number


def integer_weights(weights: np.ndarray) -> list[int]:
    """Integers in the proportions of the float ``weights``: source ``i``'s share is ``m_i / sum(m)``.

    Each weight is read as the nearest fraction with a denominator up to 2**20 when that fraction
    rounds to the same float (1/3 for the float 0.333...), else as the float's exact value.
    """
    shares = []
    for weight in weights.tolist():
        simple = Fraction(weight).limit_denominator(1 << 20)
        shares.append(simple if float(simple) == weight else Fraction(weight))
    denominator = math.lcm(*(share.denominator for share in shares))
    numerators = [share.numerator * (denominator // share.denominator) for share in shares]
    common = math.gcd(*numerators)
    return [m // common for m in numerators]


def _row_keys(units: np.ndarray, consumed: int, share: int, whole: int, spacing: int) -> tuple[list[int], ...]:
    """With ``j`` of a source's supplied rows taken: its units so far, the total at which it is eligible, its deadline.

    ``j`` runs to the number of rows supplied; past the last one the next row counts as 0 units.
    """
    units = np.asarray(units).astype(np.int64)
    before = consumed + np.concatenate(([0], np.cumsum(units)))
    exact = before.astype(object) if max(int(before[-1]), 1) * max(whole, spacing) >= 1 << 62 else before  # past int64
    eligible_at = -(-exact * whole // share)  # ceil(c / w_i), as the total is whole
    deadline = (exact + np.append(units, 0)) * spacing
    return before.tolist(), eligible_at.tolist(), deadline.tolist()


def blend(
    row_units: Sequence[np.ndarray], weights: np.ndarray, state: BlendState, until: float
) -> tuple[np.ndarray, np.ndarray, BlendState]:
    """Pick rows until ``until`` units are taken in all: ``(source of each pick, picks per source, state)``.

    ``row_units[i]`` holds the units (whole numbers) of source ``i``'s upcoming rows, in its
    order. A source with no row left in ``row_units`` counts as having a row of 0 units next,
    the earliest its deadline could be; when that makes it the pick, the schedule stops before
    it: the caller then supplies more of that source's rows and continues from the returned
    state (the picks are the same as in one call over longer arrays).
    """
    shares = integer_weights(weights)
    whole, common = sum(shares), math.lcm(*shares)
    # The deadline (c_i + r_i) / w_i = (c_i + r_i) * whole / m_i, times lcm(m) / whole: a whole number.
    keys = [_row_keys(units, int(consumed), share, whole, common // share)
            for units, consumed, share in zip(row_units, state.consumed, shares)]
    befores, eligible_at, deadlines = (list(column) for column in zip(*keys))
    ends = [len(before) - 1 for before in befores]
    taken = [0] * len(keys)
    picks: list[int] = []
    total = int(state.total)
    sources = range(len(keys))
    while total < until:
        best, earliest = 0, math.inf
        for i in sources:
            j = taken[i]
            if eligible_at[i][j] <= total and deadlines[i][j] < earliest:
                best, earliest = i, deadlines[i][j]
        j = taken[best]
        if j == ends[best]:
            break
        total += befores[best][j + 1] - befores[best][j]
        taken[best] = j + 1
        picks.append(best)
    consumed = tuple(before[j] for before, j in zip(befores, taken))
    return np.asarray(picks, dtype=np.int64), np.asarray(taken, dtype=np.int64), BlendState(consumed, total)
