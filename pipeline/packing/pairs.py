"""Preference pairs in packed rows: a packed pair becomes the two or three segments of its layout.

The packer places each pair whole, as one item of its tokens in its layout; each token carries
its role (``schemas.Role``). Cutting a pair at its role changes gives its segments, whose
``example_offsets`` are the position of their first token: 0 for a prompt, and for a branch the
prompt segment's length, so that a branch continues the prompt's positions.

>>> import numpy as np
>>> from schemas import PackingStats
>>> plan = PackingPlan(16, np.array([7, 9]), np.zeros(2, np.int64), np.array([7, 6]), np.array([0, 2]), PackingStats())
>>> roles = np.array([0, 0, 1, 1, 1, 2, 2,   1, 1, 1, 2, 2, 2], np.uint8)  # shared-prompt, then separate shape
>>> segments, segment_roles = pair_segments(plan, roles)
>>> segments.segment_example.tolist(), segments.segment_length.tolist(), segments.segment_offset.tolist()
([7, 7, 7, 9, 9], [2, 3, 2, 3, 3], [0, 2, 2, 0, 0])
>>> segment_roles.tolist(), segments.row_offsets.tolist()
([0, 1, 2, 1, 2], [0, 5])

The manifest counts those segments, not the pairs: ``segments_per_pair`` reads them from the
roles, and ``pair_stats`` counts them per row (here the five segments of one row):

>>> per_pair = segments_per_pair(np.array([7, 6]), roles)
>>> per_pair.tolist()
[3, 2]
>>> in_group = PackingPlan(16, np.array([0, 1]), np.zeros(2, np.int64), np.array([7, 6]), np.array([0, 2]), PackingStats())
>>> stats = pair_stats(in_group, per_pair)
>>> stats.segments, stats.segments_per_row
(5, {'5': 1})
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.packing.algorithms import PackingPlan
from schemas import PackingStats, Role

ROLES_PER_PAIR = len(Role)


def pair_segments(plan: PackingPlan, roles: np.ndarray) -> tuple[PackingPlan, np.ndarray]:
    """The plan of whole pairs cut into the segments of each pair, and each segment's role.

    ``roles`` holds the role of every token of the plan's segments, in plan order. Raises
    ValueError when a pair's roles are not prompt, then chosen, then rejected, or a pair was split.
    """
    lengths = plan.segment_length.astype(np.int64)
    if roles.size != int(lengths.sum()):
        raise ValueError(f"{roles.size} token roles for the plan's {int(lengths.sum())} tokens")
    if np.any(plan.segment_offset != 0):
        raise ValueError("a preference pair was split across segments; pairs are packed whole")
    pair_of_token = np.repeat(np.arange(lengths.size), lengths)
    steps_back = np.flatnonzero((np.diff(roles.astype(np.int64)) < 0) & (np.diff(pair_of_token) == 0))
    if steps_back.size or (roles.size and roles.max() > Role.REJECTED):
        raise ValueError("a pair's tokens must be its prompt's, then the chosen branch's, then the rejected branch's")
    counts = np.bincount(pair_of_token * ROLES_PER_PAIR + roles, minlength=lengths.size * ROLES_PER_PAIR)
    counts = counts.reshape(-1, ROLES_PER_PAIR)
    kept = counts > 0
    prompt = counts[:, Role.PROMPT]
    offsets = np.column_stack([np.zeros_like(prompt), prompt, prompt])
    segments_per_pair = np.concatenate(([0], np.cumsum(kept.sum(axis=1))))
    pairs = PackingPlan(
        capacity=plan.capacity,
        segment_example=np.repeat(plan.segment_example, ROLES_PER_PAIR)[kept.ravel()],
        segment_offset=offsets[kept],
        segment_length=counts[kept],
        row_offsets=segments_per_pair[plan.row_offsets],
        stats=plan.stats,
    )
    return pairs, np.tile(np.arange(ROLES_PER_PAIR, dtype=np.uint8), lengths.size)[kept.ravel()]


def segments_per_pair(lengths: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """How many segments each pair of ``lengths`` tokens (back to back, each token's role in ``roles``) becomes:
    3 when it starts with prompt tokens (the shared-prompt layout), else 2 (chosen, rejected)."""
    starts = np.cumsum(lengths) - lengths
    return (2 + (roles[starts] == Role.PROMPT)).astype(np.int8)


def pair_stats(plan: PackingPlan, segments: np.ndarray) -> PackingStats:
    """The plan's statistics with ``segments`` and ``segments_per_row`` counting the segments its rows hold once each
    pair (``plan.segment_example`` indexes ``segments``, each pair's count) is cut in its layout."""
    rows = np.repeat(np.arange(plan.num_rows), np.diff(plan.row_offsets))
    per_row = np.bincount(rows, weights=segments[plan.segment_example], minlength=plan.num_rows).astype(np.int64)
    rows_with = np.bincount(per_row)
    return dataclasses.replace(
        plan.stats,
        segments=int(per_row.sum()),
        segments_per_row={str(c): int(rows_with[c]) for c in np.flatnonzero(rows_with).tolist()},
    )
