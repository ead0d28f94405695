"""Build a small shard directory from given example lengths, through the real packer and writer.

For loader tests: random token ids, the first part of each example a prompt (loss mask 0),
packed with best-fit decreasing and written by ``pipeline.write.shard_writer.ShardWriter``
(``pipeline.write.random_build.random_token_build``).
``ShardDir`` keeps the source examples so a test can check that the loader hands back exactly
these tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair's token ids."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def pair_segments(pair: PreferencePair, layout: str) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """The segments of ``pair`` in ``layout`` as the preference contract lays them out: (tokens, loss masks, roles,
    example offsets). A shared prompt of one token gives the separate shape."""
    p, c, r = pair.prompt, pair.chosen, pair.rejected
    if layout == "shared-prompt" and len(p) >= 2:
        head = len(p) - 1
        return ([p[:-1], p[-1:] + c, p[-1:] + r], [[0] * head, [0] + [1] * len(c), [0] + [1] * len(r)], [0, 1, 2],
                [0, head, head])
    if layout not in ("separate", "shared-prompt"):
        raise ValueError(f"unknown preference layout {layout!r}")
    return [p + c, p + r], [[0] * len(p) + [1] * len(c), [0] * len(p) + [1] * len(r)], [1, 2], [0, 0]


def build_preference_dir(path: str | Path, pairs: list[PreferencePair], *, layout: str = "separate", capacity: int = 64,
                         rows_per_shard: int = 4, vocab_size: int = 128) -> Manifest:
    """Pack whole ``pairs`` (best-fit decreasing over each pair's tokens in ``layout``) into rows of
    schemas.PREFERENCE_ROW_SCHEMA and write shards and a manifest into ``path``; pair ids are the pairs' indices."""
    import hashlib
    import json

    import pyarrow as pa

    from pipeline.packing.algorithms import pack
    from pipeline.write.shard_writer import finish_build, shard_name
    from schemas import (PREFERENCE_ROW_SCHEMA, BuildInputs, DatasetInputs, LossMasking, Overflow, PackingAlgorithm,
                         PackingStats, TokenizerInputs)
    from schemas.io import atomic_file
    from schemas.manifest import BuildFormat, compute_fingerprint
    from schemas.row import validate_table
    from schemas.shard_identity import ShardIdentity, with_identity
    from schemas import stream_sha256, ShardInfo

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    laid_out = [pair_segments(pair, layout) for pair in pairs]
    sizes = np.array([sum(len(s) for s in segments) for segments, *_ in laid_out], dtype=np.int64)
    plan = pack(sizes, capacity, overflow=Overflow.DROP, algorithm=PackingAlgorithm.BEST_FIT_DECREASING)
    if plan.stats.examples_dropped:
        raise ValueError(f"{plan.stats.examples_dropped} pairs are longer than a row of {capacity} tokens")
    rows = []
    for r in range(plan.num_rows):
        row = {"input_ids": [], "loss_mask": [], "cu_seqlens": [0], "example_ids": [], "example_offsets": [], "roles": []}
        for pair_id in plan.segment_example[plan.row_offsets[r] : plan.row_offsets[r + 1]].tolist():
            tokens, masks, roles, offsets = laid_out[pair_id]
            for segment, mask in zip(tokens, masks):
                row["input_ids"] += segment
                row["loss_mask"] += mask
                row["cu_seqlens"].append(row["cu_seqlens"][-1] + len(segment))
            row["example_ids"] += [pair_id] * len(roles)
            row["example_offsets"] += offsets
            row["roles"] += roles
        row["num_tokens"] = len(row["input_ids"])
        row["max_seqlen"] = int(np.diff(row["cu_seqlens"]).max())
        rows.append(row)
    content = hashlib.sha256(json.dumps([layout, [vars(p) for p in pairs]]).encode()).hexdigest()
    inputs = BuildInputs(
        dataset=DatasetInputs(id=f"synthetic-pairs-{layout}", split="train", content_hash=content, num_examples=len(pairs)),
        tokenizer=TokenizerInputs(name="synthetic", content_hash=f"vocab-{vocab_size}", vocab_size=vocab_size),
        template="none", loss_masking=LossMasking.GIVEN, max_len=capacity, overflow=Overflow.DROP,
        packing=PackingAlgorithm.BEST_FIT_DECREASING, seed=0, package_version="0.1.0",
        format=BuildFormat.PREFERENCE, preference_layout=layout,
    )
    fingerprint = compute_fingerprint(inputs)
    shards = []
    for index, start in enumerate(range(0, len(rows), rows_per_shard)):
        table = pa.Table.from_pylist(rows[start : start + rows_per_shard], PREFERENCE_ROW_SCHEMA)
        validate_table(table, capacity, shard_name(index))
        schema = with_identity(PREFERENCE_ROW_SCHEMA, ShardIdentity(fingerprint, index, start + rows_per_shard >= len(rows)))
        with atomic_file(path / shard_name(index)) as file:
            with pa.ipc.new_file(file, schema) as writer:
                writer.write_table(table.replace_schema_metadata(schema.metadata), max_chunksize=table.num_rows)
            file.flush()
            file.seek(0)
            sha256 = stream_sha256(file)
            shards.append(ShardInfo(path=shard_name(index), rows=table.num_rows, sha256=sha256, bytes=file.seek(0, 2),
                                    tokens=int(sum(row["num_tokens"] for row in rows[start : start + rows_per_shard]))))
    segments_per_row: dict[str, int] = {}
    for row in rows:
        key = str(len(row["roles"]))
        segments_per_row[key] = segments_per_row.get(key, 0) + 1
    stats = PackingStats(examples=len(pairs), segments=sum(len(r["roles"]) for r in rows), tokens=int(sizes.sum()),
                         rows=len(rows), capacity_tokens=capacity * len(rows), num_example_ids=len(pairs), pairs=len(pairs),
                         segments_per_row=dict(sorted(segments_per_row.items(), key=lambda item: int(item[0]))))
    return finish_build(str(path), inputs, rows_per_shard, shards, stats)
