"""Packed rows -> one FlashAttention-2 varlen batch, the keyword arguments transformers accepts.

Rows are copied once from the memory-mapped shards into the batch's int64 buffers; labels and
position ids are whole-batch numpy operations. The only Python loop is over rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from loaders.shard_reader import Shard

IGNORE_INDEX = -100
# Batch keys that hold counts (Python ints), not model inputs: real (non-pad) tokens and
# positions with a loss (labels != -100).
NUM_REAL_TOKENS = "num_real_tokens"
NUM_LOSS_TOKENS = "num_loss_tokens"
COUNT_KEYS = (NUM_REAL_TOKENS, NUM_LOSS_TOKENS)
# A mixture's batches: the source index of each real sequence of cu_seq_lens (int64 [n]); not a model input.
SOURCE_IDS = "source_ids"
# A preference build's batches (``preference_fields``): each real sequence's pair id (int64 [n]) and role (uint8 [n]),
# and the pairs the batch holds (a Python int); not model inputs.
PAIR_IDS = "pair_ids"
ROLES = "roles"
NUM_PAIRS = "num_pairs"
PREFERENCE_KEYS = (PAIR_IDS, ROLES, NUM_PAIRS)
# Roles of a preference row's segments (schemas.PREFERENCE_ROW_SCHEMA).
PROMPT, CHOSEN, REJECTED = 0, 1, 2
# A shared-prompt batch's attention input: the token of the batch each key comes from (int64 [keys]); the
# attention functions of loaders.train.attention gather K and V with it (see ``shared_prompt_keys``).
KEY_INDEX = "key_index"
# Bucketed fixed shapes: sequences in cu_seqlens rounded up to a multiple of this, max_length
# to a power of two of at least MIN_BUCKET_LENGTH (FA2's query block is 128 tokens).
SEGMENT_BUCKET = 64
MIN_BUCKET_LENGTH = 128


@dataclass(frozen=True)
class FixedShape:
    """The shape every batch is padded to, so torch.compile and CUDA graphs see one shape.

    ``tokens`` is the length of ``input_ids``; ``cu_seqlens`` the length of ``cu_seq_lens_q``;
    ``max_length`` the row capacity, which bounds every real segment and every pad chunk.

    With ``buckets``, only ``tokens`` is fixed: ``max_length`` is the batch's longest sequence
    rounded up to a power of two (at most ``max_length``), pad chunks are at most that long,
    and the sequences in ``cu_seq_lens`` are rounded up to a multiple of ``SEGMENT_BUCKET``.
    FA2 launches ``ceil(max_length / 128)`` query blocks per sequence and head, empty ones
    included, so worst-case padding (about 170 sequences of 4096 per FLAN-shaped row) launches
    mostly empty blocks; buckets keep a handful of shapes, each compiled once when
    ``cu_seq_lens`` is marked dynamic.
    """

    tokens: int
    cu_seqlens: int
    max_length: int
    buckets: bool = False


def fixed_shape(tokens: int, max_segments: int, capacity: int, buckets: bool = False) -> FixedShape:
    """The fixed shape for batches of at most ``tokens`` tokens and ``max_segments`` segments.

    The padding is cut into chunks of at most ``capacity`` tokens, so ``max_length`` stays
    ``capacity`` and pad position ids stay below it; there are at most ``ceil(tokens / capacity)``.
    """
    pad_chunks = -(-tokens // capacity)
    return FixedShape(tokens=tokens, cu_seqlens=max_segments + pad_chunks + 1, max_length=capacity, buckets=buckets)


def bucket_length(longest: int, capacity: int) -> int:
    """``longest`` rounded up to a power of two, at least MIN_BUCKET_LENGTH, at most ``capacity``.

    >>> [bucket_length(n, 4096) for n in (90, 300, 2049, 4096)]
    [128, 512, 4096, 4096]
    """
    return min(capacity, max(MIN_BUCKET_LENGTH, 1 << max(0, longest - 1).bit_length()))


def collate_rows(
    rows: Sequence[tuple[Shard, int]],
    *,
    fixed: FixedShape | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor | int]:
    """Concatenate rows (shard, row index) into one batch of FA2 varlen keyword arguments.

    ``labels`` is -100 where ``loss_mask`` is 0 and on the first token of every segment, so no
    example learns to predict the start of the next. ``position_ids`` restart at 0 per
    segment. With ``fixed``, a trailing pad (``pad_token_id``, labels -100) fills the batch to
    ``fixed.tokens`` and ``cu_seq_lens`` repeats its last value up to ``fixed.cu_seqlens`` (or,
    with ``fixed.buckets``, up to the next multiple of SEGMENT_BUCKET sequences).
    ``num_real_tokens`` and ``num_loss_tokens`` count the data tokens and the labels that are
    not -100, as Python ints, so a training step needs no device sync to know them.

    The worked row of ``schemas/row.py``: three examples of 3, 2 and 4 tokens, the first
    one's prompt untrained.

    >>> import tempfile, pyarrow as pa
    >>> from schemas import ROW_SCHEMA
    >>> from loaders.shard_reader import open_shard
    >>> row = {"input_ids": [1, 306, 2, 1, 2, 1, 450, 338, 2], "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1, 1],
    ...        "cu_seqlens": [0, 3, 5, 9], "max_seqlen": 4, "num_tokens": 9,
    ...        "example_ids": [7, 12, 40], "example_offsets": [0, 0, 0]}
    >>> path = tempfile.mkdtemp() + "/shard-00000.arrow"
    >>> with pa.ipc.new_file(path, ROW_SCHEMA) as writer:
    ...     writer.write_table(pa.Table.from_pylist([row], ROW_SCHEMA))
    >>> batch = collate_rows([(open_shard(path, capacity=10), 0)])
    >>> batch["cu_seq_lens_q"].tolist(), batch["max_length_q"]
    ([0, 3, 5, 9], 4)
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    >>> batch["labels"].tolist()
    [[-100, -100, 2, -100, 2, -100, 450, 338, 2]]
    >>> batch["num_real_tokens"], batch["num_loss_tokens"]
    (9, 5)
    """
    token_ranges = []
    cu_parts = []
    preference = [shard.roles is not None for shard, _ in rows]
    if any(preference) and not all(preference):
        raise ValueError("a batch mixes preference rows (with roles) and other rows; train on one kind of build")
    max_length = 0
    total = 0
    for shard, i in rows:
        t0, t1 = int(shard.token_offsets[i]), int(shard.token_offsets[i + 1])
        c0, c1 = int(shard.cu_offsets[i]), int(shard.cu_offsets[i + 1])
        token_ranges.append((shard, t0, t1))
        cu_parts.append(shard.cu_seqlens[c0 + 1 : c1] + total)
        max_length = max(max_length, int(shard.max_seqlen[i]))
        total += t1 - t0

    width = fixed.tokens if fixed is not None else total
    if total > width:
        raise ValueError(f"the batch holds {total} tokens, more than the fixed shape's {width}")
    input_ids = np.empty(width, dtype=np.int64)
    loss_mask = np.empty(width, dtype=np.uint8)
    at = 0
    for shard, t0, t1 in token_ranges:
        input_ids[at : at + t1 - t0] = shard.input_ids[t0:t1]
        loss_mask[at : at + t1 - t0] = shard.loss_mask[t0:t1]
        at += t1 - t0

    ends = [np.zeros(1, dtype=np.int64), *cu_parts]
    if fixed is not None:
        input_ids[total:] = pad_token_id
        loss_mask[total:] = 0
        max_length = bucket_length(max_length, fixed.max_length) if fixed.buckets else fixed.max_length
        ends.append(np.arange(total, width, max_length, dtype=np.int64)[1:])
        ends.append(np.array([width], dtype=np.int64) if width > total else np.zeros(0, dtype=np.int64))
    cu_seqlens = np.concatenate(ends).astype(np.int32)
    starts = cu_seqlens[:-1].astype(np.int64)
    lengths = np.diff(cu_seqlens).astype(np.int64)

    # labels = input_ids where loss_mask else -100, without a boolean gather: (ids + 100) * mask - 100.
    labels = np.add(input_ids, -IGNORE_INDEX)
    np.multiply(labels, loss_mask, out=labels)
    labels += IGNORE_INDEX
    labels[starts] = IGNORE_INDEX
    position_ids = np.arange(width, dtype=np.int64)
    position_ids -= np.repeat(starts, lengths)
    extra: dict[str, torch.Tensor | int] = {}
    if rows and all(preference):
        extra = preference_fields(rows, cu_seqlens, position_ids)

    if fixed is not None:
        if fixed.buckets:
            size = -(-(cu_seqlens.size - 1) // SEGMENT_BUCKET) * SEGMENT_BUCKET + 1
        elif cu_seqlens.size > fixed.cu_seqlens:
            raise ValueError(
                f"the batch holds {cu_seqlens.size - 1} sequences, more than the fixed shape's "
                f"{fixed.cu_seqlens - 1}: the manifest's stats.segments_per_row undercounts; rebuild the manifest"
            )
        else:
            size = fixed.cu_seqlens
        cu_seqlens = np.concatenate((cu_seqlens, np.full(size - cu_seqlens.size, width, dtype=np.int32)))
    cu = torch.from_numpy(cu_seqlens)
    batch: dict[str, torch.Tensor | int] = {
        "input_ids": torch.from_numpy(input_ids).unsqueeze(0),
        "labels": torch.from_numpy(labels).unsqueeze(0),
        "position_ids": torch.from_numpy(position_ids).unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_length,
        "max_length_k": max_length,
        NUM_REAL_TOKENS: total,
        NUM_LOSS_TOKENS: int(np.count_nonzero(labels != IGNORE_INDEX)),
        **extra,
    }
    if extra:
        roles = cast(torch.Tensor, extra[ROLES]).numpy()
        if np.any(roles == PROMPT):
            batch.update(shared_prompt_keys(cu_seqlens, roles, cast(torch.Tensor, extra[PAIR_IDS]).numpy()))
    return batch


def preference_fields(rows: Sequence[tuple[Shard, int]], cu_seqlens: np.ndarray,
                      position_ids: np.ndarray) -> dict[str, torch.Tensor | int]:
    """The pair id and role of each real sequence of a preference batch, and its number of pairs; shifts
    ``position_ids`` (in place) by each segment's ``example_offsets``, so a shared prompt's branches continue
    its positions.

    Raises ValueError naming the shard and row where a chosen and a rejected sequence do not pair up in
    order (the rows are not a preference build's, or are corrupt).
    """
    pair_ids, roles, offsets = [], [], []
    for shard, i in rows:
        s0, s1 = int(shard.segment_offsets[i]), int(shard.segment_offsets[i + 1])
        assert shard.roles is not None  # collate_rows checked every row
        row_roles = shard.roles[s0:s1]
        row_pairs = shard.example_ids[s0:s1]
        chosen, rejected = row_pairs[row_roles == CHOSEN], row_pairs[row_roles == REJECTED]
        prompts = row_pairs[row_roles == PROMPT]
        if chosen.shape != rejected.shape or np.any(chosen != rejected) or not np.isin(prompts, chosen).all():
            raise ValueError(f"{shard.path}: row {i}: its chosen and rejected sequences do not pair up "
                             f"(pair ids {row_pairs.tolist()}, roles {row_roles.tolist()}); rebuild it")
        pair_ids.append(row_pairs)
        roles.append(row_roles)
        offsets.append(shard.example_offsets[s0:s1])
    segment_offsets = np.concatenate(offsets).astype(np.int64)
    lengths = np.diff(cu_seqlens)[: segment_offsets.size].astype(np.int64)
    position_ids[: int(cu_seqlens[segment_offsets.size])] += np.repeat(segment_offsets, lengths)
    all_roles = np.concatenate(roles).astype(np.uint8)
    return {
        PAIR_IDS: torch.from_numpy(np.concatenate(pair_ids).astype(np.int64)),
        ROLES: torch.from_numpy(all_roles),
        NUM_PAIRS: int(np.count_nonzero(all_roles == CHOSEN)),
    }


def shared_prompt_keys(cu_seqlens: np.ndarray, roles: np.ndarray, pair_ids: np.ndarray) -> dict[str, torch.Tensor | int]:
    """The key side of a shared-prompt batch for an exact varlen kernel: ``key_index``, ``cu_seq_lens_k``, ``max_length_k``.

    Each branch (chosen or rejected) that follows its pair's prompt segment sees the prompt's keys, then its own; any
    other sequence sees its own. Gathering K and V with ``key_index`` lays them out as ``[P | P C' | P R']`` per pair,
    so with ``cu_seq_lens_q`` over the tokens and ``cu_seq_lens_k`` over the gathered keys, causal attention aligned at
    the bottom right (FA2's, for more keys than queries) lets a branch see the prompt and itself, never the other branch.

    A pair of prompt ``[5, 6, 7]``, chosen ``[8, 9]`` and rejected ``[4]`` is laid out ``[5, 6 | 7, 8, 9 | 7, 4]``:

    >>> keys = shared_prompt_keys(np.array([0, 2, 5, 7]), np.array([0, 1, 2]), np.array([3, 3, 3]))
    >>> keys["key_index"].tolist(), keys["cu_seq_lens_k"].tolist(), keys["max_length_k"]
    ([0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6], [0, 2, 7, 11], 5)
    """
    n = roles.size
    lengths = np.diff(cu_seqlens).astype(np.int64)
    starts = cu_seqlens[:-1].astype(np.int64)
    # Each real branch's prompt is the segment `role` places before it (contract: [prompt, chosen, rejected]).
    index = np.arange(n)
    prompt = index - roles.astype(np.int64)
    has_prompt = (roles != PROMPT) & (prompt >= 0)
    has_prompt[has_prompt] &= (roles[prompt[has_prompt]] == PROMPT) & (pair_ids[prompt[has_prompt]] == pair_ids[has_prompt])
    prefix_start = np.zeros(lengths.size, np.int64)
    prefix_length = np.zeros(lengths.size, np.int64)
    prefix_start[:n][has_prompt] = starts[prompt[has_prompt]]
    prefix_length[:n][has_prompt] = lengths[prompt[has_prompt]]
    # Two pieces of keys per sequence, the prompt's (empty for most) then its own, as one vectorised gather.
    piece_start = np.stack((prefix_start, starts), axis=1).reshape(-1)
    piece_length = np.stack((prefix_length, lengths), axis=1).reshape(-1)
    piece_end = np.cumsum(piece_length)
    key_index = np.arange(int(piece_end[-1]) if piece_end.size else 0, dtype=np.int64)
    key_index += np.repeat(piece_start - (piece_end - piece_length), piece_length)
    key_lengths = prefix_length + lengths
    cu_k = np.concatenate(([0], np.cumsum(key_lengths))).astype(np.int32)
    return {KEY_INDEX: torch.from_numpy(key_index), "cu_seq_lens_k": torch.from_numpy(cu_k),
            "max_length_k": int(key_lengths.max())}
