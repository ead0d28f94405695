"""``pack`` on many cores: throughput and scaling against ``datasets.map`` + TRL's ``pack_dataset``.

    python scripts/bench_pipeline.py --workers 1,2,4,8,16 [--examples 3000000] [--examples-per-worker 25000]
        [--dask-workers 16] [--dask-examples N] [--baseline-procs 16] [--parts sweep,full,baseline,dask] [--out FILE]

Every build is ``python -m pipeline.pack --dataset synthetic-flan --num-examples N`` in a fresh process, wall
clock from start to exit (Python and Beam start-up, generating the texts, tokenizing, packing, writing shards
and the manifest), the way a user runs it:

- ``workers``: Beam's DirectRunner with ``--direct_running_mode=multi_processing --direct_num_workers=n``, the
  command and its workers held to ``n`` cores (CPU affinity), on ``n x --examples-per-worker`` examples (the
  work grows with the cores, so start-up weighs alike on every run). Efficiency at ``n``: its tokens/s over ``n``
  times the tokens/s of one worker;
- ``direct_full``: the same runner with the most workers on ``--examples`` examples (the headline run);
- ``dask``: Beam's DaskRunner on a ``distributed.LocalCluster`` of ``--dask-workers`` single-threaded worker
  processes started before the clock (their start-up is not timed), on ``--dask-examples`` examples;
- ``datasets_trl``: the same ``--examples`` texts, prompt and response joined by the default template, in
  memory-mapped Arrow files, one per process (written before the clock), then ``Dataset.map(batched=True,
  num_proc=--baseline-procs)`` with the same tokenizer as a transformers fast tokenizer, then TRL's
  ``pack_dataset(strategy="bfd", map_kwargs={"num_proc": ...})`` into rows of ``--max-len``.

Peak RSS: every process of a run is sampled every 0.2 s for its high-water mark (``VmHWM`` in
``/proc/PID/status``); ``peak_rss_worker_bytes`` is the largest among the workers, ``peak_rss_main_bytes``
the command's own. The largest sweep point and ``direct_full`` give the workers' peak at two dataset sizes.
Tokens are those the build packed (its manifest), BOS and EOS included; the baseline's are its ``input_ids``.
The last line is one JSON object; ``--out`` writes it to a file too. ``--parts`` runs some of the four (the ratios
need all of them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import PackConfig
from pipeline.encode.tokenizer import load_tokenizer
from pipeline.read.formats import DEFAULT_PROMPT_TEMPLATE, split_prompt_template
from pipeline.read.synthetic import BLOCK_EXAMPLES, SHAPES, generate_block
from schemas import read_manifest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.2
PARTS = ("sweep", "full", "baseline", "dask")


def _high_water_mark(pid: int) -> int | None:
    """A process's peak resident set size in bytes, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of children too)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@contextlib.contextmanager
def peak_rss() -> Iterator[dict[int, int]]:
    """Sample this process's descendants until the block ends: ``{pid: peak RSS bytes}``."""
    peaks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in _descendants(os.getpid()):
                rss = _high_water_mark(pid)
                if rss is not None:
                    peaks[pid] = max(peaks.get(pid, 0), rss)
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peaks
    finally:
        done.set()
        sampler.join()


def python_path() -> str:
    """This checkout first, then whatever PYTHONPATH already holds."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


@contextlib.contextmanager
def cores_held(cores: int | None) -> Iterator[None]:
    """This thread, and the processes it starts meanwhile, on the first ``cores`` of its cores (None: all of them).

    Set on the starting thread rather than in a ``preexec_fn``, which may deadlock while the sampler thread runs.
    """
    allowed = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, sorted(allowed)[:cores])
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def time_pack(examples: int, out: Path, beam_args: list[str], cores: int | None, max_len: int) -> dict:
    """One ``pack`` build in a fresh process: wall time, tokens, fill and peak RSS of the command and of its workers."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    command = [sys.executable, "-m", "pipeline.pack", "--dataset", "synthetic-flan", "--num-examples", str(examples),
               "--max-len", str(max_len), "--out", str(out), "--no-progress", "--force", *beam_args]
    with peak_rss() as peaks:
        started = time.perf_counter()
        with cores_held(cores):
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        process.wait()
        elapsed = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"bench_pipeline: {' '.join(command)} exited with {process.returncode}")
    (build,) = [p for p in out.iterdir() if p.name.startswith("synthetic-flan")]
    stats = read_manifest(build).stats
    shutil.rmtree(out)  # the 3M-example builds hold gigabytes
    workers = [rss for pid, rss in peaks.items() if pid != process.pid]
    return {
        "examples": examples,
        "tokens": stats.tokens,
        "wall_s": round(elapsed, 2),
        "tokens_per_s": round(stats.tokens / elapsed),
        "fill": round(stats.fill, 6),
        "peak_rss_main_bytes": peaks.get(process.pid),
        "peak_rss_worker_bytes": max(workers, default=None),
    }


def write_texts(examples: int, directory: Path, procs: int) -> list[Path]:
    """The benchmark's examples, prompt and response joined by the default template, as ``procs`` Arrow files
    written in parallel, in order."""
    blocks = [(b, min(BLOCK_EXAMPLES, examples - b * BLOCK_EXAMPLES)) for b in range(-(-examples // BLOCK_EXAMPLES))]
    per_file = -(-len(blocks) // procs)
    parts = [(directory / f"texts-{i:03d}.arrow", blocks[first : first + per_file])
             for i, first in enumerate(range(0, len(blocks), per_file))]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.starmap(_write_flan_blocks, parts)
    return [path for path, _ in parts]


def _write_flan_blocks(path: Path, blocks: list[tuple[int, int]]) -> None:
    before, between, after = split_prompt_template(DEFAULT_PROMPT_TEMPLATE)
    schema = pa.schema([("text", pa.large_string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for block in blocks:
            table = generate_block(SHAPES["synthetic-flan"], *block)
            text = pc.binary_join_element_wise(before, table["prompt"], between, table["response"], after, "")
            writer.write_table(pa.table({"text": text.cast(pa.large_string())}))


def time_datasets_trl(texts: list[Path], procs: int, max_len: int) -> dict:
    """``Dataset.map(num_proc=procs)`` tokenizing, then TRL's best-fit-decreasing ``pack_dataset``."""
    import datasets
    from transformers import PreTrainedTokenizerFast
    from trl import pack_dataset

    datasets.disable_progress_bars()
    fast = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer().backend())

    def tokenize(batch: dict) -> dict:
        return {"input_ids": fast(batch["text"], add_special_tokens=False)["input_ids"]}

    with peak_rss() as peaks:
        started = time.perf_counter()
        dataset = datasets.concatenate_datasets([datasets.Dataset.from_file(str(path), in_memory=False) for path in texts])
        tokenized = dataset.map(tokenize, batched=True, remove_columns=["text"], num_proc=procs)
        map_s = time.perf_counter() - started
        packed = pack_dataset(tokenized, seq_length=max_len, strategy="bfd", map_kwargs={"num_proc": procs})
        elapsed = time.perf_counter() - started
    tokens = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
    return {
        "examples": len(dataset),
        "tokens": tokens,
        "wall_s": round(elapsed, 2),
        "map_s": round(map_s, 2),
        "pack_s": round(elapsed - map_s, 2),
        "tokens_per_s": round(tokens / elapsed),
        "fill": round(tokens / (packed.num_rows * max_len), 6),
        "peak_rss_worker_bytes": max(peaks.values(), default=None),
    }


def time_dask(examples: int, out: Path, workers: int, max_len: int) -> dict:
    """A build on Beam's DaskRunner, on a local cluster of ``workers`` single-threaded processes."""
    import distributed

    env = {"PYTHONPATH": python_path(), "TOKENIZERS_PARALLELISM": "false"}
    # The cluster's processes are this one's children: time_pack samples them as the build's workers.
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                                  env=env) as cluster:
        return time_pack(examples, out, ["--runner", "DaskRunner", f"--dask_client_address={cluster.scheduler_address}"],
                         None, max_len)


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def log(message: str) -> None:
    print(f"bench_pipeline: {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16", help="worker counts of the sweep, comma-separated")
    parser.add_argument("--examples", type=int, default=3_000_000, help="examples of direct_full and datasets_trl")
    parser.add_argument("--examples-per-worker", type=int, default=25_000, help="examples per worker in the sweep")
    parser.add_argument("--dask-workers", type=int, default=16, help="0: no DaskRunner build")
    parser.add_argument("--dask-examples", type=int, help="default: --examples")
    parser.add_argument("--baseline-procs", type=int, help="num_proc of datasets and TRL (default: the most workers)")
    parser.add_argument("--max-len", type=int, default=PackConfig.max_len)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which runs, comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts {args.parts}: choose among {', '.join(PARTS)}")
    counts = sorted({int(n) for n in args.workers.split(",")})
    most = counts[-1]
    if most > len(os.sched_getaffinity(0)):
        parser.error(f"--workers {most} needs {most} cores; this process may use {len(os.sched_getaffinity(0))}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    load_tokenizer()  # converted into the cache once, outside every timed run
    result: dict = {"dataset": "synthetic-flan", "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
                    "python": platform.python_version(), "max_len": args.max_len, "workers": {}}

    def direct(n: int) -> list[str]:
        return ["--direct_running_mode=multi_processing", f"--direct_num_workers={n}"]

    def record(name: str, value: dict) -> None:
        """Keep one measurement, log it, and rewrite ``--out``: a run cut short keeps what it measured."""
        log(f"{name}: {json.dumps(value)}")
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for n in counts if "sweep" in parts else []:
            run = time_pack(n * args.examples_per_worker, tmp / f"w{n}", direct(n), n, args.max_len)
            per_worker = result["workers"].get(str(counts[0]), run)["tokens_per_s"] / counts[0]
            run["efficiency"] = round(run["tokens_per_s"] / (n * per_worker), 4)
            result["workers"][str(n)] = run
            record(f"{n} workers", run)
        if "full" not in parts:
            pass
        elif "sweep" in parts and args.examples == most * args.examples_per_worker:  # the sweep's last build was this one
            result["direct_full"] = {"workers": most, **result["workers"][str(most)]}
            del result["direct_full"]["efficiency"]
        else:
            result["direct_full"] = {"workers": most, **time_pack(args.examples, tmp / "full", direct(most), most, args.max_len)}
        if "full" in parts:
            record("direct_full", result["direct_full"])
        if "baseline" in parts:
            procs = args.baseline_procs or most
            texts = write_texts(args.examples, tmp, procs)
            result["datasets_trl"] = {"num_proc": procs, **time_datasets_trl(texts, procs, args.max_len)}
            record("datasets_trl", result["datasets_trl"])
        if args.dask_workers and "dask" in parts:
            dask_examples = args.dask_examples or args.examples
            result["dask"] = {"workers": args.dask_workers,
                              **time_dask(dask_examples, tmp / "dask", args.dask_workers, args.max_len)}
            record("dask", result["dask"])

    if parts != set(PARTS):  # a partial run: the ratios need every part
        print(json.dumps(result))
        return
    full, baseline = result["direct_full"], result["datasets_trl"]
    result["efficiency"] = result["workers"][str(most)]["efficiency"]
    result["vs_datasets_trl"] = round(baseline["wall_s"] / full["wall_s"], 4)
    result["peak_rss_worker_bytes"] = {
        "examples": [result["workers"][str(most)]["examples"], full["examples"]],
        "bytes": [result["workers"][str(most)]["peak_rss_worker_bytes"], full["peak_rss_worker_bytes"]],
    }
    record("summary", {key: result[key] for key in ("efficiency", "vs_datasets_trl", "peak_rss_worker_bytes")})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
