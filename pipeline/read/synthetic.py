"""Generated prompt/response text whose token lengths follow the FLAN or OrcaMath shape, for scale tests.

Every word of the vocabulary below is one token of the default (Mistral-7B v0.1) tokenizer,
with or without a leading space, so an example of target length ``n`` (BOS and EOS included)
has exactly ``n`` tokens with that tokenizer and about ``n`` with other BPE tokenizers. The
text depends only on the shape, the example index and GENERATOR_VERSION: examples are drawn
in fixed blocks, each from its own seeded generator, so any block can be made on any worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

GENERATOR_VERSION = 1
BLOCK_EXAMPLES = 8192
DEFAULT_NUM_EXAMPLES = 100_000
SPECIAL_TOKENS = 2  # BOS and EOS around prompt + response

WORDS = (
    "the of and to in is was for that with as on by at from this are be or an which it not have has had were "
    "but all their they one also its been more new first can other after two may into would when most used time "
    "some these only over such no than many between three about during through both under while where people "
    "then world years each made known well since part year city later because called them work number name state "
    "being small same found life high several different large long system group before use area until government "
    "four against early including house day however family water second five end country based game back power "
    "form company following public music local general school line place law great order good case point"
).split()

_WORD_BUFFER = np.frombuffer(" ".join(WORDS).encode("ascii") + b" ", dtype=np.uint8)
_WORD_CHARS = np.array([len(w) + 1 for w in WORDS], dtype=np.int32)
_WORD_STARTS = (np.cumsum(_WORD_CHARS) - _WORD_CHARS).astype(np.int64)


TEXT_CHUNK = 1024


@dataclass(frozen=True)
class LengthShape:
    """A distribution of example token lengths and the share of each example that is prompt."""

    name: str
    distribution: str  # "lognormal" (mu, sigma of log length) or "normal" (mean, sd)
    loc: float
    scale: float
    min_len: int
    max_len: int
    prompt_share: float

    def lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` token lengths drawn from the shape, rounded and clipped to [min_len, max_len]."""
        if self.distribution == "lognormal":
            raw = rng.lognormal(self.loc, self.scale, n)
        else:
            raw = rng.normal(self.loc, self.scale, n)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


SHAPES = {
    # FLAN: long inputs, short targets.
    "synthetic-flan": LengthShape("synthetic-flan", "lognormal", 5.3, 0.9, 16, 4096, prompt_share=0.8),
    # OrcaMath: short questions, worked answers.
    "synthetic-orcamath": LengthShape("synthetic-orcamath", "normal", 450.0, 150.0, 32, 4096, prompt_share=0.25),
}


def generate_block(shape: LengthShape, block: int, count: int = BLOCK_EXAMPLES) -> pa.Table:
    """The first ``count`` examples of block ``block`` as a table of ``prompt`` and ``response`` strings."""
    rng = np.random.default_rng([GENERATOR_VERSION, block])
    words_per_example = shape.lengths(rng, BLOCK_EXAMPLES)[:count] - SPECIAL_TOKENS
    prompt_words = np.clip(np.rint(words_per_example * shape.prompt_share).astype(np.int64), 1, words_per_example - 1)
    response_words = words_per_example - prompt_words
    word_ids = rng.integers(0, len(WORDS), int(words_per_example.sum()))
    # Each text is a run of words (each with its trailing space) minus the last space. The
    # characters are gathered with numpy from one ASCII buffer, TEXT_CHUNK texts at a time:
    # a whole block at once would hold about 300 MB of gather indices.
    text_word_ends = np.cumsum(np.stack([prompt_words, response_words], axis=1).ravel())
    texts: list[str] = []
    for first in range(0, text_word_ends.size, TEXT_CHUNK):
        ends = text_word_ends[first : first + TEXT_CHUNK]
        word_start = int(text_word_ends[first - 1]) if first else 0
        word_chars = _WORD_CHARS[word_ids[word_start : int(ends[-1])]]
        char_ends = np.cumsum(word_chars, dtype=np.int64)
        gather = np.repeat((_WORD_STARTS[word_ids[word_start : int(ends[-1])]] - (char_ends - word_chars)).astype(np.int32), word_chars)
        gather += np.arange(int(char_ends[-1]), dtype=np.int32)
        text = _WORD_BUFFER[gather].tobytes().decode("ascii")
        stops = char_ends[ends - word_start - 1] - 1
        starts = np.concatenate(([0], stops[:-1] + 1))
        texts += [text[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
    return pa.table({"prompt": texts[0::2], "response": texts[1::2]})
