"""A packing plan and the examples' tokens in, the packed rows as an Arrow table of ROW_SCHEMA out.

Tokens are gathered once, with one vectorised index, from a flat buffer of the examples'
tokens into the rows' ``input_ids``; nothing is copied per token in Python.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.packing.algorithms import PackingPlan
from pipeline.ranges import gather_index
from schemas import PREFERENCE_ROW_SCHEMA, ROW_SCHEMA

INT32_MAX = np.iinfo(np.int32).max


def _segment_gather(segment_starts: np.ndarray, lengths: np.ndarray, buffer_size: int) -> np.ndarray:
    """Position in the flat token buffer of every token of the segments, in segment order."""
    starts = np.asarray(segment_starts, dtype=np.int64)
    if starts.shape != lengths.shape:
        raise ValueError(f"segment_starts has {starts.size} entries, the plan has {lengths.size} segments")
    if np.any(starts < 0) or np.any(starts + lengths > buffer_size):
        raise ValueError(f"segment_starts point outside the token buffer of {buffer_size} tokens")
    return gather_index(starts, lengths)


def build_rows(
    plan: PackingPlan,
    segment_starts: np.ndarray,
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    example_ids: np.ndarray | None = None,
    roles: np.ndarray | None = None,
) -> pa.Table:
    """The packed rows of ``plan`` as a table of ROW_SCHEMA, or with ``roles`` (one per segment, preference pairs)
    of PREFERENCE_ROW_SCHEMA.

    ``segment_starts[j]`` is where segment ``j`` of the plan begins in the flat ``tokens`` and
    ``loss_mask`` buffers. ``example_ids`` maps the plan's example indices to the ids stored in
    the rows (default: the indices themselves). Raises ValueError for a plan with no rows or
    an empty row, starts outside the buffers, or token ids that do not fit int32.
    """
    num_rows = plan.num_rows
    segments_in_row = np.diff(plan.row_offsets)
    if num_rows == 0:
        raise ValueError("the plan has no rows: there is nothing to write")
    if np.any(segments_in_row == 0):
        raise ValueError(f"row {int(np.argmin(segments_in_row))} of the plan holds no segment")
    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    if tokens.shape != loss_mask.shape:
        raise ValueError(f"tokens {tokens.shape} and loss_mask {loss_mask.shape} must be flat buffers of one length")
    lengths = plan.segment_length.astype(np.int64)
    ends = np.cumsum(lengths)
    if ends[-1] > INT32_MAX:
        raise ValueError(f"{int(ends[-1])} tokens do not fit one table's int32 offsets; build rows one shard at a time")
    gather = _segment_gather(segment_starts, lengths, tokens.size)
    input_ids = tokens[gather]
    if input_ids.min() < 0 or input_ids.max() > INT32_MAX:
        raise ValueError("input_ids: token ids must lie in [0, 2**31 - 1]")
    input_ids = input_ids.astype(np.int32, copy=False)
    mask = loss_mask[gather].astype(np.uint8, copy=False)

    token_offsets = np.concatenate(([0], ends[plan.row_offsets[1:] - 1])).astype(np.int32)
    row_of_segment = np.repeat(np.arange(num_rows), segments_in_row)
    cu_offsets = (plan.row_offsets + np.arange(num_rows + 1)).astype(np.int32)
    cu = np.zeros(lengths.size + num_rows, dtype=np.int32)
    cu[np.arange(lengths.size) + row_of_segment + 1] = ends - token_offsets[row_of_segment]
    max_seqlen = np.maximum.reduceat(lengths, plan.row_offsets[:-1]).astype(np.int32)
    ids = plan.segment_example if example_ids is None else np.asarray(example_ids)[plan.segment_example]
    segment_offsets = plan.row_offsets.astype(np.int32)

    def list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))

    columns = [
        list_array(token_offsets, input_ids),
        list_array(token_offsets, mask),
        list_array(cu_offsets, cu),
        pa.array(max_seqlen, pa.int32()),
        pa.array(np.diff(token_offsets), pa.int32()),
        list_array(segment_offsets, ids.astype(np.int64)),
        list_array(segment_offsets, plan.segment_offset.astype(np.int32)),
    ]
    if roles is None:
        return pa.Table.from_arrays(columns, schema=ROW_SCHEMA)
    return pa.Table.from_arrays([*columns, list_array(segment_offsets, roles.astype(np.uint8))], schema=PREFERENCE_ROW_SCHEMA)
