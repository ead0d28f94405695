"""Attention backend selection and registration, on any machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loaders.train import attention
from loaders.train.attention import VARLEN_IMPLEMENTATION, attn_implementation_for, best_attn_implementation, register_varlen_attention


def test_import_does_not_pull_in_transformers():
    code = "import sys, loaders.train.attention; assert 'transformers' not in sys.modules, 'imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_falls_back_to_per_example_sdpa():
    assert attention.available_backends() == ["sdpa_segments", "sdpa"]
    assert best_attn_implementation() == attention.SEGMENTS_IMPLEMENTATION
    assert attn_implementation_for("auto") == attention.SEGMENTS_IMPLEMENTATION
    assert attn_implementation_for("sdpa") == "sdpa"
    with pytest.raises(RuntimeError, match="not available"):
        attn_implementation_for("flash_attn")


class CausalModule(torch.nn.Module):
    is_causal = True


def largest_allocation(fn) -> int:
    """The largest CPU allocation, in bytes, that any operation of ``fn`` makes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_per_example_sdpa_memory_does_not_grow_with_the_square_of_the_batch():
    """16 examples of 256 tokens: no buffer of T x T (or T x T / 16) entries, where a packed mask needs T x T."""
    tokens, heads, head_dim = 4096, 2, 16
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, heads, tokens, head_dim) for _ in range(3))
    cu = torch.arange(0, tokens + 1, 256, dtype=torch.int32)
    got, _ = attention.segment_attention_forward(CausalModule(), query, key, value, None, cu_seq_lens_q=cu)
    assert largest_allocation(
        lambda: attention.segment_attention_forward(CausalModule(), query, key, value, None, cu_seq_lens_q=cu)
    ) < tokens * tokens // 16
    mask = torch.block_diag(*[torch.ones(256, 256, dtype=torch.bool).tril()] * 16)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert largest_allocation(
        lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    ) >= tokens * tokens
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-5)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        attn_implementation_for("xformers")


def test_transformers_implementations_pass_through():
    assert attn_implementation_for("flash_attention_2") == "flash_attention_2"
    assert attn_implementation_for("eager") == "eager"


def test_registered_implementation_loads_with_from_config():
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    assert register_varlen_attention() == VARLEN_IMPLEMENTATION
    assert AttentionInterface._global_mapping[VARLEN_IMPLEMENTATION].func is attention.varlen_attention_forward
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM._from_config(config, attn_implementation=VARLEN_IMPLEMENTATION)
    assert model.config._attn_implementation == VARLEN_IMPLEMENTATION


def segment_sdpa(query, key, value, cu_q, cu_k, max_q, max_k, *, backend, causal, softmax_scale, window_left):
    """A CPU stand-in for the varlen kernels: sdpa over each segment."""
    assert backend == "torch_varlen" and window_left == -1
    out = torch.empty_like(query)
    bounds = cu_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True
        ).transpose(0, 1)
    return out


def test_registered_function_keeps_examples_apart(monkeypatch):
    """The transformers adapter hands the kernel the right layout and boundaries: a packed
    forward through it equals sdpa's packed forward (which finds boundaries from position_ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(attention, "varlen_attention", segment_sdpa)
    register_varlen_attention()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    lengths = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    input_ids = torch.randint(64, (1, 17))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        want = model(input_ids=input_ids, position_ids=position_ids).logits.float()
        model.config._attn_implementation = VARLEN_IMPLEMENTATION
        got = model(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=9, max_length_k=9).logits.float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_registered_names_avoid_transformers_kernel_lookup():
    """transformers treats any implementation name containing "flash" as a Hub kernel to fetch."""
    assert all("flash" not in name for name in attention.ATTN_IMPLEMENTATIONS.values())
