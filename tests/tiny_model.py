"""The tiny random Llama the CPU tests train and compare: 2 layers, hidden size 32, no cache."""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int, max_positions: int, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A seeded random ``LlamaForCausalLM``; ``use_cache`` is off, since with a cache sdpa ignores the packing."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, attn_implementation=attn_implementation,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)
