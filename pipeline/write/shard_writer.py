"""Write a build: packed rows in, Arrow IPC shard files and a manifest out.

``ShardWriter`` writes a whole build in one process from token arrays you already hold, with
the guarantees of ``python -m pipeline.pack``: every shard validated, written atomically and
checksummed, the manifest (with the fingerprint of the build's inputs) written last, and
nothing left behind when writing fails. The Beam pipeline writes its shards on many workers
with the same two steps, ``write_shard`` and ``finish_build``.

Tokens are gathered once, with one vectorised index per shard, from a flat buffer of the
examples' tokens into the rows' ``input_ids``; nothing is copied per token in Python.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.config import default_rows_per_shard
from pipeline.errors import OutputDirError
from pipeline.packing.algorithms import PackingPlan, pack
from pipeline.packing.rows import build_rows
from schemas import (
    PREFERENCE_ROW_SCHEMA,
    ROW_SCHEMA,
    BuildInputs,
    LossMasking,
    Manifest,
    Overflow,
    PackingAlgorithm,
    PackingStats,
    RejectedRows,
    ShardError,
    ShardInfo,
    compute_fingerprint,
    one_of,
    positive_int,
    stream_sha256,
    validate_table,
    write_manifest,
    written_format_version,
)
from schemas.io import atomic_file
from schemas.shard_identity import ShardIdentity, with_identity


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:05d}.arrow"


def write_shard(
    table: pa.Table, directory: str | os.PathLike[str], name: str, capacity: int, identity: ShardIdentity
) -> ShardInfo:
    """Validate ``table`` and write it as one uncompressed Arrow IPC file, atomically.

    The file's schema metadata carries ``identity``, its place in the build. The file is
    written under a temporary name, fsynced, then renamed, so a reader never sees half a
    shard. Returns the manifest entry with the file's sha256.
    """
    validate_table(table, capacity, name)
    schema = with_identity(PREFERENCE_ROW_SCHEMA if "roles" in table.column_names else ROW_SCHEMA, identity)
    # Written, then hashed, through the descriptor that made the temporary file: never reopened by its name.
    with atomic_file(Path(directory) / name) as file:
        # One record batch per shard: the reader maps it as contiguous buffers.
        with pa.ipc.new_file(file, schema) as writer:
            writer.write_table(table.combine_chunks().replace_schema_metadata(schema.metadata), max_chunksize=table.num_rows)
        file.flush()
        file.seek(0)
        return ShardInfo(
            path=name,
            rows=table.num_rows,
            tokens=int(table.column("num_tokens").to_numpy().sum()),
            sha256=stream_sha256(file),
            bytes=os.fstat(file.fileno()).st_size,
        )


def publish_shard(table: pa.Table, out_dir: str, capacity: int, identity: ShardIdentity) -> ShardInfo:
    """``write_shard`` of shard ``identity.index`` into a local directory or a URL (``gs://``,
    ``s3://``): remotely, written locally first, then uploaded under a temporary name and renamed."""
    name = shard_name(identity.index)
    if not storage.is_url(out_dir):
        return write_shard(table, out_dir, name, capacity, identity)
    with tempfile.TemporaryDirectory() as tmp:
        info = write_shard(table, tmp, name, capacity, identity)
        storage.publish(os.path.join(tmp, name), storage.join(out_dir, name))
    return info


def finish_build(
    out_dir: str,
    inputs: BuildInputs,
    rows_per_shard: int,
    shards: list[ShardInfo],
    stats: PackingStats,
    rejected: RejectedRows | None = None,
) -> Manifest:
    """Write the manifest of a build whose shards are all written: validated, atomically, last.

    Its presence marks the build complete; ``shards`` are in shard order. Returns the manifest.
    """
    manifest = Manifest(
        fingerprint=compute_fingerprint(inputs),
        inputs=inputs,
        capacity=inputs.max_len,
        rows_per_shard=rows_per_shard,
        shards=shards,
        stats=stats,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        rejected=rejected if rejected is not None else RejectedRows(),
        format_version=written_format_version(inputs),
    )
    # Locally written through the descriptor of its temporary file (schemas.io.atomic_file); at a URL uploaded
    # where no manifest is yet, so the first attempt at this URL to finish publishes the build and the others leave it.
    write_manifest(manifest, out_dir, storage.output_first if storage.is_url(out_dir) else None)
    return manifest


def _one_row_plan(
    capacity: int, cu_seqlens: np.ndarray, example_ids: np.ndarray, example_offsets: np.ndarray
) -> PackingPlan:
    """The plan of a single row from its boundaries, with its statistics."""
    lengths = np.diff(cu_seqlens)
    return PackingPlan(
        capacity=capacity,
        segment_example=example_ids,
        segment_offset=example_offsets,
        segment_length=lengths,
        row_offsets=np.array([0, lengths.size], dtype=np.int64),
        stats=PackingStats(
            examples=int(np.count_nonzero(example_offsets == 0)),
            segments=int(lengths.size),
            tokens=int(cu_seqlens[-1]),
            rows=1,
            capacity_tokens=capacity,
            segments_per_row={str(lengths.size): 1},
        ),
    )


class ShardWriter:
    """Write a build from token arrays already at hand, without Beam: rows in, shards and a manifest out.

    The shards and manifest are those ``python -m pipeline.pack`` writes, with the same
    guarantees: every shard is checked against the row schema, written under a temporary name
    and renamed, and recorded with its sha256; ``finish()`` writes the manifest, with the
    fingerprint of ``inputs``, last. Leaving the ``with`` block finishes the build, or, on an
    exception, removes what was written. ``out_dir`` (local or a ``gs://``/``s3://`` URL) must
    be empty or absent.

    >>> import tempfile
    >>> from schemas import BuildInputs, DatasetInputs, TokenizerInputs
    >>> directory = tempfile.mkdtemp() + "/my-build"
    >>> inputs = BuildInputs(
    ...     dataset=DatasetInputs(id="my-corpus", split="train", content_hash="sha256-of-my-data"),
    ...     tokenizer=TokenizerInputs(name="my-tokenizer", content_hash="sha256-of-tokenizer.json", vocab_size=32000),
    ...     template="none", loss_masking="given", max_len=8, overflow="split", packing="best_fit_decreasing",
    ...     seed=0, package_version="0.1.0")
    >>> with ShardWriter(directory, inputs) as writer:
    ...     # One row: an example of 3 tokens, then one of 2, the prompt token of each not trained on.
    ...     writer.write_row([5, 6, 7, 8, 9], cu_seqlens=[0, 3, 5], loss_mask=[0, 1, 1, 0, 1])
    ...     # Or examples, packed by ``inputs.packing`` under ``inputs.overflow``.
    ...     writer.write_examples([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], lengths=[6, 4])
    >>> writer.manifest.stats.rows, writer.manifest.stats.examples
    (3, 4)
    """

    def __init__(self, out_dir: str | os.PathLike[str], inputs: BuildInputs, rows_per_shard: int | None = None) -> None:
        self.out_dir = str(out_dir)
        self.inputs = inputs
        self.fingerprint = compute_fingerprint(inputs)
        self.capacity = inputs.max_len
        self.rows_per_shard = rows_per_shard or default_rows_per_shard(self.capacity)
        positive_int("rows_per_shard", self.rows_per_shard)
        one_of("inputs.loss_masking", inputs.loss_masking, LossMasking)
        one_of("inputs.overflow", inputs.overflow, Overflow)
        one_of("inputs.packing", inputs.packing, PackingAlgorithm)
        held = storage.list_files(self.out_dir) + storage.list_subdirs(self.out_dir)
        if held:
            raise OutputDirError(
                f"{self.out_dir} is not empty (it holds {', '.join(held[:3])}); write a build into a new directory"
            )
        storage.make_dirs(self.out_dir)
        self.manifest: Manifest | None = None
        # Rows not yet in a shard, 1 to rows_per_shard once any were written: the last shard is written by
        # finish(), which knows it is the last.
        self._pending: list[pa.Table] = []
        self._shards: list[ShardInfo] = []
        self._stats: list[PackingStats] = []
        self._examples = 0  # examples written so far: the id of the next one when ids are not given
        self._lowest_id, self._highest_id = 0, -1  # over the example ids written, and 0
        self._rows = 0

    def write_row(
        self,
        input_ids: np.ndarray | list[int],
        cu_seqlens: np.ndarray | list[int] | None = None,
        loss_mask: np.ndarray | list[int] | None = None,
        example_ids: np.ndarray | list[int] | None = None,
        example_offsets: np.ndarray | list[int] | None = None,
    ) -> None:
        """Add one packed row: its tokens, where each segment ends (``[0, n1, n1 + n2, ...]``;
        default one segment), which tokens are trained on (default all), and per segment the
        source example and the segment's first token within it (default: new examples, whole).
        A row that breaks the row schema raises ShardError naming it. Example ids lie below the
        examples written, or below ``inputs.dataset.num_examples`` when it declares more;
        ``finish`` refuses others."""
        input_ids = np.asarray(input_ids)
        cu = np.asarray([0, input_ids.size] if cu_seqlens is None else cu_seqlens, dtype=np.int64)
        mask = np.ones(input_ids.size, np.uint8) if loss_mask is None else np.asarray(loss_mask)
        segments = max(cu.size - 1, 0)
        ids = np.arange(self._examples, self._examples + segments) if example_ids is None else np.asarray(example_ids)
        offsets = np.zeros(segments, np.int64) if example_offsets is None else np.asarray(example_offsets)
        where = f"row {self._rows}"
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != input_ids.size or np.any(np.diff(cu) <= 0):
            raise ShardError(
                where, f"cu_seqlens must rise strictly from 0 to the row's {input_ids.size} tokens, got {cu.tolist()}"
            )
        if input_ids.size > self.capacity:
            raise ShardError(where, f"holds {input_ids.size} tokens, more than the capacity of {self.capacity}")
        if mask.shape != input_ids.shape:
            raise ShardError(where, f"loss_mask has {mask.size} entries for {input_ids.size} tokens")
        if ids.shape != (segments,) or offsets.shape != (segments,):
            raise ShardError(where, f"example_ids and example_offsets need one entry per segment ({segments})")
        plan = _one_row_plan(self.capacity, cu, ids.astype(np.int64), offsets.astype(np.int64))
        self._add(plan, cu[:-1], input_ids, mask, where)

    def write_examples(
        self,
        tokens: np.ndarray | list[int],
        lengths: np.ndarray | list[int],
        loss_mask: np.ndarray | list[int] | None = None,
        example_ids: np.ndarray | list[int] | None = None,
    ) -> None:
        """Pack examples, given back to back in ``tokens`` with their ``lengths``, into rows with
        ``inputs.packing`` under ``inputs.overflow`` and add the rows. Each call packs on its own
        (as a packing group does); ``loss_mask`` defaults to all tokens trained on and
        ``example_ids`` to the examples' running numbers."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = np.asarray(tokens)
        mask = np.ones(tokens.size, np.uint8) if loss_mask is None else np.asarray(loss_mask)
        if tokens.ndim != 1 or tokens.size != int(lengths.sum()):
            raise ValueError(
                f"tokens must hold the examples back to back: {tokens.size} tokens, lengths sum to {int(lengths.sum())}"
            )
        ids = np.arange(self._examples, self._examples + lengths.size) if example_ids is None else np.asarray(example_ids)
        if ids.shape != lengths.shape:
            raise ValueError(f"example_ids holds {ids.size} ids for {lengths.size} examples")
        inputs = self.inputs
        plan = pack(lengths, self.capacity, overflow=inputs.overflow, algorithm=inputs.packing, seed=inputs.seed)
        starts = np.cumsum(lengths) - lengths
        segment_starts = starts[plan.segment_example] + plan.segment_offset
        plan = dataclasses.replace(plan, segment_example=ids.astype(np.int64)[plan.segment_example])
        self._add(plan, segment_starts, tokens, mask, f"examples {self._examples} to {self._examples + lengths.size - 1}")

    def _add(self, plan: PackingPlan, segment_starts: np.ndarray, tokens: np.ndarray, loss_mask: np.ndarray, where: str) -> None:
        """Build the rows of ``plan``, keep them, and write every full shard."""
        self._stats.append(plan.stats)
        self._examples += plan.stats.examples
        if plan.num_rows == 0:
            return
        try:
            table = build_rows(plan, segment_starts, tokens, loss_mask)
        except ValueError as err:
            raise ShardError(where, str(err)) from err
        self._rows += plan.num_rows
        self._lowest_id = min(self._lowest_id, int(plan.segment_example.min()))
        self._highest_id = max(self._highest_id, int(plan.segment_example.max()))
        self._pending.append(table)
        if sum(t.num_rows for t in self._pending) > self.rows_per_shard:
            pending = pa.concat_tables(self._pending)
            full = (pending.num_rows - 1) // self.rows_per_shard * self.rows_per_shard
            for start in range(0, full, self.rows_per_shard):
                self._write(pending.slice(start, self.rows_per_shard), last=False)
            self._pending = [pending.slice(full)]

    def _write(self, table: pa.Table, last: bool) -> None:
        identity = ShardIdentity(self.fingerprint, len(self._shards), last)
        self._shards.append(publish_shard(table, self.out_dir, self.capacity, identity))

    def finish(self, rejected: RejectedRows | None = None) -> Manifest:
        """Write the last shard, then the manifest; returns the manifest. ``rejected`` counts
        source rows left out upstream, by reason."""
        if self.manifest is not None:
            return self.manifest
        if self._rows == 0:
            raise ValueError(f"{self.out_dir}: no rows were written; a build needs at least one row")
        self._write(pa.concat_tables(self._pending), last=True)
        self._pending = []
        stats = PackingStats.merged(self._stats)
        declared = self.inputs.dataset.num_examples
        stats.num_example_ids = declared or max(self._examples, self._highest_id + 1)
        if self._lowest_id < 0 or self._highest_id >= stats.num_example_ids:
            outside = self._lowest_id if self._lowest_id < 0 else self._highest_id
            raise ValueError(
                f"{self.out_dir}: example id {outside} is outside [0, {stats.num_example_ids}), the build's example ids "
                "(inputs.dataset.num_examples); give ids below the source's example count"
            )
        self.manifest = finish_build(self.out_dir, self.inputs, self.rows_per_shard, self._shards, stats, rejected)
        return self.manifest

    def abort(self) -> None:
        """Remove the shards written so far, and the directory if that leaves it empty: nothing of the build is left."""
        storage.remove([storage.join(self.out_dir, s.path) for s in self._shards])
        storage.remove_empty_dir(self.out_dir)
        self._shards, self._pending = [], []

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None:
            try:
                self.finish()
                return
            except BaseException:
                self.abort()
                raise
        if self.manifest is None:
            self.abort()
