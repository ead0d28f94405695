"""Per-example loss and perplexity of a causal LM on packed shards of a held-out split.

    python -m pipeline.pack --dataset data/ --split validation --out shards/   # pack the split once
    python scripts/evaluate.py --model runs/a/checkpoint-1000 --shards shards/DIR --out eval.jsonl
    python scripts/evaluate.py --model runs/a/checkpoint-1000 --mixture validation.json   # per source

Writes one JSON line per example to --out, by example id (its source row number) in source order (``example_id``,
``target_tokens``, ``loss``, ``perplexity``; null for an example with no target token), and
prints the summary as the last line: mean token loss, token perplexity, mean per-example loss.
With ``--mixture`` (a mixture file, docs/mixtures.md) every build of the mixture is evaluated:
each record names its ``source``, and the summary holds each source's under ``sources``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.evaluate import evaluate_sources, pooled_summary  # noqa: E402
from loaders.mixture import load_mixture_file  # noqa: E402
from loaders.remote import locate  # noqa: E402
from loaders.train.models import load_causal_lm  # noqa: E402
from schemas import VarpackError  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hub id or local directory of the causal LM")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--shards", help="shard directory or manifest of the held-out split")
    data.add_argument("--mixture", help="a mixture file: evaluate each of its builds, the loss reported per source")
    parser.add_argument("--out", default="", help="JSON lines file for the per-example results (default: none)")
    parser.add_argument("--batch-rows", type=int, default=1, help="packed rows per forward (default: 1)")
    parser.add_argument("--attn", default="auto", help="attention backend, as in train.py (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="weights' dtype (default: auto, bfloat16 on CUDA and float32 on CPU)")
    parser.add_argument("--allow-tokenizer-mismatch", action="store_true",
                        help="evaluate although the tokenizer in the --model directory differs from the shards'")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked before anything is loaded: a bad one fails in one line, not after the evaluation."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.batch_rows < 1:
        parser.error(f"--batch-rows is {args.batch_rows}; give a positive integer")
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            parser.error(f"--out {args.out} is a directory; give a file name for the JSON lines")
        if not out.parent.is_dir():
            parser.error(f"--out {args.out}: the directory {out.parent} does not exist; create it first")
    return args


def write_records(path: str, lines: Iterable[str]) -> None:
    """Write ``lines`` to ``path`` through a temporary file renamed when complete: never half a file, and the
    temporary one removed whatever stops the write (a full disk fails at the last flush)."""
    target = Path(path)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        builds = load_mixture_file(args.mixture)["sources"] if args.mixture else {"": args.shards}
        for build in builds.values():
            manifest = locate(build).read_manifest()  # a bad build fails before the model loads
            if not args.allow_tokenizer_mismatch:
                from pipeline.encode.tokenizer import check_model_tokenizer

                check_model_tokenizer(args.model, manifest.inputs.tokenizer)
        model = load_causal_lm(args.model, attn_implementation_for(args.attn), dtype).to(device)
        model.config.use_cache = False  # with sdpa, a cache makes transformers ignore the packing
        results = evaluate_sources(model, builds, batch_rows=args.batch_rows)
    except (VarpackError, OSError, ValueError, RuntimeError) as err:
        raise SystemExit(f"evaluate.py: error: {str(err).splitlines()[0]}") from None
    if args.out:
        named = {name: {"source": name} if args.mixture else {} for name in results}
        try:
            write_records(args.out, (json.dumps({**named[name], **record}) + "\n"
                                     for name, result in results.items() for record in result.records()))
        except OSError as err:
            raise SystemExit(f"evaluate.py: error: --out {args.out}: cannot be written ({err.strerror or err}); "
                             "nothing was written") from None
    if args.mixture:
        summary = {"model": args.model, "mixture": args.mixture, **pooled_summary(results),
                   "sources": {name: result.summary for name, result in results.items()}}
    else:
        summary = {"model": args.model, "shards": args.shards, **results[""].summary}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
