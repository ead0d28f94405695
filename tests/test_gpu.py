"""On the GPU: a packed batch through FA2 varlen equals each example run alone, and the two
varlen backends (flash-attn and torch's varlen_attn) agree. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loaders.train.attention import VARLEN_IMPLEMENTATION, attn_implementation_for, available_backends, varlen_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

VOCAB = 1024
# bf16 tolerances, relative to the reference's largest magnitude (logits) or norm (gradients).
LOGITS_RTOL = 2e-2
LOSS_RTOL = 1e-2
GRAD_RTOL = 3e-2


def requires(backend: str):
    return pytest.mark.skipif(backend not in available_backends(), reason=f"{backend} is not available here")


def on_gpu(batch: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """FLAN-shaped examples (lognormal lengths) packed into 512-token rows."""
    from shard_factory import build_shard_dir

    lengths = np.clip(np.random.default_rng(3).lognormal(4.5, 0.9, 60), 16, 600).astype(np.int64)
    return build_shard_dir(tmp_path_factory.mktemp("shards"), lengths, capacity=512, vocab_size=VOCAB, seed=3).path


@pytest.fixture(scope="module")
def packed_batch(shard_dir) -> dict:
    """One loader batch of two rows, on the GPU."""
    from loaders import PackedIterableDataset

    batch = next(iter(PackedIterableDataset(shard_dir, batch_rows=2, shuffle=False)))
    assert batch["cu_seq_lens_q"].numel() > 3, "want several examples in the packed row"
    return on_gpu(batch)


def tiny_llama(attn_implementation: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.config._attn_implementation = attn_implementation
    return model


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropies over labelled positions (labels unshifted, -100 ignored)."""
    return torch.nn.functional.cross_entropy(
        logits[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum"
    )


def packed_forward_backward(model, batch: dict, with_boundaries: bool = True):
    """Logits, summed loss and gradients of one packed batch (``with_boundaries=False``: the
    naive concatenation, one long sequence, for a negative control)."""
    model.zero_grad(set_to_none=True)
    if with_boundaries:
        kwargs = {k: batch[k] for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    else:
        kwargs = {"position_ids": torch.arange(batch["input_ids"].shape[1], device="cuda")[None]}
    logits = model(input_ids=batch["input_ids"], **kwargs).logits
    loss = summed_loss(logits, batch["labels"])
    loss.backward()
    return logits.detach().float(), loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def unpacked_forward_backward(model, batch: dict):
    """The same, running each example of the batch alone and accumulating."""
    model.zero_grad(set_to_none=True)
    cu = batch["cu_seq_lens_q"].tolist()
    logits, total = [], 0.0
    for start, end in zip(cu[:-1], cu[1:]):
        if end == start:
            continue
        ids = batch["input_ids"][:, start:end]
        out = model(input_ids=ids, position_ids=torch.arange(end - start, device="cuda")[None]).logits
        loss = summed_loss(out, batch["labels"][:, start:end])
        loss.backward()
        logits.append(out.detach().float())
        total += loss.item()
    return torch.cat(logits, dim=1), total, {n: p.grad.float() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rtol: float) -> None:
    for name, ref in want.items():
        err = (got[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative gradient error {err:.3g} > {rtol}"


@pytest.mark.parametrize("backend", [
    pytest.param("flash_attn", marks=requires("flash_attn")),
    pytest.param("torch_varlen", marks=requires("torch_varlen")),
    pytest.param("flash_attention_2", marks=requires("flash_attn")),  # transformers' own FA2 glue
])
def test_packed_equals_unpacked(packed_batch, backend):
    model = tiny_llama(attn_implementation_for(backend))
    logits, loss, grads = packed_forward_backward(model, packed_batch)
    ref_logits, ref_loss, ref_grads = unpacked_forward_backward(model, packed_batch)
    real = int(packed_batch["cu_seq_lens_q"][-1])
    logits = logits[:, :real]

    scale = ref_logits.abs().max()
    print(f"{backend}: logits max diff {(logits - ref_logits).abs().max():.3g} (scale {scale:.3g}), "
          f"loss {loss.item():.6g} vs {ref_loss:.6g}")
    assert (logits - ref_logits).abs().max() <= LOGITS_RTOL * scale
    assert loss.item() == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert_grads_close(grads, ref_grads, GRAD_RTOL)

    # The check has teeth: concatenated without boundaries, later examples attend across, far out of tolerance.
    leaky, _, _ = packed_forward_backward(model, packed_batch, with_boundaries=False)
    assert (leaky[:, :real] - ref_logits).abs().max() > 2 * LOGITS_RTOL * scale


@requires("flash_attn")
@requires("torch_varlen")
def test_backends_agree_on_kernel(packed_batch):
    cu = packed_batch["cu_seq_lens_q"]
    total, max_len = int(cu[-1]), packed_batch["max_length_q"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for backend in ("flash_attn", "torch_varlen"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*inputs, cu, cu, max_len, max_len, backend=backend, causal=True)
        out.backward(grad_out)
        results[backend] = [out.float(), *(t.grad.float() for t in inputs)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["flash_attn"], results["torch_varlen"]):
        diff = (a - b).abs().max().item()
        print(f"kernel {name}: max diff {diff:.3g}")
        assert diff <= 2e-2 * b.abs().max().item(), name


@requires("flash_attn")
@requires("torch_varlen")
def test_backends_agree_on_model(packed_batch):
    flash_logits, flash_loss, flash_grads = packed_forward_backward(tiny_llama(attn_implementation_for("flash_attn")), packed_batch)
    torch_logits, torch_loss, torch_grads = packed_forward_backward(tiny_llama(VARLEN_IMPLEMENTATION), packed_batch)
    print(f"model: logits max diff {(flash_logits - torch_logits).abs().max():.3g}, loss {flash_loss:.6g} vs {torch_loss:.6g}")
    assert (flash_logits - torch_logits).abs().max() <= LOGITS_RTOL * torch_logits.abs().max()
    assert flash_loss.item() == pytest.approx(torch_loss.item(), rel=LOSS_RTOL)
    assert_grads_close(flash_grads, torch_grads, GRAD_RTOL)


@requires("flash_attn")
def test_fixed_shape_batch_trains_like_the_plain_one(shard_dir, packed_batch):
    """pad_to_fixed_shape adds pad chunks and repeated cu_seqlens: the real tokens' logits and the
    gradients are those of the unpadded batch (the pad trains nothing and leaks nowhere)."""
    from loaders import PackedIterableDataset

    fixed = on_gpu(next(iter(PackedIterableDataset(shard_dir, batch_rows=2, shuffle=False, pad_to_fixed_shape=True))))
    real = packed_batch["input_ids"].shape[1]
    assert fixed["input_ids"].shape[1] == 2 * 512 and fixed["max_length_q"] == 512
    assert torch.equal(fixed["input_ids"][:, :real], packed_batch["input_ids"])
    model = tiny_llama(attn_implementation_for("flash_attn"))
    logits, loss, grads = packed_forward_backward(model, fixed)
    ref_logits, ref_loss, ref_grads = packed_forward_backward(model, packed_batch)
    assert (logits[:, :real] - ref_logits).abs().max() <= LOGITS_RTOL * ref_logits.abs().max()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=LOSS_RTOL)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert_grads_close(grads, ref_grads, GRAD_RTOL)


@requires("flash_attn")
def test_loss_position_head_matches_full_logits_on_gpu(packed_batch):
    """bf16 on the GPU: the loss-position head's loss and gradients are the full LM head's."""
    import copy

    from loaders.collate import COUNT_KEYS
    from loaders.train.loss_head import use_loss_position_head

    full = tiny_llama(attn_implementation_for("flash_attn"))
    head = use_loss_position_head(copy.deepcopy(full))
    results = []
    for model, batch in ((full, {k: v for k, v in packed_batch.items() if k not in COUNT_KEYS}), (head, packed_batch)):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    assert_grads_close(got_grads, want_grads, GRAD_RTOL)


@requires("flash_attn")
def test_activation_memory_budget_saves_less_and_trains_the_same(packed_batch):
    """Compiled layers under ``activation_memory_budget=0.5`` keep fewer bytes for backward than
    with the whole budget, with the same loss and gradients (what is dropped is recomputed)."""
    from loaders.collate import COUNT_KEYS
    from loaders.train.models import compile_layers

    batch = {k: v for k, v in packed_batch.items() if k not in COUNT_KEYS}
    results = []
    for budget in (1.0, 0.5):
        torch._dynamo.reset()
        model = tiny_llama(attn_implementation_for("flash_attn"))
        compile_layers(model, activation_memory_budget=budget)
        saved: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        try:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                loss = model(**batch).loss
            loss.backward()
        finally:
            torch._functorch.config.activation_memory_budget = 1.0
        results.append((sum(saved.values()), loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (whole_bytes, whole_loss, whole_grads), (budget_bytes, budget_loss, budget_grads) = results
    assert budget_bytes < whole_bytes
    assert budget_loss == pytest.approx(whole_loss, rel=LOSS_RTOL)
    assert_grads_close(budget_grads, whole_grads, GRAD_RTOL)
