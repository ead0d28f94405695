"""The Arrow schema of one packed row and its invariants.

A row is up to ``capacity`` tokens holding one or more segments: whole examples, or chunks of
an example split under the ``split`` overflow policy. ``cu_seqlens`` marks where each segment
starts, so the read side never recomputes boundaries from token values.

A worked row: three examples of 3, 2 and 4 tokens (``<s>`` = 1, ``</s>`` = 2), the first one's
prompt untrained, packed into a row of capacity 10::

    input_ids       = [1, 306, 2,   1, 2,   1, 450, 338, 2]
    loss_mask       = [0,   0, 1,   1, 1,   1,   1,   1, 1]
    cu_seqlens      = [0, 3, 5, 9]        max_seqlen = 4, num_tokens = 9
    example_ids     = [7, 12, 40]         example_offsets = [0, 0, 0]

The loader turns it into the FA2 varlen keyword arguments: ``cu_seq_lens_q = cu_seq_lens_k =
[0, 3, 5, 9]``, ``max_length_q = max_length_k = 4``, positions restarting per example, and
labels that are -100 where ``loss_mask`` is 0 and on every example's first token (no example
learns to predict the start of the next)::

    position_ids = [0, 1, 2,   0, 1,   0, 1, 2, 3]
    labels       = [-100, -100, 2,   -100, 2,   -100, 450, 338, 2]

(``labels`` are the inputs, not shifted: the model shifts them, as transformers' causal LMs do.)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas.errors import ShardError

ROW_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        # 1 where the token is trained on, 0 where it is context only (prompt, template).
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        # int32 [n_segments + 1]: 0, then the running end of each segment.
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("max_seqlen", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        # Per segment: the source example and the token offset of the segment within it
        # (non-zero only for the second and later chunks of a split example).
        pa.field("example_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("example_offsets", pa.list_(pa.int32()), nullable=False),
    ],
    metadata={b"varpack.row_format": b"1"},
)

ROW_COLUMNS = tuple(ROW_SCHEMA.names)
# A preference build's rows: ROW_SCHEMA plus each segment's role (0 shared prompt, 1 chosen, 2 rejected);
# example_ids then holds each segment's pair id.
PREFERENCE_ROW_SCHEMA = ROW_SCHEMA.append(pa.field("roles", pa.list_(pa.uint8()), nullable=False))
# The most tokens a row can hold: its token count, its cu_seqlens and its list offsets are int32.
MAX_ROW_TOKENS = int(np.iinfo(np.int32).max)


def list_parts(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (rebased to 0) and flat values of a list column, as numpy views of its Arrow
    buffers when the column is one chunk (a shard's always is); other columns are combined first."""
    if isinstance(column, pa.ChunkedArray):
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        array = column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]]


def _column_names(schema: pa.Schema) -> str:
    """The column names of a schema for an error message, even when a corrupt file garbled them."""
    try:
        return str(schema.names)
    except UnicodeDecodeError:
        return "(column names that are not valid UTF-8)"


def validate_table(table: pa.Table, capacity: int, shard: str, num_example_ids: int | None = None) -> None:
    """Check every row invariant of a shard table; raise ShardError naming the first bad row.

    Invariants: the schema matches ROW_SCHEMA and Arrow finds the data well formed;
    ``loss_mask`` and ``input_ids`` have the same length; ``cu_seqlens`` starts at 0, strictly
    increases and ends at the row's token count, which is at most ``capacity``; ``max_seqlen``
    is the largest segment; one example id and offset per segment, every id in
    ``[0, num_example_ids)`` when given (the manifest's ``num_example_ids``).
    """
    schema = table.schema.remove_metadata()
    if not (schema.equals(ROW_SCHEMA.remove_metadata()) or schema.equals(PREFERENCE_ROW_SCHEMA.remove_metadata())):
        raise ShardError(shard, f"schema {_column_names(table.schema)} does not match the packed-row schema {list(ROW_COLUMNS)}")
    if table.num_rows == 0:
        raise ShardError(shard, "holds no rows")
    try:
        # Arrow's own check that offsets and buffers are in bounds, before any buffer is read.
        table.validate(full=True)
    except pa.ArrowInvalid as err:
        raise ShardError(shard, f"is not valid Arrow data ({err}); rebuild it") from err
    for name in ROW_COLUMNS:
        if table.column(name).null_count:
            raise ShardError(shard, f"column {name!r} has nulls")

    token_offsets, _ = list_parts(table.column("input_ids"))
    mask_offsets, mask = list_parts(table.column("loss_mask"))
    cu_offsets, cu = list_parts(table.column("cu_seqlens"))
    id_offsets, example_ids = list_parts(table.column("example_ids"))
    pos_offsets, _ = list_parts(table.column("example_offsets"))
    num_tokens = table.column("num_tokens").to_numpy()
    max_seqlen = table.column("max_seqlen").to_numpy()
    lengths = np.diff(token_offsets)
    n_segments = np.diff(cu_offsets) - 1

    def fail_at(bad: np.ndarray, message: str) -> None:
        rows = np.flatnonzero(bad)
        if rows.size:
            raise ShardError(shard, message, row=int(rows[0]))

    fail_at(lengths == 0, "is empty")
    fail_at(lengths > capacity, f"holds more than the capacity of {capacity} tokens")
    fail_at(num_tokens != lengths, "num_tokens disagrees with the length of input_ids")
    fail_at(np.diff(mask_offsets) != lengths, "loss_mask length differs from input_ids length")
    fail_at(n_segments < 1, "cu_seqlens must hold at least [0, n]")
    fail_at(np.diff(id_offsets) != n_segments, "example_ids needs one entry per segment of cu_seqlens")
    fail_at(np.diff(pos_offsets) != n_segments, "example_offsets needs one entry per segment of cu_seqlens")
    if "roles" in schema.names:
        fail_at(np.diff(list_parts(table.column("roles"))[0]) != n_segments, "roles needs one entry per segment of cu_seqlens")
    if num_example_ids is not None:
        outside = np.flatnonzero((example_ids < 0) | (example_ids >= num_example_ids))
        if outside.size:
            raise ShardError(
                shard,
                f"example_ids holds {int(example_ids[outside[0]])}, outside [0, {num_example_ids}), the build's "
                "example ids by its manifest: the shard is corrupt, or was written with ids past "
                "inputs.dataset.num_examples; rebuild it",
                row=int(np.searchsorted(id_offsets, outside[0], side="right")) - 1,
            )
    fail_at(cu[cu_offsets[:-1]] != 0, "cu_seqlens does not start at 0")
    fail_at(cu[cu_offsets[1:] - 1] != lengths, "cu_seqlens does not end at the row's token count")
    if mask.size and mask.max() > 1:
        fail_at(np.maximum.reduceat(mask, mask_offsets[:-1]) > 1, "loss_mask holds a value other than 0 or 1")

    # Segment lengths: differences within each row, so drop the step across row boundaries.
    steps = np.diff(cu)
    within_row = np.ones(steps.size, dtype=bool)
    within_row[cu_offsets[1:-1] - 1] = False
    segment_row = np.repeat(np.arange(table.num_rows), n_segments)
    segment_lengths = steps[within_row]
    fail_at(np.bincount(segment_row[segment_lengths <= 0], minlength=table.num_rows) > 0, "cu_seqlens is not strictly increasing")
    longest = np.maximum.reduceat(segment_lengths, np.cumsum(n_segments) - n_segments)
    fail_at(max_seqlen != longest, "max_seqlen is not the longest segment in cu_seqlens")
