"""``PackedMixture``: several builds in one stream of batches, in exact proportions.

    mixture = PackedMixture({"flan": "shards/flan-...", "gsm8k": "shards/gsm8k-..."},
                            weights={"flan": 0.7, "gsm8k": 0.3}, unit="tokens", batch_rows=2, seed=0)

Each build is read by its own ``BuildReader`` (``loaders.dataset``: its shards, rows and
shuffle), through public methods; the mixture shares ``LoaderOptions`` with
``PackedIterableDataset``. A build's rows form an endless stream, epoch after epoch of that
build, each reshuffled from (seed, epoch).
``loaders.blend`` interleaves the streams row by row, earliest eligible deadline first, so
every prefix of the mixture holds each source's share of the unit (real tokens, loss tokens or
rows) to within one row. The interleaved rows are then cut into batches and dealt to ranks and
workers exactly as one build's rows are (``loaders.partition``), so the mixture has the same
guarantees: equal batches on every rank, any number of workers, exact resume.

A mixture epoch takes as many units as all the builds hold together; a source with a large
weight and few units is repeated within it (``plan()`` says how often), up to its
``max_epochs``. The rows an epoch's batches leave over are not taken: they are the next
epoch's first, so the rows trained over all epochs are one schedule, and every build's stream
is trained in order with no row skipped. ``python -m loaders.mixture MIXTURE.json`` prints the plan of a mixture file
and the shares realised over its first steps (``--plot FILE.png`` draws them; matplotlib is
imported for it only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import reprlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils.data import IterableDataset

from loaders.blend import BlendState, blend, check_weights, integer_weights
from loaders.collate import IGNORE_INDEX, SOURCE_IDS, collate_rows
from loaders.dataset import BuildReader, LoaderOptions, PackedIterableDataset
from loaders.loss_weights import LossReduction, LossWeighting, add_loss_weights
from loaders.partition import max_rows_per_batch
from loaders.shard_reader import Shard
from schemas import Manifest, ManifestError, VarpackError, one_of, positive_int, storage


class MixtureUnit(StrEnum):
    """What the weights share out: real tokens, trained (loss) tokens, or packed rows."""

    TOKENS = "tokens"
    LOSS_TOKENS = "loss_tokens"
    ROWS = "rows"


@dataclass(frozen=True)
class SourcePlan:
    """One source of a mixture: its weight, what it holds, and how often one mixture epoch reads it."""

    name: str
    source: str
    weight: float
    tokens: int
    loss_tokens: int
    rows: int
    epochs_per_mixture_epoch: float
    max_epochs: int | None


@dataclass(frozen=True)
class _StreamPosition:
    """Where a source's endless stream stands: epoch ``epoch`` of the build, its row ``offset`` next."""

    epoch: int = 0
    offset: int = 0


@dataclass(frozen=True)
class ScheduleStart:
    """Where a mixture epoch's rows start: the schedule since the weights took effect, the units each source
    had given before (``since``: all 0 until a resume changes the weights), and each source's stream position."""

    blend: BlendState
    since: tuple[int, ...]
    streams: tuple[_StreamPosition, ...]

    @classmethod
    def first(cls, num_sources: int) -> ScheduleStart:
        return cls(BlendState.start(num_sources), (0,) * num_sources, (_StreamPosition(),) * num_sources)


SCHEDULE = "mixture_schedule"  # the state dict's key for where the state's mixture epoch starts
MAX_COUNT = 1 << 53  # units or epochs a float counts exactly; no run reads as many


def row_loss_tokens(shard: Shard) -> np.ndarray:
    """Labels that are not -100 in each row: loss-mask tokens, less the first token of each segment."""
    trained = np.concatenate(([0], np.cumsum(shard.loss_mask, dtype=np.int64)))
    per_row = trained[shard.token_offsets[1:]] - trained[shard.token_offsets[:-1]]
    entry_row = np.repeat(np.arange(shard.num_rows), np.diff(shard.cu_offsets))
    is_end = np.zeros(shard.cu_seqlens.size, dtype=bool)
    is_end[shard.cu_offsets[1:] - 1] = True
    starts = shard.cu_seqlens[~is_end].astype(np.int64) + shard.token_offsets[entry_row[~is_end]]
    return per_row - np.bincount(entry_row[~is_end], weights=shard.loss_mask[starts], minlength=shard.num_rows).astype(np.int64)


def source_counts(batch: dict, num_sources: int) -> dict[str, np.ndarray]:
    """Real tokens and loss tokens of each source in a mixture batch (int64 [num_sources] each)."""
    source_ids = batch[SOURCE_IDS].numpy()
    cu = batch["cu_seq_lens_q"].numpy().astype(np.int64)
    lengths = np.diff(cu)[: source_ids.size]
    targets = batch["labels"][0].numpy() != IGNORE_INDEX
    trained = np.concatenate(([0], np.cumsum(targets)))
    loss = trained[cu[1 : source_ids.size + 1]] - trained[cu[: source_ids.size]]
    return {
        "tokens": np.bincount(source_ids, weights=lengths, minlength=num_sources).astype(np.int64),
        "loss_tokens": np.bincount(source_ids, weights=loss, minlength=num_sources).astype(np.int64),
    }


class PackedMixture(PackedIterableDataset):
    """Batches drawn from several builds in fixed proportions, with the options and state of ``PackedIterableDataset``.

    Args:
        sources: {name: build directory or manifest} (local or any fsspec URL); the builds must
            share the tokenizer (content hash) and the row capacity.
        weights: {name: positive weight}, one per source; normalised to sum to 1.
        unit: what the weights share out: ``"tokens"`` (real tokens), ``"loss_tokens"`` (trained
            tokens) or ``"rows"``.
        max_epochs: {name: the most epochs of that build the stream may read}; a source not
            named repeats without bound. A mixture epoch that needs more fails with a ValueError.
        options, and the rest as keyword arguments: ``PackedIterableDataset``'s ``LoaderOptions``
            (``shuffle_buffer_rows`` applies to every build; by default each build's own four
            shards). ``expected_fingerprint`` and ``example_weights`` are per build and not taken.

    A state may be loaded under other weights, world size or batch size (``load_state_dict``):
    the new weights' shares hold from that step on.

    Every batch also carries ``source_ids`` (int64 [n]): the source index (the order of
    ``sources``) of each real sequence of ``cu_seq_lens``; a fixed shape's pad sequences after
    them have none. ``source_counts(batch, len(mixture.names))`` turns it into tokens per source.
    """

    def __init__(
        self,
        sources: Mapping[str, str | os.PathLike[str]],
        *,
        weights: Mapping[str, float],
        unit: str = "tokens",
        max_epochs: Mapping[str, int] | None = None,
        options: LoaderOptions | None = None,
        **settings: Any,
    ) -> None:
        IterableDataset.__init__(self)
        if not sources:
            raise ValueError("a mixture needs at least one source")
        if "example_weights" in settings or "expected_fingerprint" in settings:
            name = "example_weights" if "example_weights" in settings else "expected_fingerprint"
            raise TypeError(f"{name} is per build, so a mixture does not take it")
        options = LoaderOptions.of(options, settings)
        self.names = list(sources)
        for name, path in sources.items():
            _check_build(name, path)
        self.unit = one_of("unit", unit, MixtureUnit)
        self.weights = check_weights(weights, self.names)
        self.max_epochs = _check_max_epochs(max_epochs, self.names)
        self._readers: list[BuildReader] = []
        for name, path in sources.items():
            try:
                self._readers.append(BuildReader(path, options))
            except FileNotFoundError as err:
                raise ManifestError(f"mixture source {name!r}: {path}: no such build ({err})") from None
            except ManifestError as err:  # the build's own error names its file; this names the source too
                raise type(err)(f"mixture source {name!r}: {err}") from None
        _check_compatible(self.names, self._readers)
        self.manifest = self._readers[0].manifest  # the builds share its tokenizer and capacity; manifests() has each
        self.builds = {name: reader.source for name, reader in zip(self.names, self._readers)}
        self.source = "mixture of " + ", ".join(f"{name}={build}" for name, build in self.builds.items())
        self.shuffle_buffer_rows = options.shuffle_buffer_rows or 0  # 0: each build's own default

        self._source_first_row = np.concatenate(([0], np.cumsum([r.num_rows for r in self._readers])))
        # Each global row's (source, row of that build): a batch's rows are one lookup.
        self._row_place = np.stack((
            np.repeat(np.arange(len(self._readers)), np.diff(self._source_first_row)),
            np.concatenate([np.arange(r.num_rows) for r in self._readers]),
        ), axis=1)
        self._row_units = [self._units(i) for i in range(len(self._readers))]
        self._global_row_units = np.concatenate(self._row_units)  # indexed by global row id
        self.epoch_units = float(sum(u.sum() for u in self._row_units))
        for name, units in zip(self.names, self._row_units):
            if units.sum() == 0:
                raise ValueError(f"mixture source {name!r} holds no {self.unit.value}, so no share of them can come "
                                 "from it; drop it or use another unit")
        self.loss_weighting, self._id_offsets = _combined_weighting(options.loss_reduction, self._readers)
        # Where each mixture epoch's rows start (the schedule's state and each source's stream position), by epoch.
        self._epoch_starts: dict[int, ScheduleStart] = {0: ScheduleStart.first(len(self._readers))}
        self._latest_rows: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))  # the last epoch blended
        histogram = _summed_histograms(self._readers) if options.pad_to_fixed_shape else None
        self._start(options, np.concatenate([r.row_tokens for r in self._readers]),
                    np.concatenate([r.row_segments for r in self._readers]), histogram)

    # ---- set-up -------------------------------------------------------------------------

    @functools.cached_property
    def _row_loss_tokens(self) -> list[np.ndarray]:
        """Each source's loss tokens per row (read when the unit or the plan needs them)."""
        return [np.concatenate([row_loss_tokens(r.shard(i)) for i in range(len(r.manifest.shards))])
                for r in self._readers]

    def _units(self, source: int) -> np.ndarray:
        """The size of each row of ``source`` in the mixture's unit."""
        if self.unit == MixtureUnit.ROWS:
            return np.ones(self._readers[source].manifest.num_rows, dtype=np.int64)
        if self.unit == MixtureUnit.LOSS_TOKENS:
            return self._row_loss_tokens[source].astype(np.int64)
        return self._readers[source].row_tokens.astype(np.int64)

    @property
    def readers(self) -> tuple[BuildReader, ...]:
        """Each source's reader, in the order of ``names``."""
        return tuple(self._readers)

    def manifests(self) -> dict[str, Any]:
        """Each source's manifest, by name."""
        return {name: reader.manifest for name, reader in zip(self.names, self._readers)}

    def plan(self) -> list[SourcePlan]:
        """Per source: weight, tokens, loss tokens, rows, and how many of its epochs one mixture epoch reads."""
        return [
            SourcePlan(name, reader.source, float(weight), reader.manifest.num_tokens, int(loss.sum()),
                       reader.manifest.num_rows, float(weight * self.epoch_units / units.sum()),
                       None if cap == 0 else int(cap))
            for name, reader, weight, loss, units, cap in zip(
                self.names, self._readers, self.weights, self._row_loss_tokens, self._row_units, self.max_epochs)
        ]

    def _identity(self) -> dict[str, Any]:
        """The single build's settings, with the mixture (builds in order, unit, caps) in place of its fingerprint
        (a state of a single build, which names one, is refused). The order counts: ties in the schedule go to
        the earlier source."""
        return {
            "sources": list(self.names),
            "mixture": {name: reader.manifest.fingerprint for name, reader in zip(self.names, self._readers)},
            "unit": self.unit.value,
            "max_epochs": dict(zip(self.names, self.max_epochs.tolist())),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer_rows": self.shuffle_buffer_rows,
        }

    def _layout(self) -> dict[str, Any]:
        """A single build's layout, and the weights: a resume may change them, from its step on."""
        return {**super()._layout(), "weights": dict(zip(self.names, self.weights.tolist()))}

    # ---- the schedule -------------------------------------------------------------------

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        """Global row ids (source ``i``'s rows after those of the sources before it) of mixture epoch ``epoch``.

        Blends from the latest epoch whose start is known (epoch 0, or one a loaded state names).
        """
        if self._latest_rows[0] != epoch:
            for known in range(max(e for e in self._epoch_starts if e <= epoch), epoch + 1):
                start = self._epoch_starts[known]
                rows = self._blend(start, self.weights, known)
                self._epoch_starts.setdefault(known + 1, self._trained_end(rows, start))
            self._latest_rows = (epoch, rows)
        return self._latest_rows[1]

    def _epoch_start(self, epoch: int) -> ScheduleStart:
        """Where mixture epoch ``epoch``'s rows start: the schedule's state and each source's stream position."""
        if epoch not in self._epoch_starts:
            self._epoch_rows(epoch)
        return self._epoch_starts[epoch]

    def source_epochs(self, epoch: int) -> dict[str, float]:
        """How many epochs of each build the stream has trained by the end of mixture epoch ``epoch``: the repetition."""
        streams = self._epoch_start(epoch + 1).streams
        return {name: p.epoch + p.offset / reader.num_rows for name, reader, p in zip(self.names, self._readers, streams)}

    def _blend(self, start: ScheduleStart, weights: np.ndarray, epoch: int) -> np.ndarray:
        """The rows of mixture epoch ``epoch`` from ``start`` on, blended at ``weights``."""
        state = start.blend
        until = (epoch + 1) * self.epoch_units - sum(start.since)  # in units taken since the weights took effect
        # A source is less than a row behind its share, and its last pick starts before ``until``.
        slack = 2 * max(float(u.max()) for u in self._row_units)
        positions = list(start.streams)
        rows: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        while state.total < until:
            # Each source's next rows, enough for its share of what is left (and repeats past its epoch).
            supply = [self._supply(i, positions[i], w * (until - state.total) + slack) for i, w in enumerate(weights)]
            picks, taken, state = blend([self._row_units[i][s] for i, s in enumerate(supply)], weights, state, until)
            if not picks.size:  # the source due next may not repeat again
                name = self.names[next(i for i, s in enumerate(supply) if not s.size)]
                cap = self.max_epochs[self.names.index(name)]
                raise ValueError(
                    f"mixture epoch {epoch} needs more of source {name!r} than its max_epochs={cap} epochs; raise "
                    "its max_epochs, lower its weight, or train for fewer epochs"
                )
            chosen = np.empty(picks.size, dtype=np.int64)
            for i, stream in enumerate(supply):
                chosen[picks == i] = stream[: taken[i]] + self._source_first_row[i]
                positions[i] = self._advance(i, positions[i], int(taken[i]))
            rows.append(chosen)
        return np.concatenate(rows)

    def _trained_end(self, rows: np.ndarray, start: ScheduleStart) -> ScheduleStart:
        """Where the schedule stands after the rows of an epoch that the ranks read, from its ``start``.

        The rows the batches leave over at the epoch's end (``EpochPlan.dropped_rows``) are not
        taken: the next epoch's schedule, from the same state, picks them first. So the rows
        trained, epoch after epoch, are one schedule, and every source's stream is read in order
        with no row skipped.
        """
        plan = self._plan_of(rows, {**self._layout(), "rank": 0})
        return self._taken(start, rows[: plan.rows_read(len(plan))])

    def _taken(self, start: ScheduleStart, rows: np.ndarray, weights_change: bool = False) -> ScheduleStart:
        """The schedule after ``rows`` (global ids) are taken from ``start``; with ``weights_change``, the units
        taken so far count as before the weights that follow, whose shares hold from here on."""
        sources = self._row_place[rows, 0]
        picks = np.bincount(sources, minlength=len(self._readers))
        units = np.bincount(sources, weights=self._global_row_units[rows], minlength=len(self._readers)).astype(np.int64)
        consumed = tuple(int(c) + int(u) for c, u in zip(start.blend.consumed, units.tolist()))
        streams = tuple(self._advance(i, p, int(n)) for i, (p, n) in enumerate(zip(start.streams, picks.tolist())))
        if weights_change:
            return ScheduleStart(BlendState.start(len(consumed)), tuple(map(sum, zip(start.since, consumed))), streams)
        return ScheduleStart(BlendState(consumed, sum(consumed)), start.since, streams)

    def _supply(self, source: int, position: _StreamPosition, units: float) -> np.ndarray:
        """Source ``source``'s next rows from ``position``: at least ``units`` units, or up to its epoch cap."""
        reader = self._readers[source]
        cap = int(self.max_epochs[source])
        parts = [np.zeros(0, dtype=np.int64)]
        held = 0.0
        epoch, offset = position.epoch, position.offset
        while held < units and not (cap and epoch >= cap):
            parts.append(reader.epoch_rows(epoch)[offset:])
            held += float(self._row_units[source][parts[-1]].sum())
            epoch, offset = epoch + 1, 0
        return np.concatenate(parts)

    def _advance(self, source: int, position: _StreamPosition, rows: int) -> _StreamPosition:
        """``position`` moved on by ``rows`` rows of the source's stream."""
        per_epoch = self._readers[source].num_rows
        offset = position.offset + rows
        return _StreamPosition(position.epoch + offset // per_epoch, offset % per_epoch)

    # ---- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``PackedIterableDataset``'s state, with where the schedule of its mixture epoch's rows starts
        (``mixture_schedule``), so that a resume does not blend every epoch before it again."""
        start = self._epoch_start(self.epoch)
        consumed = [c + s for c, s in zip(start.blend.consumed, start.since)]
        return {**super().state_dict(), SCHEDULE: {
            "total": int(sum(consumed)),
            "consumed": {name: int(c) for name, c in zip(self.names, consumed)},
            "weights_since": {name: int(s) for name, s in zip(self.names, start.since)},
            "source_epochs": {name: p.epoch for name, p in zip(self.names, start.streams)},
            "source_offsets": {name: p.offset for name, p in zip(self.names, start.streams)}}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position in ``state_dict`` (see ``PackedIterableDataset``), its epoch's schedule starting
        where the state says, once that start is checked against the builds and the weights it was saved with.

        Under another layout (world size, batch size, weights) the epoch's rows that all ranks had read
        are taken from the schedule, and the rest of the epoch is blended from there, at the new weights.
        """
        saved = self._read_state(state_dict)
        weights = self._saved_weights(saved.layout)
        epoch = saved.position.epoch
        start = self._saved_epoch_start(epoch, _reader_state(state_dict).get(SCHEDULE), weights, saved.layout)
        rows = self._blend(start, weights, epoch)
        self._check_saved_position(saved, rows)
        position, following = saved.position, None
        if saved.layout != self._layout():
            elastic = self._elastic_position(saved, rows)
            # The rows all ranks had read are taken; this epoch's rows start after them, at this reader's weights.
            start = self._taken(start, rows[: elastic.start_row], weights_change=not np.array_equal(weights, self.weights))
            position = dataclasses.replace(elastic, start_row=0)
            following = start if position.finished else None
        elif position.finished and position.num_workers == 1:  # the next epoch starts after the rows read
            following = self._taken(start, rows[: self._rows_read(saved, rows)])
        if self._epoch_starts.get(epoch) != start:
            self._epoch_starts = {e: s for e, s in self._epoch_starts.items() if e < epoch}
            self._epoch_starts[epoch] = start
        if following is not None:
            self._epoch_starts = {e: s for e, s in self._epoch_starts.items() if e <= epoch}
            self._epoch_starts[epoch + 1] = following
        self._latest_rows, self._plan_cache = (-1, np.zeros(0, dtype=np.int64)), None
        if saved.layout == self._layout():  # the rows blended above are this epoch's: keep them
            self._latest_rows = (epoch, rows)
            self._epoch_starts.setdefault(epoch + 1, self._trained_end(rows, start))
        self._set_position(position, saved)

    def _saved_weights(self, layout: dict[str, Any]) -> np.ndarray:
        """The weights a state was saved with, in source order, as the run that saved it blended with them."""
        saved: Any = layout.get("weights")
        try:
            check_weights(saved, self.names)
        except ValueError as err:
            raise ValueError(f"loader state: weights: {err}; the state is corrupt or was edited") from None
        assert isinstance(saved, Mapping)  # check_weights refuses anything else
        return np.array([float(saved[name]) for name in self.names])

    def _saved_epoch_start(self, epoch: int, saved: Any, weights: np.ndarray, layout: dict[str, Any]) -> ScheduleStart:
        """Where the rows of mixture epoch ``epoch`` start, as a state saved it; ValueError naming a field that
        cannot be such a start.

        Checks what the schedule keeps at every prefix: the units taken in all lie within the
        epoch (at its start, less the rows the batches of the epoch before left over, unless the
        state was saved after a resume under another layout), each source is within a row of its
        share of the units taken since the weights took effect, and each source's stream position
        holds exactly the units taken from that build, within its ``max_epochs``.
        """
        largest = max(int(u.max()) for u in self._row_units)
        epoch_units = int(sum(int(u.sum()) for u in self._row_units))
        if (epoch + 1) * epoch_units >= MAX_COUNT:
            raise ValueError(f"loader state: epoch {epoch} is beyond any run's (it starts {epoch} x {epoch_units} "
                             f"{self.unit.value} in); the state is corrupt or was edited")
        if saved is None:
            raise ValueError(f"loader state: {SCHEDULE} is missing; the state is incomplete or was saved by an older "
                             "varpack, save it again")

        def refuse(field: str, must: str) -> NoReturn:
            raise ValueError(f"loader state: {SCHEDULE} {field} must {must}; the state is corrupt or was edited")

        if not isinstance(saved, dict):
            raise ValueError(f"loader state: {SCHEDULE} must be an object; the state is corrupt or was edited")
        fields = {}
        for field in ("consumed", "weights_since", "source_epochs", "source_offsets"):
            value = saved.get(field, dict.fromkeys(self.names, 0) if field == "weights_since" else None)
            # Read by name in source order: a JSON round trip may sort the keys (save_loader_state does).
            if not (isinstance(value, dict) and sorted(value) == sorted(self.names)
                    and all(type(v) is int and 0 <= v < MAX_COUNT for v in value.values())):
                refuse(field, f"be {{name: non-negative integer}} for the sources {', '.join(self.names)}")
            fields[field] = [value[name] for name in self.names]
        consumed, since, total = fields["consumed"], fields["weights_since"], saved.get("total")
        # Epoch e - 1 blends to e * epoch_units (less than a row past it); the rows its batches leave over go back.
        rows_per_batch = layout["batch_rows"] or max_rows_per_batch(self._row_tokens, layout["tokens_per_batch"])
        low = max(0, epoch * epoch_units - layout["world_size"] * rows_per_batch * largest)
        high = (epoch + 1) * epoch_units + largest
        if type(total) is not int or total != sum(consumed) or not low <= total < high:
            refuse("total", f"be the sum of consumed, within mixture epoch {epoch}: in [{low}, {high})")
        if any(s > c for s, c in zip(since, consumed)):
            refuse("weights_since", "be at most consumed, source by source")
        shares = integer_weights(weights)
        whole = sum(shares)
        taken = [c - s for c, s in zip(consumed, since)]
        for c, m in zip(taken, shares):
            if abs(c * whole - m * sum(taken)) >= largest * whole:
                refuse("consumed", "keep every source within a row of its share of total")
        positions = []
        for i, (reader, units, cap) in enumerate(zip(self._readers, self._row_units, self.max_epochs.tolist())):
            build_epoch, offset = fields["source_epochs"][i], fields["source_offsets"][i]
            if offset >= reader.num_rows or (cap and (build_epoch, offset) > (cap, 0)):
                refuse("source_offsets", f"stand within {self.names[i]!r}'s {reader.num_rows} rows and its max_epochs")
            held = build_epoch * int(units.sum()) + int(units[reader.epoch_rows(build_epoch)[:offset]].sum())
            if held != consumed[i]:
                refuse(f"source_epochs and source_offsets of {self.names[i]!r}",
                       f"hold the {consumed[i]} {self.unit.value} it consumed")
            positions.append(_StreamPosition(build_epoch, offset))
        return ScheduleStart(BlendState(tuple(taken), sum(taken)), tuple(since), tuple(positions))

    # ---- batches --------------------------------------------------------------------------

    def _collate(self, rows: np.ndarray) -> dict[str, torch.Tensor | int]:
        """The batch of the given global row ids, with the source of each sequence."""
        source_of_row, build_row = self._row_place[rows, 0], self._row_place[rows, 1]
        shard_rows: list[tuple[Shard, int]] = [None] * rows.size  # type: ignore[list-item]  # filled source by source
        for source in np.unique(source_of_row).tolist():
            at = np.flatnonzero(source_of_row == source)
            for index, pair in zip(at.tolist(), self._readers[source].shard_rows(build_row[at])):
                shard_rows[index] = pair
        batch = collate_rows(shard_rows, fixed=self.fixed_shape, pad_token_id=self.pad_token_id)
        batch[SOURCE_IDS] = torch.from_numpy(np.repeat(source_of_row, self._row_segments[rows]))
        if self.loss_weighting.is_plain_token_mean:
            return batch
        return add_loss_weights(batch, shard_rows, self.loss_weighting, self._id_offsets[source_of_row].tolist())


def _reader_state(state: dict[str, Any]) -> dict[str, Any]:
    """The reader's own state in a dataset or StatefulDataLoader state dict (one ``from_state_dict`` has read)."""
    if "_snapshot" in state:
        return _reader_state(next(iter(state["_snapshot"]["_worker_snapshots"].values()))["dataset_state"])
    if "_num_yielded" in state and "dataset_state" in state:
        return _reader_state(state["dataset_state"])
    return state


def _check_build(name: str, build: Any) -> None:
    """ValueError naming source ``name`` unless ``build`` can name a build (a non-empty path or URL)."""
    if isinstance(build, os.PathLike):
        build = os.fspath(build)
    if not isinstance(build, str) or not build or "\0" in build:
        raise ValueError(f"sources[{name!r}] must be a build directory, manifest or URL (a non-empty string without "
                         f"NUL), got {reprlib.repr(build)}")
    if storage.is_url(build):
        try:
            storage.filesystem(build)
        except storage.StorageError as err:
            raise ValueError(f"sources[{name!r}] is {err}") from None


def _check_max_epochs(max_epochs: Any, names: list[str]) -> np.ndarray:
    """Each source's epoch cap (0: none), in source order; ValueError naming an unknown source or a bad cap."""
    if max_epochs is None:
        max_epochs = {}
    if not isinstance(max_epochs, Mapping):
        raise ValueError(f"max_epochs must be {{source name: positive integer}}, got {reprlib.repr(max_epochs)}")
    for name, cap in max_epochs.items():
        if name not in names:
            raise ValueError(f"max_epochs names {name!r}, which is not a source of the mixture (sources: "
                             f"{', '.join(names)})")
        if cap is not None and positive_int(f"max_epochs[{name!r}]", cap) > MAX_COUNT:
            raise ValueError(f"max_epochs[{name!r}] must be at most 2**53 (or absent, for no cap), got {cap!r}")
    return np.array([max_epochs.get(name) or 0 for name in names], dtype=np.int64)


def _check_compatible(names: list[str], readers: list[BuildReader]) -> None:
    """ManifestError naming two builds that differ in tokenizer or row capacity."""
    first, base = names[0], readers[0]
    for name, reader in zip(names[1:], readers[1:]):
        difference = tokenizer_difference(base.manifest, reader.manifest)
        if difference is not None:
            raise ManifestError(
                f"mixture sources {first!r} ({base.source}) and {name!r} ({reader.source}) were tokenized differently "
                f"({difference}); rebuild one with the other's tokenizer"
            )
        if base.capacity != reader.capacity:
            raise ManifestError(
                f"mixture sources {first!r} ({base.source}) and {name!r} ({reader.source}) have rows of "
                f"{base.capacity} and {reader.capacity} tokens; rebuild one with the other's max_len"
            )


def tokenizer_difference(ours: Manifest, theirs: Manifest) -> str | None:
    """None when two builds were tokenized by the same tokenizer (its content hash), else both tokenizers, in words."""
    a, b = ours.inputs.tokenizer, theirs.inputs.tokenizer
    if a.content_hash == b.content_hash:
        return None
    return f"tokenizer {a.name} {a.content_hash} vs {b.name} {b.content_hash}"


def _summed_histograms(readers: list[BuildReader]) -> dict[str, int]:
    """The builds' histograms of segments per row (each checked against its shards), added up."""
    total: dict[str, int] = {}
    for reader in readers:
        for count, rows in reader.segments_histogram().items():
            total[count] = total.get(count, 0) + rows
    return total


def _combined_weighting(reduction: str, readers: list[BuildReader]) -> tuple[LossWeighting, np.ndarray]:
    """One loss weighting over all builds, each build's example ids after the last's: (weighting, offset per build)."""
    if reduction != LossReduction.SEQUENCE:
        return LossWeighting(reduction), np.zeros(len(readers), dtype=np.int64)
    tables: list[tuple[np.ndarray, np.ndarray]] = []
    offsets, next_id = [], 0
    for reader in readers:
        ids, targets = reader.loss_weighting.example_ids, reader.loss_weighting.example_targets
        assert ids is not None and targets is not None  # "sequence" reads every build's example targets
        tables.append((ids + next_id, targets))
        offsets.append(next_id)
        next_id += int(ids[-1]) + 1 if ids.size else 0
        if next_id > np.iinfo(np.int64).max:
            raise ValueError(f"{reader.source}: example ids up to {int(ids[-1])}; loss_reduction='sequence' numbers "
                             "the examples of a mixture's builds one after another, below 2**63")
    ids = np.concatenate([ids for ids, _ in tables])
    targets = np.concatenate([targets for _, targets in tables])
    return LossWeighting(reduction, None, targets, ids), np.array(offsets, dtype=np.int64)


def load_mixture_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON mixture file as ``PackedMixture`` keyword arguments.

    The file: ``{"sources": {name: build}, "weights": {name: weight}, "unit": "tokens",
    "max_epochs": {name: n}}``; ``unit`` and ``max_epochs`` are optional. Relative build paths
    are taken from the file's directory.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the mixture file ({getattr(err, 'strerror', None) or err})") from None
    try:
        data = json.loads(text, object_pairs_hook=_object_without_repeats)
    except _RepeatedKey as err:
        raise ValueError(f"{path}: {err}") from None
    except RecursionError:
        raise ValueError(f"{path}: not a JSON mixture file (nested too deeply)") from None
    except ValueError as err:
        raise ValueError(f"{path}: not a JSON mixture file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a mixture file holds one object with sources and weights")
    unknown = sorted(set(data) - {"sources", "weights", "unit", "max_epochs"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; a mixture file has sources, weights, unit, max_epochs")
    for key in ("sources", "weights"):
        if not isinstance(data.get(key), dict) or not data[key]:
            raise ValueError(f"{path}: {key!r} must be a non-empty object of {{name: value}}")
    unit, max_epochs = data.get("unit", "tokens"), data.get("max_epochs")
    try:  # each field as PackedMixture checks it, so that the error names the file
        for name, build in data["sources"].items():
            _check_build(name, build)
        check_weights(data["weights"], list(data["sources"]))
        one_of("unit", unit, MixtureUnit)
        _check_max_epochs(max_epochs, list(data["sources"]))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    sources = {name: str(path.parent / build) if not storage.is_url(build) else build for name, build in data["sources"].items()}
    return {"sources": sources, "weights": data["weights"], "unit": unit, "max_epochs": max_epochs}


class _RepeatedKey(ValueError):
    """A JSON object names a key twice (``json`` would keep the last silently)."""


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; _RepeatedKey naming a key given twice."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(f"{key!r} is given twice in one object; name each source, weight and cap once")
        found[key] = value
    return found


def units_per_step(mixture: PackedMixture, steps: int) -> np.ndarray:
    """The unit each source gives to each of the first ``steps`` batches of the epoch (this rank's): [steps, sources]."""
    plan = mixture._plan(mixture.epoch)
    row_units = np.concatenate(mixture._row_units)  # indexed by global row id
    taken = np.zeros((min(steps, len(plan)), len(mixture.names)))
    for step in range(taken.shape[0]):
        rows = plan.batch_rows(step)
        taken[step] = np.bincount(mixture._row_place[rows, 0], weights=row_units[rows], minlength=taken.shape[1])
    return taken


def realised_shares(mixture: PackedMixture, steps: int) -> np.ndarray:
    """Each source's share of the unit over the first ``steps`` batches of the epoch (this rank's), in source order."""
    taken = units_per_step(mixture, steps).sum(axis=0)
    return taken / max(taken.sum(), 1e-12)


def plot_shares(mixture: PackedMixture, steps: int, path: str | os.PathLike[str]) -> None:
    """Write to ``path`` (a PNG) each source's share of the unit over the first 1..``steps`` batches, against
    its weight. Needs matplotlib (``pip install 'varpack[plot]'``), imported here only."""
    from matplotlib.figure import Figure

    taken = np.cumsum(units_per_step(mixture, steps), axis=0)
    shares = taken / np.maximum(taken.sum(axis=1, keepdims=True), 1e-12)
    figure = Figure(figsize=(9, 4.5), dpi=110, layout="constrained")
    axes = figure.subplots()
    step = np.arange(1, shares.shape[0] + 1)
    for index, (name, weight) in enumerate(zip(mixture.names, mixture.weights)):
        color = f"C{index % 10}"
        axes.plot(step, shares[:, index], color=color, linewidth=1.8, label=f"{name} (target {weight:.3g})")
        axes.axhline(weight, color=color, linestyle="--", linewidth=1)
    axes.set_xlabel("batches read (this rank's)")
    axes.set_ylabel(f"share of {mixture.unit.value.replace('_', ' ')} so far")
    axes.set_xlim(1, max(2, shares.shape[0]))
    axes.set_ylim(0, min(1.0, float(shares.max(initial=0)) * 1.15 + 0.02))
    axes.set_title("Realised share of each source (solid) against its weight (dashed)")
    figure.legend(loc="outside right upper", fontsize=9, frameon=False)
    figure.savefig(path)


def describe(mixture: PackedMixture, steps: int) -> list[dict[str, Any]]:
    """One record per source: the plan and the realised share over the first ``steps`` batches."""
    shares = realised_shares(mixture, steps)
    return [{**dataclasses.asdict(source), "unit": mixture.unit.value, f"share_first_{steps}_steps": round(float(share), 4)}
            for source, share in zip(mixture.plan(), shares)]


def main(argv: list[str] | None = None, prog: str = "python -m loaders.mixture") -> int:
    """``python -m loaders.mixture MIXTURE.json`` (or ``varpack inspect MIXTURE.json``): the plan of a
    mixture file, one JSON line per source; ``--plot FILE.png`` also draws the shares realised over the
    first ``--steps`` batches against the weights."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("mixture", help="a JSON mixture file (sources, weights, unit, max_epochs)")
    parser.add_argument("--steps", type=int, default=100, help="batches over which to report the realised shares")
    parser.add_argument("--batch-rows", type=int, default=1, help="rows per batch (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", help="also draw each source's realised share over the first "
                        "--steps batches against its weight, as a PNG (needs matplotlib: pip install 'varpack[plot]')")
    args = parser.parse_args(argv)
    try:
        for option, value in (("--steps", args.steps), ("--batch-rows", args.batch_rows)):
            if value < 1:
                raise ValueError(f"{option} must be a positive integer, got {value}")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib, which is not installed; pip install 'varpack[plot]'")
        options = load_mixture_file(args.mixture)
        try:
            mixture = PackedMixture(**options, batch_rows=args.batch_rows, seed=args.seed, verify_checksum=False)
        except ManifestError as err:
            raise type(err)(f"{args.mixture}: {err}") from None
        records = describe(mixture, args.steps)
        if args.plot:
            plot_shares(mixture, args.steps, args.plot)
    except (VarpackError, ValueError, OSError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    for record in records:
        print(json.dumps(record))
    if args.plot:
        print(f"{prog}: wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
