"""``PackedIterableDataset``: packed shards in, FlashAttention-2 varlen batches out.

The stages, each in its own module: ``remote`` finds the build and caches remote shards;
``shuffle`` orders the epoch's rows from (seed, epoch); ``partition`` cuts that order into
batches and deals them to ranks and DataLoader workers; ``collate`` turns a batch's rows into
tensors; ``resume`` records where a reader stands. This module ties them together.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loaders.collate import FixedShape, collate_rows, fixed_shape
from loaders.loss_weights import LossReduction, add_loss_weights, make_loss_weighting
from loaders.partition import EpochPlan, max_rows_per_batch, max_segments_per_batch, plan_epoch, resolve_rank
from loaders.remote import locate
from loaders.resume import (
    MAX_COUNT,
    Position,
    SavedState,
    StaleStateError,
    check_layout,
    check_position,
    from_state_dict,
    to_state_dict,
)
from loaders.shard_reader import Shard, open_build_shard
from loaders.shuffle import epoch_row_order
from loaders.verify import checked_shards
from loaders.worker_ledger import WorkerLedger
from schemas import Manifest, ManifestError, positive_int

# Shards one shuffle window spans, by default: the window's rows come from about this many shards.
DEFAULT_SHUFFLE_WINDOW_SHARDS = 4
# The shortest prefix of a tokenizer content hash that expected_tokenizer_hash may give.
MIN_HASH_PREFIX = 12


def check_manifest(
    manifest: Manifest, source: str, expected_fingerprint: str | None, expected_tokenizer_hash: str | None
) -> None:
    """Raise ManifestError unless the build is the one expected and holds rows."""
    if expected_fingerprint is not None and manifest.fingerprint != expected_fingerprint:
        raise ManifestError(
            f"{source}: fingerprint {manifest.fingerprint} differs from the expected {expected_fingerprint}: these "
            "shards were built from other inputs; point at the right build or rebuild it"
        )
    tokenizer_hash = manifest.inputs.tokenizer.content_hash
    # The 12 characters `varpack inspect` prints will do.
    if expected_tokenizer_hash is not None and not (
        tokenizer_hash == expected_tokenizer_hash
        or (len(expected_tokenizer_hash) >= MIN_HASH_PREFIX and tokenizer_hash.startswith(expected_tokenizer_hash))
    ):
        raise ManifestError(
            f"{source}: tokenizer content hash {tokenizer_hash} ({manifest.inputs.tokenizer.name}) differs from "
            f"the expected {expected_tokenizer_hash} (the full hash, or its first {MIN_HASH_PREFIX} characters or "
            "more): the shards hold another tokenizer's ids; rebuild them with the model's tokenizer"
        )
    if manifest.num_rows == 0:
        raise ManifestError(f"{source}: the build holds no rows, so there is nothing to train on; check the input data")


@dataclass(frozen=True)
class LoaderOptions:
    """The options of ``PackedIterableDataset`` and ``PackedMixture``: their keyword arguments, one to one.

    Checked when made; see ``PackedIterableDataset`` for what each does. ``shuffle_buffer_rows``
    None is each build's four shards of rows; ``rank`` and ``world_size`` None are
    torch.distributed's (or 0 and 1).

    >>> LoaderOptions(batch_rows=4, seed=1).tokens_per_batch is None
    True
    """

    batch_rows: int = 1
    tokens_per_batch: int | None = None
    shuffle: bool = True
    seed: int = 0
    shuffle_buffer_rows: int | None = None
    rank: int | None = None
    world_size: int | None = None
    expected_tokenizer_hash: str | None = None
    cache_dir: str | os.PathLike[str] | None = None
    verify_checksum: bool = True
    pad_to_fixed_shape: bool = False
    bucket_shapes: bool = False
    pad_token_id: int = 0
    loss_reduction: str = "token"

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.tokens_per_batch is None:
            positive_int("batch_rows", self.batch_rows)
        else:
            if self.batch_rows != 1:
                raise ValueError("give batch_rows or tokens_per_batch, not both")
            positive_int("tokens_per_batch", self.tokens_per_batch)
        if self.shuffle_buffer_rows is not None:
            positive_int("shuffle_buffer_rows", self.shuffle_buffer_rows)
        if self.bucket_shapes and not self.pad_to_fixed_shape:
            raise ValueError("bucket_shapes buckets the fixed shapes of pad_to_fixed_shape=True; set both")

    @classmethod
    def of(cls, options: LoaderOptions | None, settings: dict[str, Any]) -> LoaderOptions:
        """``options`` (or the defaults) with the keyword arguments ``settings`` in place; TypeError naming an unknown one."""
        unknown = sorted(set(settings) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown loader option {unknown[0]!r}; the options are the fields of LoaderOptions")
        return dataclasses.replace(options or cls(), **settings)


class BuildReader:
    """One build read alone: its manifest, its shards (each opened and checked once, then memory-mapped on
    demand), the tokens and segments of every row, and the order in which each epoch reads its rows.

    ``PackedIterableDataset`` batches one; ``PackedMixture`` blends several.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        options: LoaderOptions,
        expected_fingerprint: str | None = None,
        example_weights: np.ndarray | None = None,
    ) -> None:
        location = locate(source)
        manifest = location.read_manifest()
        check_manifest(manifest, location.source, expected_fingerprint, options.expected_tokenizer_hash)
        self.manifest = manifest
        self.source = location.source
        self.capacity = manifest.capacity
        self.shuffle, self.seed = bool(options.shuffle), int(options.seed)
        self.shuffle_buffer_rows = options.shuffle_buffer_rows or DEFAULT_SHUFFLE_WINDOW_SHARDS * manifest.rows_per_shard
        # Each shard's identity on disk when it was verified (or first opened): a reopen, here or in a worker, compares.
        self._paths, self._identities = checked_shards(location, manifest, options.cache_dir, options.verify_checksum)
        self._open_shards: OrderedDict[int, Shard] = OrderedDict()
        shards = [self._open(index) for index in range(len(self._paths))]
        self.row_tokens, self.row_segments = self._row_index(shards)
        self.loss_weighting = make_loss_weighting(
            options.loss_reduction, example_weights, manifest.num_example_ids, location.source,
            shards if options.loss_reduction == LossReduction.SEQUENCE else (),
        )
        self.first_row = np.concatenate(([0], np.cumsum([s.rows for s in manifest.shards]))).astype(np.int64)
        for index, shard in enumerate(shards[: self._max_open_shards()]):  # the first shards stay mapped
            self._open_shards[index] = shard

    @property
    def num_rows(self) -> int:
        return int(self.first_row[-1])

    def _row_index(self, shards: list[Shard]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and segments of every row, checked against the manifest's token counts."""
        tokens = [np.diff(shard.token_offsets).astype(np.int32) for shard in shards]
        for path, info, counts in zip(self._paths, self.manifest.shards, tokens):
            if int(counts.sum()) != info.tokens:
                raise ManifestError(f"{path}: holds {int(counts.sum())} tokens, the manifest says {info.tokens}; rebuild it")
        segments = [(np.diff(shard.cu_offsets) - 1).astype(np.int32) for shard in shards]
        return np.concatenate(tokens), np.concatenate(segments)

    def segments_histogram(self) -> dict[str, int]:
        """The manifest's histogram {segments in a row: rows}, checked against the shards."""
        counts, rows = np.unique(self.row_segments, return_counts=True)
        actual = {str(c): int(r) for c, r in zip(counts.tolist(), rows.tolist())}
        declared = {k: v for k, v in self.manifest.stats.segments_per_row.items() if v}
        if actual != declared:
            raise ManifestError(
                f"{self.source}: the manifest's stats.segments_per_row disagrees with the shards, so the fixed "
                "cu_seqlens length cannot be trusted; rebuild the manifest"
            )
        return declared

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """Row ids of the build in the order ``epoch`` reads them (``shuffle.epoch_row_order``)."""
        return epoch_row_order(np.diff(self.first_row), seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                               buffer_rows=self.shuffle_buffer_rows)

    def _open(self, index: int) -> Shard:
        """Open shard ``index``; one changed on disk since it was first opened is hashed again (refused unless whole)."""
        shard = open_build_shard(self._paths[index], self.manifest, index, verified=self._identities[index])
        self._identities[index] = shard.identity
        return shard

    def _max_open_shards(self) -> int:
        """How many shards stay mapped: twice a shuffle window's, and two more."""
        return 2 * -(-self.shuffle_buffer_rows // self.manifest.rows_per_shard) + 2

    def shard(self, index: int) -> Shard:
        """Shard ``index``, memory-mapped on first use; the least recently used are closed past a bound.

        Asked before every batch that reads from it: a shard truncated or rewritten since it was
        mapped is opened (and checked) again, so a truncated shard is refused, naming it, instead of
        killing the process with SIGBUS."""
        shard = self._open_shards.get(index)
        if shard is not None and not shard.unchanged():
            del self._open_shards[index]
            shard = None
        if shard is None:
            shard = self._open(index)
            self._open_shards[index] = shard
            while len(self._open_shards) > self._max_open_shards():
                self._open_shards.popitem(last=False)
        else:
            self._open_shards.move_to_end(index)
        return shard

    def shard_rows(self, rows: np.ndarray) -> list[tuple[Shard, int]]:
        """(shard, row in the shard) of each of the build's row ids."""
        shard_of_row = np.searchsorted(self.first_row, rows, side="right") - 1
        local = rows - self.first_row[shard_of_row]
        shards = {s: self.shard(s) for s in dict.fromkeys(shard_of_row.tolist())}  # each checked once per batch
        return [(shards[s], r) for s, r in zip(shard_of_row.tolist(), local.tolist())]

    def __getstate__(self) -> dict[str, Any]:
        # Open memory maps stay behind; a worker reopens what it reads.
        return {**self.__dict__, "_open_shards": OrderedDict()}


class PackedIterableDataset(IterableDataset):
    """Batches of packed rows as FlashAttention-2 varlen keyword arguments, for ``model(**batch)``.

    Each batch is a dict: ``input_ids``, ``labels`` and ``position_ids`` ([1, T] int64; labels
    are -100 on loss-masked tokens and on the first token of every example; positions restart
    at 0 per example), ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (int32 [n + 1], one tensor),
    ``max_length_q`` and ``max_length_k`` (Python ints). There is no ``attention_mask``.

    Args:
        source: a shard directory or manifest path, local or any fsspec URL (``s3://``,
            ``gs://``, ``file://``, ``memory://``). Remote shards are copied into ``cache_dir``
            (default ``$VARPACK_CACHE_DIR`` or ``~/.cache/varpack``) once and reused.
        batch_rows: rows per batch (each row is up to ``manifest.capacity`` tokens).
        tokens_per_batch: a token budget instead: each batch is as many whole rows as fit.
            Must be at least the capacity, so any row fits. Give this or ``batch_rows``.
        shuffle, seed: shuffle the shard order and the rows within a window of
            ``shuffle_buffer_rows`` rows (default: four shards' worth), from (seed, epoch).
        rank, world_size: the data-parallel rank and size; default torch.distributed's when
            initialised, else (0, 1). Pass them under tensor or pipeline parallelism.
        expected_fingerprint, expected_tokenizer_hash: refuse any other build or tokenizer.
        verify_checksum: check every shard's sha256 here, once per build on a host: the
            result is recorded in the cache directory and later readers of the unchanged
            files skip the hashing (``loaders/verify.py``). Remote copies are always verified
            when fetched. Sizes and row invariants are always checked.
        pad_to_fixed_shape: give every batch the same shapes, for torch.compile and CUDA
            graphs (``self.fixed_shape`` holds them): ``T = batch_rows * capacity`` (or
            ``tokens_per_batch``) tokens, the rows followed by pad sequences of at most
            ``capacity`` tokens (``pad_token_id``, labels -100, positions from 0);
            ``cu_seq_lens`` of a fixed length, the most segments any batch can hold (the
            fullest rows of the manifest's ``stats.segments_per_row``) plus the pad chunks
            plus one, filled by repeating its last value (zero-length sequences, which FA2
            skips); ``max_length`` = ``capacity``.
        bucket_shapes: with ``pad_to_fixed_shape``, keep ``T`` fixed but bound the rest by
            buckets instead of the worst case: ``max_length`` is the batch's longest sequence
            rounded up to a power of two, and ``cu_seq_lens`` holds a multiple of 64
            sequences. FA2 then launches no blocks for the worst case's empty sequences; the
            few shapes compile once each when ``cu_seq_lens`` and ``max_length`` are dynamic
            (``loaders.train.models.compile_layers``).
        loss_reduction, example_weights: how the loss weighs target tokens (``loaders/loss_weights.py``):
            ``"token"`` (every target the same) or ``"sequence"`` (every example the same), each
            optionally scaled by ``example_weights`` (one weight per example id, e.g. from a
            column or a mixture). Other than plain ``"token"``, batches carry ``loss_weights``
            and ``loss_weight_sum``, and the loss must be computed by ``loaders.loss_weights`` or the
            loss-position head.

    Every batch also carries ``num_real_tokens`` and ``num_loss_tokens`` (Python ints): the
    data tokens (the pad excluded) and the labels that are not -100. Under ``torch.compile``
    take them out before ``model(**batch)`` (an int argument would be compiled in as a
    constant), or let ``loaders.train.loss_head.use_loss_position_head`` consume them.

    Epochs and ranks: the epoch's batches are one list cut from the shuffled rows; global
    batch ``i`` goes to rank ``i % world_size``, and a rank's batch ``j`` to DataLoader
    worker ``j % num_workers``, so batches arrive in the same order for any number of
    workers. Every rank yields ``len(self)`` batches per epoch; to get there, the last
    ``num_batches % world_size`` batches of each epoch are dropped, and in row mode the
    ``num_rows % batch_rows`` rows that do not fill a batch: fewer than ``world_size *
    batch_rows`` rows per epoch, a different set each epoch when shuffling. Nothing repeats.

    Call ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``; DataLoader workers
    read the epoch it names, whole, persistent ones too (they take, at each pass, the position
    the training process's copy was set to, or reached reading itself, from memory they share
    with it; ``worker_ledger``). Without it, a reader that finishes its pass moves on to the next
    epoch by itself, so persistent workers walk through epochs 0, 1, 2, ... in order; so do the
    workers a DataLoader starts for each pass, from the training process's copy, which moves on
    with them (they tell it which epoch all of them read through). A pass through workers broken
    off before a worker read its share through is refused at the next pass, until ``set_epoch``:
    which of its batches the loop took is unknown.

    Options: the keyword arguments, or ``options=LoaderOptions(...)`` (the two combine: a keyword
    argument replaces that field), the one set of options ``PackedMixture`` shares.

    Resume: ``state_dict()`` / ``load_state_dict()`` hold (epoch, next batch). Iterating in
    the training process (``num_workers=0``: far more than a GPU consumes, and faster than
    workers, whose batches are copied between processes) the state is exact. With workers,
    use torchdata's ``StatefulDataLoader``, which collects the workers' states;
    ``dataset.load_state_dict(loader.state_dict())`` turns that back into the rank's
    position, so a run can resume under another ``num_workers``. Load it into the dataset
    even under the same ``num_workers`` (``loader.load_state_dict`` may follow): a loader
    state saved after the epoch's pass ended makes torchdata drop the workers' states and
    start afresh from the dataset. A plain ``DataLoader`` with workers loses only the resume.
    A resumed run reads what the uninterrupted run reads, from any point: a state saved after
    an epoch's loop ended resumes at the next epoch (see ``set_epoch``). A position outside
    the epoch is refused.

    Elastic resume: a state saved by any rank of a run on N ranks (all at the same step) loads
    into any rank of a run on M ranks, also with another ``batch_rows`` or ``tokens_per_batch``.
    The state says how many of the epoch's rows all ranks had read; the new run cuts its list of
    batches from the rows after them, so every row of the epoch is read once, but for the tail
    that does not fill a batch on every rank. Another build, seed or shuffle is refused.
    """

    _plan_cache: tuple[tuple[int, int], EpochPlan] | None

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        options: LoaderOptions | None = None,
        expected_fingerprint: str | None = None,
        example_weights: np.ndarray | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        options = LoaderOptions.of(options, settings)
        self.reader = BuildReader(source, options, expected_fingerprint, example_weights)
        self.manifest = self.reader.manifest
        self.source = self.reader.source
        self.shuffle_buffer_rows = self.reader.shuffle_buffer_rows
        self.loss_weighting = self.reader.loss_weighting
        self._start(options, self.reader.row_tokens, self.reader.row_segments,
                    self.reader.segments_histogram() if options.pad_to_fixed_shape else None)

    # ---- set-up, shared with PackedMixture ------------------------------------------------------

    def _start(self, options: LoaderOptions, row_tokens: np.ndarray, row_segments: np.ndarray,
               segments_histogram: dict[str, int] | None) -> None:
        """Set the batching options of the rows ``row_tokens`` (of ``self.manifest``'s capacity) and start at epoch 0."""
        self.options = options
        self.capacity = self.manifest.capacity
        self.rank, self.world_size = resolve_rank(options.rank, options.world_size)
        self.shuffle, self.seed = bool(options.shuffle), int(options.seed)
        self.batch_rows: int | None = options.batch_rows if options.tokens_per_batch is None else None
        self.tokens_per_batch: int | None = options.tokens_per_batch
        if self.tokens_per_batch is not None and self.tokens_per_batch < self.capacity:
            raise ValueError(
                f"tokens_per_batch={self.tokens_per_batch} is smaller than one row (capacity {self.capacity} "
                f"tokens), so a full row would not fit; use at least {self.capacity}, or rebuild with a smaller max_len"
            )
        self.pad_token_id = int(options.pad_token_id)
        self.bucket_shapes = bool(options.bucket_shapes)
        self._row_tokens = row_tokens
        self._row_segments = row_segments
        if row_tokens.size < self.world_size:
            raise ValueError(
                f"world size {self.world_size} is larger than the {row_tokens.size} rows of {self.source}: "
                "some ranks would get no data; use fewer ranks or more data"
            )
        self.fixed_shape: FixedShape | None = (
            None if segments_histogram is None else self._batch_shape(segments_histogram))
        self._start_reading()
        if len(self) == 0:
            per_batch = f"{self.batch_rows} rows" if self.batch_rows else f"up to {self.tokens_per_batch} tokens"
            raise ValueError(
                f"{self.source}: {row_tokens.size} rows make fewer batches of {per_batch} than the world size "
                f"{self.world_size}, so every rank would get none; use smaller batches or fewer ranks"
            )

    def _batch_shape(self, segments_per_row: dict[str, int]) -> FixedShape:
        """The fixed shape of this reader's batches, given the histogram of segments per row of its rows."""
        if self.batch_rows is not None:
            tokens, rows_per_batch = self.batch_rows * self.capacity, self.batch_rows
        else:
            assert self.tokens_per_batch is not None  # one of the two budgets is always set
            tokens = self.tokens_per_batch
            rows_per_batch = max_rows_per_batch(self._row_tokens, tokens)
        return fixed_shape(
            tokens, max_segments_per_batch(segments_per_row, rows_per_batch), self.capacity, self.bucket_shapes
        )

    def _identity(self) -> dict[str, Any]:
        """The settings that fix the order of the epoch's rows; a state only resumes under the same."""
        return {
            "fingerprint": self.manifest.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer_rows": self.shuffle_buffer_rows,
        }

    def _layout(self) -> dict[str, Any]:
        """How this reader cuts the rows into batches and deals them; a resume may change it (``LAYOUT_KEYS``)."""
        return {"world_size": self.world_size, "batch_rows": self.batch_rows, "tokens_per_batch": self.tokens_per_batch,
                "rank": self.rank}

    # ---- epochs, plans and batches -------------------------------------------------------------

    def _plan(self, epoch: int, start_row: int = 0) -> EpochPlan:
        """This rank's batches of ``epoch``, cut from its rows after the first ``start_row`` (cached for the latest)."""
        if self._plan_cache is None or self._plan_cache[0] != (epoch, start_row):
            self._plan_cache = ((epoch, start_row), self._plan_of(self._epoch_rows(epoch)[start_row:], self._layout()))
        return self._plan_cache[1]

    def _plan_of(self, rows: np.ndarray, layout: dict[str, Any]) -> EpochPlan:
        """The batches of rank ``layout["rank"]`` cut from ``rows`` under ``layout`` (this reader's, or a saved one)."""
        return plan_epoch(rows, self._row_tokens, rank=layout["rank"], world_size=layout["world_size"],
                          batch_rows=layout["batch_rows"] or 1, tokens_per_batch=layout["tokens_per_batch"])

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        """Row ids in the order ``epoch`` reads them."""
        return self.reader.epoch_rows(epoch)

    def _collate(self, rows: np.ndarray) -> dict[str, torch.Tensor | int]:
        """The batch of the given row ids."""
        shard_rows = self.reader.shard_rows(rows)
        batch = collate_rows(shard_rows, fixed=self.fixed_shape, pad_token_id=self.pad_token_id)
        if self.loss_weighting.is_plain_token_mean:
            return batch
        return add_loss_weights(batch, shard_rows, self.loss_weighting)

    def _start_reading(self) -> None:
        """The reading state of a new dataset: epoch 0 from its first batch, nothing loaded, no plan cached."""
        self._position = Position(epoch=0)
        self._loaded = False
        self._restored_in_worker = False  # the loaded position is a DataLoader worker's own, given back by torchdata
        self._skip_restoring_pass = False
        self._loader_pass_ended = False  # the loaded state is a StatefulDataLoader's whose pass had run out
        # What this copy and its DataLoader workers tell each other (whether they read it, the epoch set_epoch
        # named, which epoch they read through).
        self._ledger = WorkerLedger()
        self._plan_cache = None

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch; the current epoch keeps its position (so a resumed run may call it).

        A state loaded from the end of an epoch stays there when ``set_epoch`` names the finished
        epoch (before or after ``load_state_dict``): that pass reads nothing, and the next
        ``set_epoch`` starts the next epoch, as in the run that saved the state. Without
        ``set_epoch`` the next pass is the next epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch < MAX_COUNT:
            raise ValueError(f"epoch must be an integer from 0 to 2**53 - 1 (what a state holds), got {epoch!r}")
        self._catch_up_with_workers()
        self._ledger.epoch_named = int(epoch)
        if epoch == self._position.epoch and (self._loaded or not self._position.finished):
            # The epoch is read from this position, also after a broken pass; a loaded one stays loaded.
            self._move_to(self._position, self._loaded, self._loader_pass_ended)
        else:
            self._move_to(Position(epoch=int(epoch)))

    @property
    def epoch(self) -> int:
        return self._position.epoch

    def __len__(self) -> int:
        """Batches per epoch on this rank (for the current epoch: under a token budget it can vary by a few; after
        a resume under another layout, those of the rest of the epoch)."""
        return len(self._plan(self._position.epoch, self._position.start_row))

    def epochs_read(self) -> float:
        """The epochs this rank has read: the epoch, plus the share of its rows that all ranks had read (1.2 after
        6 batches of an epoch of 5). Counted in rows, so that after a resume under another layout, whose batches
        are cut from the rows after those read before, the rows read before count too."""
        position = self._position
        if position.finished:
            return position.epoch + 1.0
        read, plan = self._rows_read_now()
        return position.epoch + read / max(position.start_row + plan.rows_read(len(plan)), 1)

    def _rows_read_now(self) -> tuple[int, EpochPlan]:
        """How many of the epoch's rows all ranks had read where this position stands, and the plan of the rest."""
        position = self._position
        plan = self._plan(position.epoch, position.start_row)
        return position.start_row + plan.rows_read(position.batches_read(len(plan))), plan

    # ---- iteration and resume -----------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | int]]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            self._ledger.read_by_workers = True
            self._follow_training_process()
        if self._skip_restoring_pass:
            # torchdata's iterator restoring a loader whose pass had run out: the loop never sees it.
            self._skip_restoring_pass = False
            return iter(())
        self._catch_up_with_workers()
        position = self._position
        if position.finished and self._loaded and self._ledger.epoch_named == position.epoch:
            # The loop names the finished epoch: this pass reads nothing, and stays where the epoch finished.
            done = position.batches_read(len(self._plan(position.epoch, position.start_row)))
            self._position = Position(position.epoch, position.start_row, done, done + worker_id, worker_id, num_workers,
                                      finished=True)
            return self._finished_pass()
        if position.finished and (position.num_workers == 1 or not self._loaded):
            position = Position(epoch=position.epoch + 1)
        if info is None and self._ledger.broken_off((position.epoch, position.start_row), None):
            raise ValueError(self._broken_pass_message(position.epoch))
        pass_start, first = position.first_batch(worker_id, num_workers, self._loaded and self._restored_in_worker)
        # Set the position now, not on the first next(): torchdata reads the state right after iter().
        self._position = Position(position.epoch, position.start_row, pass_start, first, worker_id, num_workers)
        self._loaded = False
        if info is None:  # persistent workers go on from where this pass leaves the training process's copy
            self._ledger.forget_passes(self._reading_state())
        return self._batches(position.epoch, position.start_row, first, num_workers)

    def _follow_training_process(self) -> None:
        """In a persistent DataLoader worker, as a later pass begins: read from where the training process's dataset
        was set to (``set_epoch``, ``load_state_dict``) since the worker's previous pass, as a worker started now
        would, instead of going on from its own place. A worker's own state, given back by torchdata, that no pass
        has read from yet stays (a worker started now would be given it too)."""
        reading_state = self._ledger.join()
        if reading_state is None or self._skip_restoring_pass or (self._loaded and self._restored_in_worker):
            return
        epoch, start_row, pass_start, next_batch, worker_id, num_workers, finished, loaded, loader_pass_ended = reading_state
        self._position = Position(epoch, start_row, pass_start, next_batch, worker_id, num_workers, bool(finished))
        self._loaded, self._loader_pass_ended, self._restored_in_worker = bool(loaded), bool(loader_pass_ended), False

    def _reading_state(self) -> tuple[int, ...]:
        """Where this copy reads from, as integers for the ledger: its position, whether it was loaded from a state,
        and whether that state's loader pass had ended (``_follow_training_process`` reads them back)."""
        position = self._position  # field by field: dataclasses.astuple deep-copies, and this runs after every batch
        return (position.epoch, position.start_row, position.pass_start, position.next_batch, position.worker_id,
                position.num_workers, int(position.finished), int(self._loaded), int(self._loader_pass_ended))

    def _share(self) -> tuple[int, int, int]:
        """This reader's share of its pass, as the ledger names it: (epoch, start_row, num_workers)."""
        return self._position.epoch, self._position.start_row, self._position.num_workers

    def _start_share(self) -> None:
        """In a DataLoader worker: mark its share of the pass started in the ledger, or refuse one that an earlier
        pass started and broke off (see ``WorkerLedger``): which of its batches the loop took is unknown. Called on
        the first ``next()``, where torch passes a worker's error on to the loop (one in ``iter()`` ends it)."""
        if get_worker_info() is not None and not self._ledger.start_share(self._position.worker_id, self._share()):
            raise ValueError(self._broken_pass_message(self._position.epoch))

    def _broken_pass_message(self, epoch: int) -> str:
        return (f"{self.source}: a pass through DataLoader workers over epoch {epoch} was broken off before its end, "
                f"so which of its batches were read is unknown; call dataset.set_epoch(epoch) before each pass "
                f"(set_epoch({epoch}) reads epoch {epoch} again, whole, also through persistent workers), or resume with "
                "loader.load_state_dict(state) from StatefulDataLoader.state_dict()")

    def _finished_pass(self) -> Iterator[dict[str, torch.Tensor | int]]:
        """The empty pass of a loop that names the finished epoch of a loaded state. The state counts as loaded until
        the pass is run through: torchdata restoring a finished loader makes an iterator it never runs, then the one
        the loop runs, and both must name the finished epoch (or the second would read the next epoch under its
        number). Once run through, a pass without ``set_epoch`` reads the next epoch."""
        self._start_share()
        self._loaded = False
        if get_worker_info() is None:  # read by the training process itself: persistent workers go on from here
            self._ledger.forget_passes(self._reading_state())
        self._read_through()
        return
        yield

    def _batches(self, epoch: int, start_row: int, first: int, num_workers: int) -> Iterator[dict[str, torch.Tensor | int]]:
        self._start_share()
        plan = self._plan(epoch, start_row)
        for position in range(first, len(plan), num_workers):
            batch = self._collate(plan.batch_rows(position))
            self._position = dataclasses.replace(self._position, next_batch=position + num_workers)
            self._publish_reading_state()
            yield batch
        self._position = dataclasses.replace(self._position, finished=True)
        self._publish_reading_state()
        self._read_through()

    def _publish_reading_state(self) -> None:
        """In the training process, reading the dataset itself: where its pass stands, for the persistent workers'
        next pass (a worker started then would copy it)."""
        if get_worker_info() is None:
            self._ledger.read_on(self._reading_state())

    def _read_through(self) -> None:
        """A DataLoader worker read its share of the pass through: once all have, the next workers start after it."""
        if get_worker_info() is not None:
            self._ledger.finish_share(self._position.worker_id, self._share())

    def _catch_up_with_workers(self) -> None:
        """Stand where the DataLoader workers' latest pass ended, when they read one through from this copy.

        Workers read copies of the dataset, made from the training process's, whose position stays
        where it was; without this, every pass of new workers (or a later ``set_epoch``) would start
        from there again instead of moving to the next epoch. A worker's own restored position is its own.
        """
        if self._loaded and self._restored_in_worker:
            return
        if self._loaded and self._position.finished and self._ledger.read_past(self._position.epoch):
            self._loaded = False  # a pass of workers went on from the loaded epoch's end, as from a finished pass
        epoch = self._ledger.epoch_read
        if epoch >= self._position.epoch:
            self._position = Position(epoch=epoch, finished=True)
            self._loaded = False

    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands: plain values, for JSON (see the class docstring).

        Raises StaleStateError in the training process once DataLoader workers have read this
        dataset: they read copies of it, so its own position would replay what they read.
        """
        if get_worker_info() is None and self._ledger.read_by_workers:
            raise StaleStateError(
                f"{self.source}: DataLoader workers read this dataset, so its position in the training process is "
                "not the loader's; save torchdata's StatefulDataLoader.state_dict() instead (exact for any "
                "num_workers), or read with num_workers=0"
            )
        position = self._position
        rows_read = None
        if position.num_workers == 1:  # a rank-level position: all ranks at this step had read as many rows
            rows_read = self._rows_read_now()[0]
        return to_state_dict(position, self._identity(), self._layout(), rows_read)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position in ``state_dict``: this dataset's own, or a whole StatefulDataLoader state.

        The next iteration seeks straight to the next batch; nothing before it is read again. A state
        saved under another layout (world size, batch size) continues after the rows all ranks had read.
        """
        saved = self._read_state(state_dict)
        rows = self._epoch_rows(saved.position.epoch)
        self._check_saved_position(saved, rows)
        same = saved.layout == self._layout()
        self._set_position(saved.position if same else self._elastic_position(saved, rows), saved)

    def _read_state(self, state_dict: dict[str, Any]) -> SavedState:
        """The position and layout of ``state_dict``, its identity and layout checked; a rank's own state, or any
        rank's of the same layout (all ranks stand at the same step)."""
        saved = from_state_dict(state_dict, self._identity(), tuple(self._layout()))
        check_layout(saved.layout, self.capacity)
        position = saved.position
        if position.num_workers > 1 and get_worker_info() is None:
            raise ValueError(
                f"this state is DataLoader worker {position.worker_id}'s alone; load the StatefulDataLoader's "
                "whole state_dict instead (dataset.load_state_dict(loader.state_dict()))"
            )
        if {**saved.layout, "rank": self.rank} == self._layout():
            return dataclasses.replace(saved, layout=self._layout())
        return saved

    def _check_saved_position(self, saved: SavedState, rows: np.ndarray) -> None:
        """ValueError unless ``saved``'s position lies inside its epoch's ``rows`` as its layout cuts them."""
        position = saved.position
        if position.start_row > rows.size:
            raise ValueError(f"loader state: start_row {position.start_row} must be in [0, {rows.size}] (epoch "
                             f"{position.epoch} has {rows.size} rows); the state is corrupt or was edited")
        check_position(position, len(self._plan_of(rows[position.start_row:], saved.layout)))
        if saved.rows_read is not None and position.num_workers == 1 and saved.rows_read != self._rows_read(saved, rows):
            raise ValueError(f"loader state: rows_read {saved.rows_read} must be {self._rows_read(saved, rows)}, the "
                             f"rows all ranks had read at next_batch {position.next_batch} of epoch {position.epoch}; "
                             "the state is corrupt or was edited")

    def _elastic_position(self, saved: SavedState, rows: np.ndarray) -> Position:
        """A rank-level position of this reader's layout where ``saved`` (of another layout) stands in ``rows``.

        The rows all ranks had read come first; this reader's batches are cut from the rest. A
        finished epoch stays finished there: a loop that names it reads nothing more of it. A worker's
        own state, given back by torchdata (even the one worker's), cannot be placed so: torchdata goes
        on counting the batches of the pass that saved it.
        """
        position = saved.position
        if position.num_workers > 1 or get_worker_info() is not None:
            raise ValueError(
                f"this state is DataLoader worker {position.worker_id}'s, saved with world_size "
                f"{saved.layout['world_size']}, batch_rows {saved.layout['batch_rows']} and tokens_per_batch "
                f"{saved.layout['tokens_per_batch']}; to resume under other ones, load the StatefulDataLoader's whole "
                "state into the dataset (dataset.load_state_dict(loader.state_dict())), not into the new loader"
            )
        return Position(position.epoch, self._rows_read(saved, rows), finished=position.finished)

    def _rows_read(self, saved: SavedState, rows: np.ndarray) -> int:
        """How many of the epoch's ``rows`` all ranks had read where the rank-level ``saved`` position stands."""
        position = saved.position
        plan = self._plan_of(rows[position.start_row:], saved.layout)
        return position.start_row + plan.rows_read(position.batches_read(len(plan)))

    def _set_position(self, position: Position, saved: SavedState) -> None:
        """Read from ``position``, that of ``saved``, next (already checked against its epoch).

        In a DataLoader worker, ``saved`` is the worker's own state, given back by torchdata into a
        copy of the training process's dataset. When the state loaded there said the loader's pass had
        run out, torchdata restores through an iterator the loop never sees and then starts the one the
        loop runs: the worker skips the first and reads the second from where the pass ended, as the
        training process's copy does (the workers' own states were saved before their pass ended).
        """
        info = get_worker_info()
        if info is not None and self._loader_pass_ended and position.epoch == self._position.epoch:
            self._skip_restoring_pass = True
            return
        if info is not None:
            self._ledger.forget_share(info.id)  # its own state says where the loop stood
        self._move_to(position, loaded=True, loader_pass_ended=saved.loader_pass_ended)
        self._restored_in_worker = info is not None
        if info is None:
            self._ledger.read_by_workers = False  # the position is the loader's again

    def _move_to(self, position: Position, loaded: bool = False, loader_pass_ended: bool = False) -> None:
        """Read from ``position`` next (``loaded`` from a state, whose loader pass had ended or not); in the training
        process, DataLoader workers start there too, new ones and persistent ones at their next pass."""
        self._position = position
        self._loaded = loaded
        self._loader_pass_ended = loader_pass_ended
        if get_worker_info() is None:
            self._ledger.forget_passes(self._reading_state())

    def __getstate__(self) -> dict[str, Any]:
        # The cached plan stays behind; the ledger goes along as WorkerLedger pickles it.
        return {**self.__dict__, "_plan_cache": None}
