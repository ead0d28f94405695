"""Attention backends for packed batches: FlashAttention-2 varlen, PyTorch's varlen_attn, sdpa.

A packed batch is one long sequence ``[1, T]`` whose examples are delimited by ``cu_seq_lens``.
Four kernels can train on it without letting examples attend to one another:

- ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` (package flash-attn, CUDA), registered
  in transformers as ``"varpack_fa2"`` (no "flash" in the name: transformers
  takes any such name for a Hub kernel to download).
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA), the same
  FA2 kernels shipped inside PyTorch, registered as ``"varpack_varlen"``, so
  ``from_pretrained(..., attn_implementation="varpack_varlen")`` works without flash-attn.
- ``sdpa_segments``: sdpa over one example at a time, causal and unmasked, registered as
  ``"varpack_segments"``: any device, and memory that grows with the longest example, not with
  the batch. The CPU choice.
- ``sdpa``: transformers' own. It finds the example boundaries from ``position_ids``, but only
  with ``config.use_cache=False`` and no ``attention_mask``, and builds a T x T mask: memory
  grows with the square of the batch's tokens.

A shared-prompt preference batch (``loaders.collate.shared_prompt_keys``) also carries ``key_index``:
each of these functions (not transformers' own) then gathers K and V with it, so each chosen or
rejected branch attends to its prompt's keys and its own, with ``cu_seq_lens_k`` over the gathered
keys and causality aligned at the bottom right: exact, the prompt computed once.

The registered functions take the boundaries from the batch (``cu_seq_lens_*``,
``max_length_*``) and register no mask function, so transformers builds no mask for them and
skips its packed-sequence check on ``position_ids``, a device-to-host sync every forward that
its own ``"flash_attention_2"`` pays. That one stays usable: pass its name as the backend.

Imports only torch at module import; transformers is imported inside the functions that need it.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import lru_cache, partial
from typing import Any, cast

import torch

FLASH_IMPLEMENTATION = "varpack_fa2"
VARLEN_IMPLEMENTATION = "varpack_varlen"
# No "sdpa" in the name either: transformers applies its sdpa-only checks to any such name.
SEGMENTS_IMPLEMENTATION = "varpack_segments"
BACKENDS = ("flash_attn", "torch_varlen", "sdpa_segments", "sdpa")
# The transformers attn_implementation that runs each backend.
ATTN_IMPLEMENTATIONS = {
    "flash_attn": FLASH_IMPLEMENTATION,
    "torch_varlen": VARLEN_IMPLEMENTATION,
    "sdpa_segments": SEGMENTS_IMPLEMENTATION,
    "sdpa": "sdpa",
}
# The implementations that honour a shared-prompt batch's key_index; transformers' own would ignore it.
KEY_INDEX_IMPLEMENTATIONS = (FLASH_IMPLEMENTATION, VARLEN_IMPLEMENTATION, SEGMENTS_IMPLEMENTATION)
# Transformers' own implementations, accepted as they are.
TRANSFORMERS_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention")


def flash_attn_available() -> bool:
    """True when CUDA is up and the flash-attn package can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available() -> bool:
    """True when CUDA is up and this torch has ``torch.nn.attention.varlen`` (torch >= 2.10)."""
    return torch.cuda.is_available() and importlib.util.find_spec("torch.nn.attention.varlen") is not None


def available_backends() -> list[str]:
    """The backends usable on this machine, best first."""
    found = [name for name, ok in (("flash_attn", flash_attn_available()), ("torch_varlen", torch_varlen_available())) if ok]
    return [*found, "sdpa_segments", "sdpa"]


def best_backend() -> str:
    """The fastest backend available here: flash_attn, then torch_varlen, then sdpa_segments."""
    return available_backends()[0]


def best_attn_implementation() -> str:
    """The transformers ``attn_implementation`` of the best backend, registered if it is ours."""
    return attn_implementation_for(best_backend())


def attn_implementation_for(backend: str) -> str:
    """The transformers ``attn_implementation`` for ``backend``, registered if it is ours.

    ``backend`` is ``auto`` (the best available), one of BACKENDS, or one of transformers' own
    implementations (TRANSFORMERS_IMPLEMENTATIONS), returned unchanged.
    """
    if backend == "auto":
        return best_attn_implementation()
    if backend in TRANSFORMERS_IMPLEMENTATIONS:
        return backend
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose auto, one of {', '.join(BACKENDS)}, "
            f"or a transformers implementation ({', '.join(TRANSFORMERS_IMPLEMENTATIONS)})"
        )
    if backend not in available_backends():
        raise RuntimeError(f"attention backend {backend!r} is not available here (available: {', '.join(available_backends())})")
    if backend == "sdpa_segments":
        return register_segment_attention()
    if backend != "sdpa":
        register_varlen_attention(backend)
    return ATTN_IMPLEMENTATIONS[backend]


def check_key_index_attention(model: torch.nn.Module) -> None:
    """Raise ValueError unless ``model`` attends through an implementation that honours ``key_index``
    (a shared-prompt batch's), so that no branch of a pair silently attends to the other."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in KEY_INDEX_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation {implementation!r} ignores a shared-prompt batch's key_index, so the rejected answer "
            f"would attend to the chosen one; load the model with one of {', '.join(KEY_INDEX_IMPLEMENTATIONS)} "
            "(attn_implementation_for('auto') picks the best here)"
        )


@lru_cache(maxsize=1)
def _torch_varlen_takes_gqa() -> bool:
    """Whether this torch's varlen_attn has ``enable_gqa`` (later releases require it for GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    backend: str = "flash_attn",
    causal: bool = True,
    softmax_scale: float | None = None,
    window_left: int = -1,
) -> torch.Tensor:
    """Attention over packed sequences: ``query`` [T, Hq, D], ``key``/``value`` [T, Hkv, D] -> [T, Hq, D].

    ``cu_seqlens_*`` are int32 [n + 1]; ``backend`` is ``flash_attn`` or ``torch_varlen``.
    ``window_left`` >= 0 limits each query to that many earlier keys (sliding window).
    """
    window = (window_left, 0 if causal else -1)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, window_size=window,
        )
    if backend == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        extra: dict[str, Any] = {}
        if key.shape[1] != query.shape[1]:
            if _torch_varlen_takes_gqa():
                extra["enable_gqa"] = True
            else:
                groups = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # varlen_attn reads causality from the window: (-1, 0) is causal, (-1, -1) full.
        out = varlen_attn(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scale=softmax_scale, window_size=window, **extra,
        )
        return cast(torch.Tensor, out)  # a tuple only with return_aux
    raise ValueError(f"varlen_attention runs flash_attn or torch_varlen, not {backend!r}")


def _half_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype to run the FA2 kernels in: the tensor's if half, else the autocast or bf16 dtype."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.dtype
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return torch.bfloat16


def varlen_attention_forward(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    key_index: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface``) on the varlen kernel of ``backend``.

    ``query`` is [B, Hq, S, D] and the result [B, S, Hq, D], as transformers expects. Example
    boundaries come from ``cu_seq_lens_q/k`` and ``max_length_q/k`` (a PackedIterableDataset
    batch, or ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``); without them each
    of the B rows is one whole sequence. transformers builds no attention mask for this
    implementation, so padded batches are not supported: feed packed ones. With ``key_index`` (a
    shared-prompt batch) K and V are gathered with it first, and ``cu_seq_lens_k`` bounds the gathered keys.
    """
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATIONS[backend]} does not do attention dropout (got {dropout}); set attention_dropout=0")
    if softcap is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATIONS[backend]} does not support attention logit softcapping; use flash_attention_2 or eager")
    batch, heads, seq_len, head_dim = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * seq_len
        max_length_q = seq_len
    if cu_seq_lens_k is None:
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if key_index is not None:
        key, value = gather_keys(key, key_index), gather_keys(value, key_index)
    causal = cast(bool, module.is_causal) if is_causal is None else is_causal
    assert max_length_q is not None and max_length_k is not None  # transformers passes them with cu_seq_lens_q/k
    dtype = _half_dtype(query)

    def tokens_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], head_dim).to(dtype)

    out = varlen_attention(
        tokens_first(query), tokens_first(key), tokens_first(value),
        cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_length_q), int(max_length_k),
        backend=backend,
        causal=causal,
        softmax_scale=scaling,
        window_left=sliding_window - 1 if sliding_window else -1,
    )
    return out.view(batch, seq_len, heads, head_dim), None


def gather_keys(states: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """Keys or values [1, H, T, D] of a packed batch -> [1, H, len(key_index), D], those of the tokens ``key_index`` names."""
    if states.shape[0] != 1:
        raise ValueError(f"key_index applies to one packed row of tokens ([1, T]), got a batch of {states.shape[0]} rows")
    return states.index_select(2, key_index.to(states.device))


def register_varlen_attention(backend: str = "torch_varlen") -> str:
    """Register ``backend``'s varlen attention with transformers; returns its implementation name.

    Only the attention function is registered, not a mask function: transformers then skips
    building a mask (and its host sync) and passes ``cu_seq_lens_*`` straight through.
    """
    from transformers import AttentionInterface

    name = ATTN_IMPLEMENTATIONS[backend]
    AttentionInterface.register(name, partial(varlen_attention_forward, backend))
    return name


def _example_bounds(query: torch.Tensor, cu_seq_lens: torch.Tensor | None) -> list[int]:
    """The example boundaries over all B * S tokens of ``query`` [B, H, S, D]: ``cu_seq_lens``, or one per row."""
    batch, _, seq_len, _ = query.shape
    bounds = list(range(0, batch * seq_len + 1, seq_len)) if cu_seq_lens is None else cu_seq_lens.tolist()
    if bounds[0] != 0 or bounds[-1] != batch * seq_len:
        raise ValueError(f"cu_seq_lens must run from 0 to the batch's {batch * seq_len} tokens, got {bounds[0]}..{bounds[-1]}")
    return bounds


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [1, H, B * S, D]: the rows of a batch laid end to end."""
    batch, heads, seq_len, head_dim = x.shape
    return x.transpose(0, 1).reshape(1, heads, batch * seq_len, head_dim)


def segment_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function running sdpa on each packed example in turn.

    ``query`` is [B, Hq, S, D], ``key``/``value`` [B, Hkv, S, D], the result [B, S, Hq, D]. Each
    example (from ``cu_seq_lens_q``; without it, each of the B rows) is attended causally on its
    own with no mask, so sdpa's memory-efficient kernels apply and the largest buffer grows with
    the longest example's length, where a packed mask grows with the square of the batch's tokens.
    A Python loop over examples: its cost per example is small beside the attention itself on CPU.

    With ``key_index`` (a shared-prompt batch) example ``i`` attends to the keys ``key_index`` names between
    ``cu_seq_lens_k[i]`` and ``cu_seq_lens_k[i + 1]``, under a causal mask aligned at the bottom right (the last
    query sees every key): the exact reference of the varlen kernels' shared-prompt attention.
    """
    if softcap is not None:
        raise ValueError(f"{SEGMENTS_IMPLEMENTATION} does not support attention logit softcapping; use eager")
    batch, heads, seq_len, head_dim = query.shape
    bounds = _example_bounds(query, cu_seq_lens_q)
    causal = cast(bool, module.is_causal) if is_causal is None else is_causal
    q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
    key_bounds = bounds
    if key_index is not None:
        if cu_seq_lens_k is None:
            raise ValueError("key_index needs cu_seq_lens_k, the bounds of each example's gathered keys")
        k, v = gather_keys(k, key_index), gather_keys(v, key_index)
        key_bounds = cu_seq_lens_k.tolist()
    outputs = []
    for start, end, key_start, key_end in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        if end == start:
            continue
        # Causal aligned at the bottom right: query i sees keys up to i + (keys - queries).
        shift = (key_end - key_start) - (end - start)
        mask = None
        if causal and (sliding_window or shift):
            mask = torch.ones(end - start, key_end - key_start, dtype=torch.bool, device=q.device).tril(shift)
            if sliding_window:
                mask = mask.triu(shift + 1 - sliding_window)
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, key_start:key_end], v[:, :, key_start:key_end], attn_mask=mask,
                dropout_p=dropout, is_causal=causal and mask is None, scale=scaling, enable_gqa=k.shape[1] != q.shape[1],
            )
        )
    out = torch.cat(outputs, dim=2).view(heads, batch, seq_len, head_dim)
    return out.permute(1, 2, 0, 3).contiguous(), None


def register_segment_attention() -> str:
    """Register the per-example sdpa backend with transformers; returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENTS_IMPLEMENTATION, segment_attention_forward)
    return SEGMENTS_IMPLEMENTATION
