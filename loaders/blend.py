"""Which source feeds the next row of a mixture: a deterministic largest-deficit schedule.

Pure functions over integer arrays, no files: each source's upcoming rows come in as their
sizes in the mixture's unit (real tokens, loss tokens or 1 per row), the schedule comes out as
the source of each pick. After ``T`` units in all, source ``i`` with weight ``w_i`` (the
weights sum to 1) has taken ``c_i`` units; its deficit is ``w_i * T - c_i``. The next row comes
from the source whose deficit is largest at the middle of its next row,
``w_i * (T + r_i / 2) - (c_i + r_i / 2)``: Megatron-Core's ``BlendedDataset`` rule (largest
deficit first) over units of any size instead of samples. Ties go to the lower source index.

What every prefix of the schedule keeps, with ``R`` the largest row (in the unit):

- no source is ever more than one row ahead of its share: ``c_i - w_i * T <= R``;
- no source is more than ``k - 1`` rows behind it, with ``k`` sources: the deficits sum to 0;
  with two sources that is one row each way, and in practice, with several sources of mixed
  row sizes, the largest lag is about 1.2 rows.

Three sources of rows (unit ``"rows"``) at 0.5, 0.3 and 0.2:

>>> blend([np.ones(10)] * 3, np.array([0.5, 0.3, 0.2]), BlendState.start(3), until=10)[0].tolist()
[0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlendState:
    """Where a schedule stands: the units taken from each source and in all."""

    consumed: tuple[float, ...]
    total: float

    @classmethod
    def start(cls, num_sources: int) -> BlendState:
        return cls(consumed=(0.0,) * num_sources, total=0.0)


def check_weights(weights: dict[str, float], sources: Sequence[str]) -> np.ndarray:
    """The weights of ``sources``, in that order, normalised to sum to 1; ValueError naming a bad one."""
    unknown = sorted(set(weights) - set(sources))
    if unknown:
        raise ValueError(f"weights name {unknown[0]!r}, which is not a source of the mixture (sources: "
                         f"{', '.join(sources)}); fix the name or add the source")
    missing = [name for name in sources if name not in weights]
    if missing:
        raise ValueError(f"source {missing[0]!r} has no weight; give every source a positive weight")
    for name in sources:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
            raise ValueError(f"source {name!r} has weight {value!r}; weights must be positive numbers")
    values = np.array([float(weights[name]) for name in sources])
    return values / values.sum()


def blend(
    row_units: Sequence[np.ndarray], weights: np.ndarray, state: BlendState, until: float
) -> tuple[np.ndarray, np.ndarray, BlendState]:
    """Pick rows until ``until`` units are taken in all: ``(source of each pick, picks per source, state)``.

    ``row_units[i]`` holds the units of source ``i``'s upcoming rows, in its order. The schedule
    stops early, before the pick, when the source it would pick has no row left in
    ``row_units``: the caller then supplies more of that source's rows and continues from the
    returned state (the picks are the same as in one call over longer arrays).
    """
    # Source i's score with j of its supplied rows taken: w_i * T - (c_i + j's units + (1 - w_i) * r_j / 2),
    # the deficit at the middle of its next row; past its last supplied row, the bare deficit.
    bases, offsets = [], []
    for units, weight, consumed in zip(row_units, weights.tolist(), state.consumed):
        units = np.asarray(units, dtype=np.float64)
        before = consumed + np.concatenate(([0.0], np.cumsum(units)))
        bases.append(before.tolist())
        offsets.append((before + np.append((1 - weight) * units / 2, 0.0)).tolist())
    weight = weights.tolist()
    ends = [len(base) - 1 for base in bases]
    taken = [0] * len(bases)
    picks: list[int] = []
    total = state.total
    sources = range(len(bases))
    while total < until:
        best, best_score = 0, -np.inf
        for i in sources:
            score = weight[i] * total - offsets[i][taken[i]]
            if score > best_score:
                best, best_score = i, score
        j = taken[best]
        if j == ends[best]:
            break
        total += bases[best][j + 1] - bases[best][j]
        taken[best] = j + 1
        picks.append(best)
    consumed_after = tuple(base[j] for base, j in zip(bases, taken))
    return np.asarray(picks, dtype=np.int64), np.asarray(taken, dtype=np.int64), BlendState(consumed_after, total)
