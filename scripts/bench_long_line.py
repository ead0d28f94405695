"""Tokenizing one very long text: the whole text in one tokenizers call against pack's pieces.

    python scripts/bench_long_line.py [--chars 20000000] [--repeats 1]

The text is words separated by spaces, as a long document is. With the default tokenizer (a
SentencePiece BPE, whose whole text is one pre-token) tokenizers' BPE costs more than linear
time in the text's length; pack cuts a long text between words (``encode_ids`` with
``PIECE_CHARS``), which gives the same tokens. Both are timed in CPU seconds of this process
(tokenizers runs one text on one core; pieces may use more cores, so CPU time is the fair
measure on a shared machine), alternating, the fastest run of each counting. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from pipeline.encode.examples import PIECE_CHARS, cuts_between_words, encode_ids
from pipeline.encode.tokenizer import load_default_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "number", "seven", "the", "of", "and", "packing"]


def cpu_seconds(run) -> tuple[float, np.ndarray]:
    started = time.process_time()
    ids = run()
    return time.process_time() - started, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(args.chars // 5))[: args.chars]
    backend = load_default_tokenizer().backend()
    assert cuts_between_words(backend)
    dtype = np.dtype(np.uint16)
    whole, pieces = [], []
    for _ in range(args.repeats):
        seconds, whole_ids = cpu_seconds(lambda: encode_ids(backend, [text], dtype)[0])
        whole.append(seconds)
        print(f"whole text: {seconds:.2f} s", flush=True)
        seconds, piece_ids = cpu_seconds(lambda: encode_ids(backend, [text], dtype, PIECE_CHARS)[0])
        pieces.append(seconds)
        print(f"pieces:     {seconds:.2f} s", flush=True)
    print(json.dumps({
        "chars": len(text),
        "tokens": int(whole_ids.size),
        "same_tokens": bool(np.array_equal(whole_ids, piece_ids)),
        "whole_cpu_s": round(min(whole), 2),
        "pieces_cpu_s": round(min(pieces), 2),
        "speedup": round(min(whole) / min(pieces), 1),
    }))


if __name__ == "__main__":
    main()
