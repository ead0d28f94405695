"""The loss-position LM head gives the loss and gradients of the full computation (CPU, fp32).

``use_loss_position_head`` computes logits only where a label is not -100, in chunks; the loss
and every parameter's gradient must equal ``model(**batch).loss`` with all logits, on packed
loader batches and on ordinary padded ones, for several architectures (untied and tied heads).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.collate import COUNT_KEYS
from loaders.train import loss_head
from loaders.train.loss_head import PADDED_LOSS_ROWS, linear_cross_entropy, loss_positions, use_loss_position_head

transformers = pytest.importorskip("transformers")

VOCAB = 300
RTOL = 1e-5


@pytest.fixture(scope="module")
def packed_batch(tmp_path_factory) -> dict:
    lengths = np.random.default_rng(5).integers(4, 60, 80)
    shards = build_shard_dir(tmp_path_factory.mktemp("loss-head"), lengths, capacity=128, vocab_size=VOCAB, seed=5)
    batch = next(iter(PackedIterableDataset(shards.path, batch_rows=2, shuffle=False)))
    assert batch["num_loss_tokens"] < batch["num_real_tokens"], "want prompt tokens without a loss"
    return batch


def tiny_model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, attn_implementation="sdpa")
    elif kind == "qwen2-tied":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, attn_implementation="sdpa")
    elif kind == "gpt2":
        # No dropout: the comparison runs the model twice.
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    return model.train()


def loss_and_grads(model: torch.nn.Module, batch: dict, **extra) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **extra).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    assert got[0] == pytest.approx(want[0], rel=RTOL)
    assert got[1].keys() == want[1].keys()
    for name, ref in want[1].items():
        err = ((got[1][name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: relative gradient error {err:.3g}"


def padded_batch() -> dict:
    """Two right-padded rows with a prompt of -100 labels and an attention mask."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :9] = -100
    labels[1, :4] = -100
    labels[1, 17:] = -100
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("chunk_rows", [5, 4096])
def test_linear_cross_entropy_equals_the_full_logits(chunk_rows):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    grad_scale = torch.tensor(0.37, dtype=torch.float64)

    want = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="sum")
    want_grads = torch.autograd.grad(want * grad_scale, (hidden, weight, bias))
    got = linear_cross_entropy(hidden, weight, targets, bias, chunk_rows=chunk_rows)
    got_grads = torch.autograd.grad(got * grad_scale, (hidden, weight, bias))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.to(w.dtype), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_gradient_formula_is_the_in_place_one(dtype, weighted):
    """The formula CUDA compiles into fused kernels gives the eager path's losses and gradients (here run eagerly)."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 70, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 70, (9,), generator=gen)
    weights = torch.rand(9, generator=gen) if weighted else None
    want_ce, want_grad = loss_head._cross_entropy_and_grad_eager(logits.clone(), targets, weights)
    got_ce, got_grad = loss_head._cross_entropy_and_grad_fused(logits, targets, weights)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_ce, want_ce)
    torch.testing.assert_close(got_grad, want_grad.to(dtype))
    assert (got_grad.float().sum(1).abs() < 1e-2).all(), "each row's softmax - one_hot sums to 0"



def fused_on_cpu(monkeypatch) -> None:
    """Run the head's fused path (compiled kernels, CUDA's default) on the CPU, from a fresh compile."""
    monkeypatch.setattr(loss_head, "_fuse", lambda tensor: True)
    monkeypatch.setattr(loss_head, "_FUSION_FAILED", [])
    loss_head._compiled.cache_clear()
    torch._dynamo.reset()


def head_loss_and_grads(chunk_rows: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(300, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(500, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 500, (300,), generator=gen)
    row_weights = torch.rand(300, generator=gen)
    loss = loss_head._linear_cross_entropy(hidden, weight, targets, None, chunk_rows, row_weights, keep_rows=True)
    (loss[0] * 0.25).backward()
    return loss[0].detach(), loss[1], hidden.grad, weight.grad


def test_the_compiled_head_equals_the_eager_one(monkeypatch):
    """The fused kernels, compiled for real (here by the CPU's inductor), over chunks of 128, 128 and 44 rows (one
    kernel for every row count), give the eager path's loss, per-row losses and gradients."""
    eager = head_loss_and_grads(128)
    fused_on_cpu(monkeypatch)
    fused = head_loss_and_grads(128)
    assert not loss_head._FUSION_FAILED
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(fused[1], eager[1])
    torch.testing.assert_close(fused[2], eager[2], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(fused[3], eager[3], rtol=2e-2, atol=1e-3)


def test_a_head_whose_kernels_cannot_compile_trains_eagerly_with_a_warning(monkeypatch):
    """Without a working compiler for the fused kernels the head warns once and computes the same loss eagerly."""
    eager = head_loss_and_grads(128)
    fused_on_cpu(monkeypatch)
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("varpack-no-such-compiler",))
    with pytest.warns(UserWarning, match="fused kernels did not compile"):
        got = head_loss_and_grads(128)
    assert loss_head._FUSION_FAILED
    for g, w in zip(got, eager):
        torch.testing.assert_close(g, w)



def test_evaluation_under_no_grad_computes_no_head_gradients(monkeypatch):
    """Under torch.no_grad the head computes the loss only, though its weight requires gradients (a model being
    trained, evaluated between steps): the same loss, no gradient kernel run."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = torch.randn(60, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 60, (40,), generator=gen)
    want = linear_cross_entropy(hidden, weight, targets, chunk_rows=16).detach()
    calls = []
    monkeypatch.setattr(loss_head, "_cross_entropy_and_grad", lambda *args: calls.append(1))
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, targets, chunk_rows=16)
    assert not calls and not got.requires_grad
    torch.testing.assert_close(got, want)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_head_on_the_gpu_equals_the_eager_one(monkeypatch, weighted):
    """bf16 on CUDA: the compiled log-softmax and the fp32 accumulation inside each chunk's product give the
    eager path's loss and gradients, over chunks of different sizes; and both are the fp64 computation's."""
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(2500, 256, generator=gen) * 0.5).to("cuda", torch.bfloat16)
    weight = (torch.randn(5003, 256, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    targets = torch.randint(0, 5003, (2500,), generator=gen).cuda()
    row_weights = torch.rand(2500, generator=gen).cuda() if weighted else None

    def run() -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_head._linear_cross_entropy(h, w, targets, None, 700, row_weights, keep_rows=True)
        (loss[0] * 0.01).backward()
        return loss[0].detach(), loss[1], h.grad, w.grad

    fused = run()
    monkeypatch.setattr(loss_head, "_fuse", lambda tensor: False)
    monkeypatch.setattr(loss_head, "add_product", lambda total, a, b: total.add_(a @ b))
    eager = run()
    logits = hidden.double() @ weight.double().T
    ce = torch.logsumexp(logits, -1) - logits.gather(1, targets[:, None]).squeeze(1)
    want_loss = (ce if row_weights is None else ce * row_weights).sum()
    for got in (fused, eager):
        assert got[0].item() == pytest.approx(want_loss.item(), rel=1e-3)
        torch.testing.assert_close(got[1].double(), ce, rtol=0, atol=0.05)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(fused[1], eager[1], rtol=0, atol=1e-4)
    torch.testing.assert_close(fused[2].float(), eager[2].float(), rtol=2e-2, atol=1e-5)
    # The eager path rounds each chunk's product to bf16 before adding: the fused one is nearer the fp64 sum.
    grad = torch.softmax(logits, -1)
    grad[torch.arange(2500), targets] -= 1
    if row_weights is not None:
        grad *= row_weights[:, None].double()
    want_weight = 0.01 * grad.T @ hidden.double()
    errors = [((got[3].double() - want_weight).norm() / want_weight.norm()).item() for got in (fused, eager)]
    assert errors[0] < 1e-2 and errors[0] <= errors[1] * 1.05, errors


@pytest.mark.gpu
@needs_gpu
def test_add_product_accumulates_in_fp32_on_the_gpu():
    """``add_product`` adds bf16 products into an fp32 total without rounding each product to bf16."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(512, 300, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(300, 384, generator=gen).to("cuda", torch.bfloat16)
    total = torch.randn(512, 384, generator=gen).cuda() * 1e3
    want = total.double() + a.double() @ b.double()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as a model's forward runs the head
        loss_head.add_product(total, a, b)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total.double(), want, rtol=1e-6, atol=1e-3)


def test_loss_positions_are_the_shifted_labels():
    labels = torch.tensor([[-100, 5, 7, -100], [-100, -100, 9, 2]])
    index, targets = loss_positions(labels)
    assert index.tolist() == [0, 1, 4, 5] and targets.tolist() == [5, 7, 9, 2]  # rows of 3 predicting positions
    index_known, targets_known = loss_positions(labels, 4)
    assert torch.equal(index, index_known) and torch.equal(targets, targets_known)


@pytest.mark.parametrize("kind", ["llama", "qwen2-tied", "gpt2"])
def test_model_loss_and_grads_equal_the_full_logits(kind):
    full = tiny_model(kind)
    head = use_loss_position_head(copy.deepcopy(full), chunk_rows=7)
    batch = padded_batch()
    assert_same(loss_and_grads(head, batch), loss_and_grads(full, batch))
    # As the HF Trainer calls it, with the step's count of trained tokens.
    assert_same(loss_and_grads(head, batch, num_items_in_batch=torch.tensor(40)),
                loss_and_grads(full, batch, num_items_in_batch=torch.tensor(40)))
    out = head(**batch)
    assert out.logits is None and out.loss is not None
    # Without labels, the model runs as before.
    with torch.no_grad():
        plain = {k: batch[k] for k in ("input_ids", "attention_mask")}
        torch.testing.assert_close(head(**plain).logits, full(**plain).logits)


def test_packed_batch_with_counts(packed_batch):
    full = tiny_model("llama")
    head = use_loss_position_head(copy.deepcopy(full))
    plain = {k: v for k, v in packed_batch.items() if k not in COUNT_KEYS}
    # The head takes the loader's batch as it is: it consumes the counts itself.
    assert_same(loss_and_grads(head, packed_batch), loss_and_grads(full, plain))


@pytest.mark.parametrize("extra_rows", [0, 1, 200])
def test_padded_loss_rows_change_nothing(packed_batch, extra_rows):
    """Labelled positions padded to a fixed count (for CUDA graphs) give the same loss and gradients,
    with and without the step's count of trained tokens."""
    full = tiny_model("llama")
    head = use_loss_position_head(copy.deepcopy(full))
    plain = {k: v for k, v in packed_batch.items() if k not in COUNT_KEYS}
    rows = packed_batch["num_loss_tokens"] + extra_rows
    padded = {**plain, PADDED_LOSS_ROWS: rows}
    assert_same(loss_and_grads(head, padded), loss_and_grads(full, plain))
    count = torch.tensor(float(packed_batch["num_loss_tokens"] + 17))
    assert_same(loss_and_grads(head, padded, num_items_in_batch=count), loss_and_grads(full, plain, num_items_in_batch=count))


def test_the_check_has_teeth(packed_batch):
    """A head that trained on one position fewer, or on the unshifted labels, would be caught."""
    full = tiny_model("llama")
    plain = {k: v for k, v in packed_batch.items() if k not in COUNT_KEYS}
    want = loss_and_grads(full, plain)
    fewer = dict(plain, labels=plain["labels"].clone())
    fewer["labels"][0, int(fewer["labels"][0].ne(-100).nonzero()[-1])] = -100
    with pytest.raises(AssertionError):
        assert_same(loss_and_grads(use_loss_position_head(copy.deepcopy(full)), fewer), want)


def test_logit_modifiers_are_refused():
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        use_loss_position_head(model)
    recurrent = transformers.RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2, lru_width=32,
                                                  attention_window_size=16, logits_soft_cap=1.0)  # a cap, not a scale
    with pytest.raises(ValueError, match="logits_soft_cap"):
        use_loss_position_head(transformers.AutoModelForCausalLM.from_config(recurrent))


def test_an_lm_head_inside_a_prediction_head_is_refused():
    """BERT's LM head applies a dense layer, an activation and a norm before its output Linear: logits are not that
    Linear of the hidden states, so neither training's head nor packed evaluation may take the shortcut."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, is_decoder=True)
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(ValueError, match="the LM head sits inside another module"):
        use_loss_position_head(model)
