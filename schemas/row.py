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

import enum
from dataclasses import dataclass

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


class Role(enum.IntEnum):
    """What a segment of a preference row is (``roles``)."""

    PROMPT = 0  # the shared prompt of a pair, less its last token (shared-prompt layout)
    CHOSEN = 1  # the prompt (or its last token) and the chosen completion
    REJECTED = 2  # the prompt (or its last token) and the rejected completion


class PreferenceLayout(enum.StrEnum):
    """How a pair's tokens lie in a row."""

    SEPARATE = "separate"  # [prompt + chosen], [prompt + rejected]
    SHARED_PROMPT = "shared-prompt"  # [prompt[:-1]], [prompt[-1:] + chosen], [prompt[-1:] + rejected]


# A preference build's rows: ROW_SCHEMA and one role per segment. ``example_ids`` holds each segment's pair id,
# ``example_offsets`` the position id of its first token (a branch continues its prompt's positions).
PREFERENCE_ROW_SCHEMA = pa.schema(
    [*ROW_SCHEMA, pa.field("roles", pa.list_(pa.uint8()), nullable=False)],
    metadata={b"varpack.row_format": b"1", b"varpack.rows": b"preference"},
)
PREFERENCE_ROW_COLUMNS = tuple(PREFERENCE_ROW_SCHEMA.names)
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


def _has_roles(schema: pa.Schema) -> bool:
    """Whether a table's schema has the ``roles`` column of preference rows."""
    try:
        return "roles" in schema.names
    except UnicodeDecodeError:  # a corrupt file's garbled names: the schema check then names the file
        return False


def validate_table(
    table: pa.Table, capacity: int, shard: str, num_example_ids: int | None = None, preference_layout: str | None = None
) -> None:
    """Check every row invariant of a shard table; raise ShardError naming the first bad row.

    Invariants: the schema matches ROW_SCHEMA (or PREFERENCE_ROW_SCHEMA) and Arrow finds the data
    well formed; ``loss_mask`` and ``input_ids`` have the same length; ``cu_seqlens`` starts at 0,
    strictly increases and ends at the row's token count, which is at most ``capacity``;
    ``max_seqlen`` is the largest segment; one example id and offset per segment, every id in
    ``[0, num_example_ids)`` when given (the manifest's ``num_example_ids``). A table with ``roles``
    (required when ``preference_layout`` is given) also keeps the pair invariants of
    ``_validate_pairs``.
    """
    preference = _has_roles(table.schema) or preference_layout is not None
    expected, columns = (PREFERENCE_ROW_SCHEMA, PREFERENCE_ROW_COLUMNS) if preference else (ROW_SCHEMA, ROW_COLUMNS)
    if not table.schema.remove_metadata().equals(expected.remove_metadata()):
        kind = "preference-row" if preference else "packed-row"
        raise ShardError(shard, f"schema {_column_names(table.schema)} does not match the {kind} schema {list(columns)}")
    if table.num_rows == 0:
        raise ShardError(shard, "holds no rows")
    try:
        # Arrow's own check that offsets and buffers are in bounds, before any buffer is read.
        table.validate(full=True)
    except pa.ArrowInvalid as err:
        raise ShardError(shard, f"is not valid Arrow data ({err}); rebuild it") from err
    for name in columns:
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
    if preference:
        starts_segment = np.ones(cu.size, dtype=bool)
        starts_segment[cu_offsets[1:] - 1] = False  # a row's last entry of cu_seqlens ends it
        segments = _Segments(segment_row, cu[starts_segment] + token_offsets[segment_row], segment_lengths, example_ids)
        _validate_pairs(table, shard, segments, mask, preference_layout)


@dataclass(frozen=True)
class _Segments:
    """Every segment of a table, in order: its row, where its tokens start in the table, its length and its id."""

    row: np.ndarray
    start: np.ndarray
    length: np.ndarray
    example_id: np.ndarray


def _validate_pairs(table: pa.Table, shard: str, segments: _Segments, mask: np.ndarray, layout: str | None) -> None:
    """The invariants of preference rows; raise ShardError naming the first bad row.

    One role per segment; the segments of a pair (one ``example_ids`` value) are adjacent in one
    row, as [chosen, rejected] or, in the shared-prompt layout, [prompt, chosen, rejected]; no
    pair id is in two places; a prompt segment is untrained and starts at position 0, a branch
    after it starts at the prompt's length and its first token (the prompt's last) is untrained,
    and every branch has a trained token.
    """
    role_offsets, roles = list_parts(table.column("roles"))
    n_segments = np.bincount(segments.row, minlength=table.num_rows)

    def fail_at_segment(bad: np.ndarray, message: str) -> None:
        found = np.flatnonzero(bad)
        if found.size:
            raise ShardError(shard, message, row=int(segments.row[found[0]]))

    if np.any(np.diff(role_offsets) != n_segments):
        raise ShardError(shard, "roles needs one entry per segment of cu_seqlens", row=int(np.argmax(np.diff(role_offsets) != n_segments)))
    fail_at_segment(roles > Role.REJECTED, "roles holds a value other than 0 (prompt), 1 (chosen) or 2 (rejected)")
    # A pair is a run of segments of one id within one row.
    starts_run = np.ones(roles.size, dtype=bool)
    starts_run[1:] = (segments.example_id[1:] != segments.example_id[:-1]) | (segments.row[1:] != segments.row[:-1])
    run = np.cumsum(starts_run) - 1
    run_first = np.flatnonzero(starts_run)
    run_length = np.diff(np.append(run_first, roles.size))
    fail_at_segment(
        ~np.isin(run_length, (2, 3))[run], "a pair must be 2 segments [chosen, rejected] or 3 [prompt, chosen, rejected], adjacent"
    )
    if layout == PreferenceLayout.SEPARATE:
        fail_at_segment(run_length[run] == 3, "a pair of the separate layout has a prompt segment")
    place = np.arange(roles.size) - run_first[run]
    fail_at_segment(roles != place + (run_length[run] == 2), "a pair's roles must be [chosen, rejected] or [prompt, chosen, rejected]")
    ids, first_at, count = np.unique(segments.example_id[run_first], return_index=True, return_counts=True)
    if np.any(count > 1):
        twice = int(ids[np.argmax(count > 1)])
        rows = segments.row[run_first][segments.example_id[run_first] == twice]
        raise ShardError(shard, f"pair {twice} is in more than one place (a pair never spans rows)", row=int(rows[1]))
    offsets = list_parts(table.column("example_offsets"))[1].astype(np.int64)
    prompt_length = np.where(run_length == 3, segments.length[run_first], 0)[run]
    fail_at_segment(offsets != np.where(roles == Role.PROMPT, 0, prompt_length),
                    "example_offsets must be 0 for a prompt and the prompt's length for a branch that follows it")
    trained = np.add.reduceat(mask.astype(np.int64), segments.start) if mask.size else np.zeros(0, np.int64)
    fail_at_segment((roles == Role.PROMPT) & (trained > 0), "a prompt segment has trained tokens")
    fail_at_segment((roles != Role.PROMPT) & (trained == 0), "a chosen or rejected segment has no trained token")
    fail_at_segment((prompt_length > 0) & (roles != Role.PROMPT) & (mask[segments.start] > 0),
                    "a branch's first token (the prompt's last) is trained")
