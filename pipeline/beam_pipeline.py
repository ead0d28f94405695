"""The Apache Beam graph: read -> tokenize -> collect lengths -> pack -> write shards -> manifest.

Every element is a batch (a table of up to ``batch_size`` rows, its tokens, a group's lengths,
a shard), never a single example: Beam costs about 0.5 us per element per step and 16 us per
element through a shuffle.

    read tasks --ReadAndEncode--> (batch key, SpilledBatch)   tokens, lengths and rows left out to spill files
        counts of rows left out and untrained --gather--> WriteRejected (rejected.jsonl, --max-bad-rows)
            --> Filtered, joined with the counts and with the manifest's inputs
        counts --gather--> Layout --> (batch key, first id, rows kept)  --join batches by batch key-->
        batches, cut where a group starts --GroupByKey(group)--> PackGroups (reads the group's lengths;
            best-fit decreasing per group; one plan file per shard, naming the spill files and positions
            of its segments' tokens)
            --> PackedGroup (statistics, plan files) --gather--> (shard in group, shard index) --+
            --> (shard in group, plan file) --------------------------------------------------+
                    --CoGroupByKey(group, shard in group)--> WriteShard
    shard infos + group statistics + Filtered --gather--> WriteManifest (last; its presence marks a complete build)

Whole-collection values (the layout, the statistics) are gathered under one key and joined
with CoGroupByKey, not passed as side inputs: the graph then runs the same on every runner.

Tokens never travel through a shuffle, and neither do the examples' lengths or the packing plan:
PackGroups reads its batches' lengths from beside their spill files, and WriteShard reads its
shard's plan file and gathers the tokens from the spill files (``pipeline/packing/shard_plans.py``,
``pipeline/packing/spill.py``), and WriteRejected joins the batches' lines of ``rejected.jsonl``
from beside them. What the runner holds and shuffles is a few hundred bytes per batch of
``--batch-size`` rows, whatever the size of the dataset and however many of its rows are bad.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline import storage
from pipeline.beam_worker import WORKER_COMMAND
from pipeline.build_plan import BuildPlan
from pipeline.encode.chat import turn_stats
from pipeline.encode.bad_rows import REJECTED_NAME, BadRow, Reason, bound_error, bound_exceeded, summarize, worker_bound, write_rejected
from pipeline.config import VerifyTokens
from pipeline.encode.examples import EncodedBatch, Encoder
from pipeline.encode.preference import PairEncoder, PairTokenChecker
from pipeline.encode.token_check import CheckCounts, TokenChecker, sample_mask
from pipeline.encode.tokenizer import LoadedTokenizer
from pipeline.errors import InputError
from pipeline.packing.groups import BatchKey, group_parts, make_layout, rows_kept
from pipeline.packing.shard_plans import GroupBatch, PackedGroup, ShardPlan, assemble_shard, pack_group
from pipeline.packing.spill import SpilledRejects, spill
from pipeline.parent_watch import PACK_PID_ENV, exit_with_parent
from pipeline.read.inputs import InputsRead
from pipeline.read.readers import BatchRows
from pipeline.read.sources import ReadTask
from pipeline.report import progress
from pipeline.write.shard_writer import finish_build, publish_shard
from schemas import (
    MANIFEST_NAME,
    BuildInputs,
    PackingStats,
    RejectedRows,
)
from schemas.shard_identity import ShardIdentity

_COUNTERS = "varpack"


class ReadAndEncode(beam.DoFn):
    """Read one task in batches, tokenize each batch and spill its tokens: ``(batch key, SpilledBatch)``.

    Batches are encoded on two threads, in order: the tokenizer releases the GIL while it
    runs on all cores, so one batch's Python work (token lists to arrays, Beam's own) runs
    while the next batch is being tokenized instead of leaving cores idle.
    """

    IN_FLIGHT = 2

    def __init__(self, plan: BuildPlan, tokenizer_file: str, spill_dir: str, main_pid: int):
        # The tokenizer's text travels as a file beside the spilled tokens, read once per worker process.
        self.plan = dataclasses.replace(plan, tokenizer=plan.tokenizer.without_text())
        self.tokenizer_file = tokenizer_file
        self.spill_dir = spill_dir
        self.main_pid = main_pid
        self.examples = Metrics.counter(_COUNTERS, "examples_tokenized")
        self.tokens = Metrics.counter(_COUNTERS, "tokens")

    def setup(self):
        exit_with_parent(self.main_pid)
        self.pool = ThreadPoolExecutor(self.IN_FLIGHT, thread_name_prefix="varpack-encode")  # first: teardown shuts it
        plan, config = self.plan, self.plan.config
        tokenizer = plan.tokenizer.with_text(lambda: storage.read_bytes(self.tokenizer_file).decode())
        args = (tokenizer, plan.example_format, config.max_len, config.overflow, config.on_bad_row, config.strict)
        self.encoder = PairEncoder(*args, layout=config.preference_layout) if config.is_preference else Encoder(*args)
        self.known_examples = plan.source.known_examples
        # Rows not counted before reading may run past --num-examples, and a worker cannot tell which of its rows do.
        past_limit = config.num_examples is not None and self.known_examples is None
        self.bad_row_limit = None if past_limit else worker_bound(config.max_bad_rows, self.known_examples)
        self.bad_rows, self.first_bad_row, self.rows_read = 0, None, 0
        self.checker = None
        if config.verify_tokens != VerifyTokens.OFF:
            checker = PairTokenChecker if config.is_preference else TokenChecker
            self.checker = checker(tokenizer, plan.example_format, config.on_token_mismatch)
        # Where each read task's rows start in the dataset (known when every task knows its row count).
        sizes = [task.rows if task.limit is None else min(task.rows, task.limit) for task in plan.source.tasks if task.rows is not None]
        self.task_starts = np.cumsum(sizes) - sizes

    def teardown(self):
        self.pool.shutdown(cancel_futures=True)

    def __getstate__(self) -> dict:
        # Some runners (Dask) pickle the DoFn again after setup(); the pool and encoder are per-worker.
        return {k: v for k, v in self.__dict__.items() if k not in ("pool", "encoder", "checker")}

    def process(self, element: tuple[int, ReadTask]):
        task_index, task = element
        pending: deque = deque()
        batches = task.read(self.plan.example_format.column_types, self.plan.config.batch_size)
        for part, (first_row, table) in enumerate(batches):
            encoding = self.pool.submit(self._encode, table, task.batch_rows(first_row), task_index, first_row)
            pending.append((part, table.num_rows, encoding))
            if len(pending) == self.IN_FLIGHT:
                yield self._finish(task_index, *pending.popleft())
        while pending:
            yield self._finish(task_index, *pending.popleft())

    def _encode(self, table, rows: BatchRows, task_index: int, first_row: int) -> tuple[EncodedBatch, CheckCounts]:
        """The batch's examples, and what checking them (all, or those in the sample) against the reference found."""
        batch = self.encoder.encode(table, rows)
        if self.checker is None:
            return batch, CheckCounts()
        selected = np.ones(batch.lengths.size, dtype=bool)
        if self.plan.config.verify_tokens == VerifyTokens.SAMPLE:
            places = first_row + batch.example_rows  # within the task: in the dataset once every task's size is known
            if self.known_examples is not None:
                places = places + self.task_starts[task_index]
            selected = sample_mask(places, self.known_examples, self.plan.config.seed)
        return batch, self.checker.check(table, rows, batch, selected)

    def _finish(self, task_index: int, part: int, rows: int, encoding: Future):
        batch, token_check = encoding.result()
        self.rows_read += rows
        self._count_bad_rows(batch.rejected)
        self.examples.inc(rows)
        self.tokens.inc(batch.tokens.size)
        progress.advance("examples tokenized", rows, self.known_examples, "ex")
        return (task_index, part), spill(batch, self.spill_dir, f"{task_index:06d}-{part:06d}", rows, token_check)

    def _count_bad_rows(self, rejected: list[BadRow]) -> None:
        """Stop early once this worker alone has met more bad rows than the whole build may hold (in the rows it read)."""
        if not rejected:
            return
        bad = [row for row in rejected if row.is_bad]
        if not bad:
            return
        self.bad_rows += len(bad)
        self.first_bad_row = self.first_bad_row or bad[0]
        if self.bad_row_limit is not None and self.bad_rows > self.bad_row_limit:
            raise bound_error(self.bad_rows, self.rows_read, self.plan.config.max_bad_rows, self.first_bad_row)


@dataclass(frozen=True)
class Filtered:
    """What reading and encoding left out: bad rows by reason, examples truncation left untrained, and
    chat turns read, used and dropped (``chat.count_turns``); the examples checked against the reference
    tokenization and those equal to it."""

    rejected: RejectedRows
    untrained_examples: int
    untrained_tokens: int
    turns: Counter[str] = dataclasses.field(default_factory=Counter)
    # Examples and tokens --truncate-side left cut from prompts' heads (counted as truncated).
    prompt_cut_examples: int = 0
    prompt_cut_tokens: int = 0
    examples_checked: int = 0
    examples_equal: int = 0
    # Special tokens whose text the data holds: {token: (examples, the first one's row)}.
    special_text: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


def finish_filtered(
    notes: list[tuple[tuple[int, int], int, SpilledRejects, tuple[int, ...], Counter[str], CheckCounts, dict]],
    out_dir: str,
    max_bad_rows: int | float,
    num_examples: int | None = None,
) -> Filtered:
    """Check ``--max-bad-rows`` over the whole build and write ``rejected.jsonl``, rows in source order.

    ``notes`` holds, for each batch, its key, its source rows read, its rows left out, its untrained and
    prompt-cut counts (examples, tokens, examples, tokens), its chat turn counts, what checking its
    tokens found and the special tokens whose text its data holds. The examples that differ from the reference (under
    ``--on-token-mismatch count``) are logged as a warning: how many, in what, and the first. The build is the first
    ``num_examples`` rows read: bad rows past them (read where rows are not counted before reading) are not its own.
    """
    notes = sorted(notes, key=lambda note: note[0])
    kept = rows_kept(np.array([rows for _, rows, *_ in notes], dtype=np.int64), num_examples)
    rejects: list[SpilledRejects] = [
        rejected if rows == k else rejected.within(int(k)) for (_, rows, rejected, *_), k in zip(notes, kept)
    ]
    rows_read = int(kept.sum())
    bad = sum(r.bad for r in rejects)
    first_bad = next((r.first_bad for r in rejects if r.first_bad is not None), None)
    if first_bad is not None and bound_exceeded(bad, rows_read, max_bad_rows):
        raise bound_error(bad, rows_read, max_bad_rows, first_bad)
    write_rejected([r.path for r in rejects if r.path is not None], out_dir)
    untrained = [sum(counts) for counts in zip(*(u for _, _, _, u, _, _, _ in notes))] or [0, 0, 0, 0]
    turns = sum((turns for *_, turns, _, _ in notes), Counter())
    token_check = CheckCounts.summed(counts for *_, counts, _ in notes)
    special_text: dict[str, tuple[int, str]] = {}
    for *_, found in notes:  # in source order: the first row of each token is the first of the build
        for token, (count, first) in found.items():
            total, earliest = special_text.get(token, (0, first))
            special_text[token] = (total + count, earliest)
    mismatches = token_check.mismatch_warning()
    if mismatches is not None:
        logging.getLogger("varpack").warning("%s", mismatches)
    return Filtered(
        summarize(sum((r.by_reason for r in rejects), Counter())), untrained[0], untrained[1], turns, untrained[2], untrained[3],
        token_check.checked, token_check.equal, special_text,
    )


def placements(
    counts: list[tuple[BatchKey, tuple[int, int]]], limit: int | None, untrained: int = 0, max_len: int = 0,
    too_long_pairs: int = 0, rejected: RejectedRows = RejectedRows(), listed_in: str = REJECTED_NAME,
):
    """``(batch key, (first row, rows kept))`` for every batch, from all batches' (examples, rows read).

    Raises InputError naming --max-len and --overflow when the only examples read were dropped for keeping
    no trained token (``untrained`` of them) within ``max_len``, or naming --max-len when the only preference
    pairs read were longer than a row (``too_long_pairs`` of them); NothingKeptError naming the rows read and
    the reasons when every row was a bad row (``rejected``, listed in ``listed_in``).
    """
    if too_long_pairs and not any(examples for _, (examples, _) in counts):
        raise InputError(
            f"nothing to write: every pair read that is not a bad row ({too_long_pairs}) is longer than --max-len {max_len} "
            "in its layout, and a pair is never split; raise --max-len (--preference-layout shared-prompt counts the prompt once)"
        )
    if untrained and not any(examples for _, (examples, _) in counts):
        raise InputError(
            f"nothing to train: every example read ({untrained}) was dropped as untrained: --overflow truncate keeps its "
            f"first --max-len {max_len} tokens, none of them trained; raise --max-len or pass --overflow split"
        )
    layout = make_layout(counts, limit, rejected, listed_in)
    yield from layout.index().items()


def assign_groups(key: BatchKey, joined: dict, examples_per_group: int):
    """The parts of a batch that has examples, each keyed by its packing group: ``(group, GroupBatch)``."""
    (batch,), ((first_row, kept_rows),) = joined["batch"], joined["placement"]
    if batch.examples:
        for group, start, end in group_parts(first_row, kept_rows, examples_per_group):
            yield group, GroupBatch(key, first_row, end, batch.path, start)


def first_shard(groups: list[PackedGroup], group: int) -> int:
    """The index of a group's first shard: the groups' shards follow each other in group order."""
    return sum(len(g.shard_plans) for g in groups if g.group < group)


def shard_indices(groups: list[PackedGroup]):
    """``((group, shard in group), (shard index, shards of the build, rows of the build))`` for every shard."""
    total_rows = sum(g.stats.rows for g in groups)
    total_shards = sum(len(g.shard_plans) for g in groups)
    for g in groups:
        first = first_shard(groups, g.group)
        for local in range(len(g.shard_plans)):
            yield (g.group, local), (first + local, total_shards, total_rows)


class WriteShard(beam.DoFn):
    """Build one shard's rows from its plan file and the spill files it names, and write it: ``(shard, ShardInfo)``."""

    def __init__(self, out_dir: str, fingerprint: str, capacity: int, main_pid: int):
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        self.capacity = capacity
        self.main_pid = main_pid
        self.rows = Metrics.counter(_COUNTERS, "rows_written")
        self.shards = Metrics.counter(_COUNTERS, "shards_written")

    def setup(self):
        exit_with_parent(self.main_pid)

    def process(self, element):
        _, joined = element
        (plan_path,), ((shard, total_shards, total_rows),) = joined["plan"], joined["index"]
        table = assemble_shard(ShardPlan.load(plan_path))
        identity = ShardIdentity(self.fingerprint, shard, last=shard == total_shards - 1)
        info = publish_shard(table, self.out_dir, self.capacity, identity)
        self.rows.inc(info.rows)
        self.shards.inc()
        progress.advance("rows written", info.rows, total_rows, "rows")
        yield shard, info


def write_build_manifest(
    joined: dict,
    out_dir: str,
    shard_prefix: str,
    inputs: BuildInputs,
    rows_per_shard: int,
    read: InputsRead = InputsRead(),
    token_check: str = VerifyTokens.SAMPLE,
) -> str:
    """Write the manifest of the finished build, last and atomically; returns its path.

    ``joined`` holds every shard written, every packed group, every batch's placement and what reading left out;
    ``shard_prefix`` is where the shards are, relative to ``out_dir``: "" or an attempt directory's "NAME/".
    """
    groups = sorted((g for part in joined["groups"] for g in part), key=lambda g: g.group)
    filtered: Filtered = joined["filtered"][0]
    stats = PackingStats.merged([g.stats for g in groups])
    stats.examples_untrained, stats.tokens_untrained = filtered.untrained_examples, filtered.untrained_tokens
    stats.chat_turns, stats.dangling_turns_dropped, stats.conversations_trimmed = turn_stats(filtered.turns)
    stats.examples_truncated += filtered.prompt_cut_examples
    stats.tokens_truncated += filtered.prompt_cut_tokens
    stats.examples_checked, stats.examples_equal = filtered.examples_checked, filtered.examples_equal
    stats.token_check = token_check
    stats.special_token_text = {token: {"examples": n, "first_row": first} for token, (n, first) in filtered.special_text.items()}
    stats.num_example_ids = sum(kept_rows for part in joined["placed"] for _, (_, kept_rows) in part)
    if inputs.preference_layout is not None:
        stats.pairs, stats.bad_pairs = stats.examples_kept, dict(filtered.rejected.by_reason)
    read.record(stats)
    if stats.rows == 0:
        raise InputError(
            f"nothing to write: all {stats.examples} examples were dropped as longer than --max-len {inputs.max_len}; "
            "pass --overflow split or truncate, or a larger --max-len"
        )
    shards = sorted((s for part in joined["shards"] for s in part), key=lambda item: item[0])
    if [index for index, _ in shards] != list(range(len(shards))):
        raise RuntimeError(f"shards {[index for index, _ in shards]} were written; expected 0..{len(shards) - 1}")
    infos = [dataclasses.replace(info, path=shard_prefix + info.path) for _, info in shards]
    finish_build(out_dir, inputs, rows_per_shard, infos, stats, filtered.rejected)
    return storage.join(out_dir, MANIFEST_NAME)


def ship_tokenizer(tokenizer: LoadedTokenizer, spill_dir: str) -> str:
    """Write the tokenizer's text into the spill directory, which every worker reads, once per build; its path."""
    path = storage.join(spill_dir, f"tokenizer-{tokenizer.content_hash[:16]}.json")
    storage.write_scratch(path, lambda local: Path(local).write_text(tokenizer.serialized, encoding="utf-8"))
    return path


def _gather(label: str, pcoll):
    """All elements of ``pcoll`` as one list, as the single element ``(None, list)`` of a keyed collection.

    Whole-collection values travel through keyed joins rather than side inputs, which some
    runners (Beam's DaskRunner) materialise incorrectly.
    """
    return pcoll | f"Key{label}" >> beam.Map(lambda element: (None, element)) | f"Gather{label}" >> beam.GroupByKey()


def build_graph(p: beam.Pipeline, plan: BuildPlan, shard_dir: str, spill_dir: str) -> None:
    """Add the steps of one build to pipeline ``p``.

    Shards go into ``shard_dir``: the build directory, or at a URL this attempt's own
    directory inside it. Spilled tokens and plan files go into ``spill_dir``.
    """
    main_pid = os.getpid()  # the pack command's process
    # Steps below capture these small values, not ``plan``, which carries the whole tokenizer.
    config, inputs, out_dir, read = plan.config, plan.inputs, plan.out_dir, plan.inputs_read
    rows_per_shard, examples_per_group = config.resolved_rows_per_shard, config.resolved_examples_per_group
    encoded = (
        p
        | "ReadTasks" >> beam.Create(list(enumerate(plan.source.tasks)))
        | "ReadAndEncode" >> beam.ParDo(ReadAndEncode(plan, ship_tokenizer(plan.tokenizer, spill_dir), spill_dir, main_pid))
    )
    filtered = _gather(
        "Notes",
        encoded
        | "Notes"
        >> beam.MapTuple(
            lambda key, b: (key, b.rows_read, b.rejected, b.untrained + b.prompt_cut, b.turns, b.token_check, b.special_text)
        ),
    ) | "WriteRejected" >> beam.MapTuple(
        lambda key, notes: (key, finish_filtered(list(notes), out_dir, config.max_bad_rows, config.num_examples))
    )
    counts = encoded | "Counts" >> beam.MapTuple(lambda key, batch: (key, (batch.examples, batch.rows_read)))
    # After WriteRejected: a build of bad rows only stops at --max-bad-rows, not for holding no examples.
    placed = (
        {"counts": _gather("Counts", counts), "filtered": filtered}
        | "JoinFiltered" >> beam.CoGroupByKey()
        | "Layout" >> beam.FlatMapTuple(
            lambda _, joined: placements(
                [c for part in joined["counts"] for c in part], config.num_examples,
                sum(f.untrained_examples for f in joined["filtered"]), config.max_len,
                sum(f.rejected.by_reason.get(Reason.PAIR_TOO_LONG, 0) for f in joined["filtered"]),
                next(iter(joined["filtered"])).rejected, storage.join(out_dir, REJECTED_NAME),
            )
        )
    )
    groups = (
        {"batch": encoded, "placement": placed}
        | "JoinPlacements" >> beam.CoGroupByKey()
        | "AssignGroups" >> beam.FlatMapTuple(lambda key, joined: assign_groups(key, joined, examples_per_group))
        | "GroupLengths" >> beam.GroupByKey()
        # A group whose kept rows made no example (all bad rows, or past --num-examples) packs nothing.
        | "PackGroups"
        >> beam.FlatMapTuple(
            lambda group, batches: filter(None, [pack_group(
                group, list(batches), config.max_len, config.overflow, config.packing, config.seed, rows_per_shard, spill_dir
            )])
        )
    )
    # Shards are first numbered within their group; the group's first shard index joins them
    # only at the end.
    plans = groups | "ShardPlans" >> beam.FlatMap(lambda g: [((g.group, local), path) for local, path in enumerate(g.shard_plans)])
    indices = _gather("Groups", groups) | "ShardIndices" >> beam.FlatMapTuple(
        lambda _, all_groups: shard_indices(list(all_groups))
    )
    shards = (
        {"plan": plans, "index": indices}
        | "GroupByShard" >> beam.CoGroupByKey()
        | "WriteShards" >> beam.ParDo(WriteShard(shard_dir, plan.fingerprint, config.max_len, main_pid))
    )
    shard_prefix = shard_dir[len(out_dir) :].strip("/")
    shard_prefix = shard_prefix and shard_prefix + "/"
    (
        {
            "shards": _gather("Shards", shards),
            "groups": _gather("AllGroups", groups),
            "placed": _gather("Placed", placed),
            "filtered": filtered,
        }
        | "JoinForManifest" >> beam.CoGroupByKey()
        | "WriteManifest"
        >> beam.MapTuple(lambda _, joined: write_build_manifest(
            joined, out_dir, shard_prefix, inputs, rows_per_shard, read, str(config.verify_tokens)
        ))
    )


@contextlib.contextmanager
def worker_stderr_discarded() -> Iterator[None]:
    """Discard what worker processes started meanwhile write to stderr; this process's stderr is kept.

    Beam's local worker processes log at INFO on the stderr they inherit, about 25 lines each,
    whatever the pipeline options say, and send the same records to the runner, which logs
    them here: nothing is lost.
    """
    sys.stderr.flush()
    kept = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    original = sys.stderr
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and h.stream is original]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = kept
    for handler in handlers:
        handler.setStream(kept)
    try:
        yield
    finally:
        kept.flush()
        os.dup2(kept.fileno(), 2)
        sys.stderr = original
        for handler in handlers:
            handler.setStream(original)
        kept.close()


def run(plan: BuildPlan, shard_dir: str, spill_dir: str) -> None:
    """Run the build on the runner the config's Beam options name; Beam's in-process FnApiRunner by default."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
    from apache_beam.transforms.environments import SubprocessSDKEnvironment

    options = PipelineOptions(list(plan.config.beam_args))
    runner = options.view_as(StandardOptions).runner
    quiet: contextlib.AbstractContextManager = contextlib.nullcontext()
    worker_env: dict[str, str] = {}
    if runner is None:
        # Not the DirectRunner: it tries to download a Prism binary on every run.
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        environment = None
        direct = options.view_as(DirectOptions)
        if direct.direct_running_mode == "multi_processing":
            quiet = worker_stderr_discarded()
            # Workers that watch this process from their start (beam_worker.py). Beam would put its
            # own worker command in place of this environment under multi_processing, so unset it.
            environment = SubprocessSDKEnvironment.from_command_string(WORKER_COMMAND)
            direct.direct_running_mode = None
            worker_env.update(tokenizer_threads(direct.direct_num_workers))
        runner = FnApiRunner(default_environment=environment)
    worker_env[PACK_PID_ENV] = str(os.getpid())  # local workers inherit it: see parent_watch.py
    with quiet, environment_set(worker_env), beam.Pipeline(runner=runner, options=options) as p:
        build_graph(p, plan, shard_dir, spill_dir)


def tokenizer_threads(workers: int) -> dict[str, str]:
    """The environment that gives each of ``workers`` local worker processes its share of this process's cores
    for tokenizing (``RAYON_NUM_THREADS``; 0 workers: one per core), unless the user set it.

    Each worker's tokenizer would otherwise start a thread per core: 16 workers on 16 cores ran 256
    tokenizing threads, which contend for the cores instead of sharing them.
    """
    if "RAYON_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0))
    return {"RAYON_NUM_THREADS": str(max(1, cores // (workers or cores)))}


@contextlib.contextmanager
def environment_set(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block, for the worker processes it starts; restored after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
