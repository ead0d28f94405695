"""Build a small shard directory from given example lengths, through the real packer and writer.

For loader tests: random token ids, the first part of each example a prompt (loss mask 0),
packed with best-fit decreasing and written by ``pipeline.write.shard_writer.ShardWriter``
(``pipeline.write.random_build.random_token_build``).
Preference builds are written by ``pipeline.write.preference_build``.
``ShardDir`` keeps the source examples so a test can check that the loader hands back exactly
these tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.write.preference_build import PreferencePair, preference_build
from pipeline.write.random_build import random_token_build
from schemas import Manifest


@dataclass(frozen=True)
class ShardDir:
    """A written build and the examples it was packed from."""

    path: Path
    manifest: Manifest
    tokens: np.ndarray  # int32, every example's tokens back to back
    loss_mask: np.ndarray  # uint8, aligned with tokens
    starts: np.ndarray  # int64 [examples]: where each example begins in tokens
    lengths: np.ndarray  # int64 [examples]

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss_mask) of example ``i``."""
        a, b = int(self.starts[i]), int(self.starts[i] + self.lengths[i])
        return self.tokens[a:b], self.loss_mask[a:b]


def build_shard_dir(
    path: str | Path,
    lengths: np.ndarray | list[int],
    *,
    capacity: int = 64,
    rows_per_shard: int | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
    overflow: str = "split",
) -> ShardDir:
    """Pack examples of ``lengths`` tokens into rows of ``capacity`` and write shards + manifest into ``path``."""
    path = Path(path)
    lengths = np.asarray(lengths, dtype=np.int64)
    manifest, tokens, loss_mask = random_token_build(path, lengths, capacity, rows_per_shard, vocab_size, seed, overflow)
    starts = np.cumsum(lengths) - lengths
    return ShardDir(path=path, manifest=manifest, tokens=tokens, loss_mask=loss_mask, starts=starts, lengths=lengths)


def build_preference_dir(path: str | Path, pairs: list[PreferencePair], *, layout: str = "separate", capacity: int = 64,
                         rows_per_shard: int = 4, vocab_size: int = 128) -> Manifest:
    """Pack whole ``pairs`` in ``layout`` into preference rows and write shards and a manifest into ``path``
    (``pipeline.write.preference_build.preference_build``); pair ids are the pairs' indices."""
    return preference_build(path, pairs, layout, capacity, rows_per_shard, vocab_size)
