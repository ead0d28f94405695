"""One matrix product for q, k and v, and one for gate and up, in every Llama-style decoder layer.

``fuse_projections(model)`` concatenates each attention's ``q_proj``, ``k_proj`` and ``v_proj``
weights into one ``qkv_proj`` and each MLP's ``gate_proj`` and ``up_proj`` into one
``gate_up_proj``, in place: the same function of the same weights, computed with two matrix
products fewer per layer (wider ones, so the GPU's tensor cores stay busier on small models).
Call it before building the optimizer and before ``compile_layers``. The fused parameters are
new tensors: a checkpoint of the fused model has ``qkv_proj`` and ``gate_up_proj`` keys.

For a layer with 4 query heads and 2 key/value heads of size 8 on a hidden size of 32,
``qkv_proj`` is a ``Linear(32, 64)``: rows 0-31 are ``q_proj``'s, 32-47 ``k_proj``'s and
48-63 ``v_proj``'s; its output splits back into q, k and v along the last dimension.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """LlamaAttention.forward over ``qkv_proj``, for training (no KV cache)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query = query.view(hidden_shape).transpose(1, 2)
    key = key.view(hidden_shape).transpose(1, 2)
    value = value.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    implementation = self.config._attn_implementation
    attention = eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward over ``gate_up_proj``."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every decoder layer of ``model`` in place; the number of layers fused.

    Raises ValueError when the model has no Llama-style layer (``self_attn.q_proj`` and
    ``mlp.gate_proj``) to fuse.
    """
    fused = 0
    for module in model.modules():
        attention, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        if not (hasattr(attention, "q_proj") and hasattr(mlp, "gate_proj")):
            continue
        assert attention is not None and mlp is not None
        parts = [attention.q_proj, attention.k_proj, attention.v_proj]
        attention.qkv_proj = _fused_linear(parts)
        attention.qkv_sizes = [p.out_features for p in parts]
        del attention.q_proj, attention.k_proj, attention.v_proj
        attention.forward = types.MethodType(_attention_forward, attention)
        mlp.gate_up_proj = _fused_linear([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        mlp.forward = types.MethodType(_mlp_forward, mlp)
        fused += 1
    if not fused:
        raise ValueError(f"{type(model).__name__} has no Llama-style decoder layer (self_attn.q_proj, mlp.gate_proj) to fuse")
    return fused
