"""End-to-end throughput of ``python -m pipeline.pack`` against raw tokenization of the same texts.

    python scripts/bench_pipeline.py [--dataset synthetic-flan] [--examples 100000]

The texts are generated once and written to a Parquet file (not timed). Then:

- ``encode_batch``: the tokenizers ``Tokenizer.encode_batch`` of the default tokenizer over the
  texts of all examples, prompt and response joined by ``--prompt-template`` as the pipeline joins
  them, in batches of ``--batch-texts``, texts already in memory;
- ``pipeline``: ``python -m pipeline.pack --dataset FILE`` in a fresh process, wall clock from
  start to exit: Python and Beam start-up, hashing, reading, tokenizing, packing, writing;
- these two alternate ``--repeats`` times and the fastest run of each counts, so that load
  from other processes on a shared machine weighs on neither side more than the other;
- ``datasets.map``: ``Dataset.map(batched=True)`` with the same tokenizer as a transformers
  fast tokenizer, default batch size, the texts already loaded into a Dataset (run once);
- the pipeline on 200 examples, as its fixed start-up cost.

Every rate counts the same tokens: those of the texts with the template's text, without the BOS/EOS
the pipeline adds.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.encode.examples import special_affixes
from pipeline.read.formats import DEFAULT_PROMPT_TEMPLATE, split_prompt_template
from pipeline.read.synthetic import BLOCK_EXAMPLES, SHAPES, generate_block
from pipeline.encode.tokenizer import load_tokenizer
from schemas import read_manifest

REPO = Path(__file__).resolve().parents[1]


def write_texts(dataset: str, examples: int, path: Path) -> pa.Table:
    blocks = [
        generate_block(SHAPES[dataset], b, min(BLOCK_EXAMPLES, examples - b * BLOCK_EXAMPLES))
        for b in range(-(-examples // BLOCK_EXAMPLES))
    ]
    table = pa.concat_tables(blocks)
    pq.write_table(table, path)
    return table


def time_encode_batch(backend, texts: list[str], batch_texts: int) -> tuple[float, int]:
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch_texts):
        tokens += sum(len(e) for e in backend.encode_batch(texts[i : i + batch_texts], add_special_tokens=False))
    return time.perf_counter() - started, tokens


def templated(table: pa.Table, prompt_template: str) -> list[str]:
    """The text of each example as the pipeline tokenizes it: prompt and response joined by the template."""
    before, between, after = split_prompt_template(prompt_template)
    prompts, responses = table.column("prompt").to_pylist(), table.column("response").to_pylist()
    return [before + prompt + between + response + after for prompt, response in zip(prompts, responses)]


def time_pipeline(data: Path, out: Path, prompt_template: str) -> tuple[float, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipeline.pack", "--dataset", str(data), "--out", str(out), "--no-progress", "--force",
         "--prompt-template", prompt_template],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - started
    (build,) = [p for p in out.iterdir() if p.name.startswith(data.stem)]
    return elapsed, read_manifest(build).stats.to_dict()


def time_datasets_map(table: pa.Table, prompt_template: str, tokenizer, cache: Path) -> tuple[float, int]:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend())
    dataset = datasets.Dataset(pa.table({"text": templated(table, prompt_template)}))

    def tokenize(batch):
        return {"input_ids": fast(batch["text"], add_special_tokens=False)["input_ids"]}

    started = time.perf_counter()
    mapped = dataset.map(tokenize, batched=True, remove_columns=["text"], cache_file_name=str(cache / "map.arrow"))
    elapsed = time.perf_counter() - started
    tokens = int(pa.compute.sum(pa.compute.list_value_length(mapped.data.column("input_ids"))).as_py())
    return elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(SHAPES), default="synthetic-flan")
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--batch-texts", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-template", default=DEFAULT_PROMPT_TEMPLATE)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tokenizer = load_tokenizer()
    backend = tokenizer.backend()
    prefix, suffix = special_affixes(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / f"{args.dataset}.parquet"
        table = write_texts(args.dataset, args.examples, data)
        texts = templated(table, args.prompt_template)

        encode_runs, pipeline_runs = [], []
        for _ in range(args.repeats):
            encode_s, text_tokens = time_encode_batch(backend, texts, args.batch_texts)
            encode_runs.append(encode_s)
            pipeline_s, stats = time_pipeline(data, tmp / "out", args.prompt_template)
            pipeline_runs.append(pipeline_s)
        encode_s, pipeline_s = min(encode_runs), min(pipeline_runs)
        map_s, map_tokens = time_datasets_map(table, args.prompt_template, tokenizer, tmp)
        small = tmp / "small.parquet"
        pq.write_table(table.slice(0, 200), small)
        startup_s, _ = time_pipeline(small, tmp / "out_small", args.prompt_template)

    special = len(prefix) + len(suffix)
    assert stats["tokens"] == text_tokens + special * args.examples, (stats["tokens"], text_tokens)
    assert map_tokens == text_tokens
    result = {
        "dataset": args.dataset,
        "examples": args.examples,
        "prompt_template": args.prompt_template,
        "text_tokens": text_tokens,
        "cpu_count": os.cpu_count(),
        "pipeline_s": [round(s, 2) for s in pipeline_runs],
        "encode_batch_s": [round(s, 2) for s in encode_runs],
        "datasets_map_s": round(map_s, 2),
        "pipeline_startup_s": round(startup_s, 2),
        "fill": round(stats["fill"], 6),
        "pipeline_tokens_per_s": round(text_tokens / pipeline_s),
        "encode_batch_tokens_per_s": round(text_tokens / encode_s),
        "datasets_map_tokens_per_s": round(text_tokens / map_s),
        "ratio": round(encode_s / pipeline_s, 4),
        "ratio_vs_datasets_map": round(map_s / pipeline_s, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
