"""Logits only where there is a loss: the LM head and cross-entropy over the labelled positions.

SFT batches train on a fraction of their tokens (about 1 in 5 for FLAN-shaped data), yet a
causal LM computes ``[tokens, vocab]`` logits for all of them and upcasts them to fp32 for the
loss. Here the hidden states of the positions whose next-token label is not -100 are gathered
first, and the LM head and cross-entropy run over them in chunks of rows, each chunk's
gradients computed at once, so no ``[tokens, vocab]`` tensor is ever held. Loss and gradients
are those of ``model(**batch).loss``; only the unused logits are not computed::

    model = use_loss_position_head(AutoModelForCausalLM.from_pretrained(name))
    model(**batch).loss.backward()        # a plain loop, or Trainer(model=model, ...)

For example, with labels ``[-100, 5, 7, -100 | -100, 9]`` (two packed examples) the targets are
positions 0, 1 and 4 predicting 5, 7 and 9: three rows go through the LM head, not six.

Asked with ``sequence_losses=True`` (``SEQUENCE_LOSSES``), the output also holds each packed
sequence's summed token loss and loss tokens, from the same cross-entropy and without a host
sync: a mixture's loss per source (``loaders.train.source_loss``). The loss and its gradients
are the same either way.

Asked with ``sequence_log_probs=True`` (``SEQUENCE_LOG_PROBS``), the output holds each packed
sequence's summed log-probability of its labels and its label count, ``[2, n]``, with gradients (the LM
head recomputed chunk by chunk in backward): the per-sequence sums preference losses take
(``loaders.train.preference``).

Imports only torch at module import; transformers is imported inside the functions that need it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, cast

import torch

from loaders.collate import IGNORE_INDEX, NUM_LOSS_TOKENS, NUM_REAL_TOKENS
from loaders.loss_weights import LOSS_WEIGHT_SUM, LOSS_WEIGHTS

# Logits per chunk (rows x vocab): 2**27 is 512 MiB in fp32, about 4k rows of a 32k vocabulary.
CHUNK_LOGITS = 2**27
# A keyword the head takes besides a batch's: pad the labelled positions to this many rows (CUDA graphs).
PADDED_LOSS_ROWS = "padded_loss_rows"
# A keyword the head takes besides a batch's: also return each packed sequence's loss (``sequence_losses``).
SEQUENCE_LOSSES = "sequence_losses"
# A keyword the head takes besides a batch's: return each packed sequence's summed label log-probability, with gradients.
SEQUENCE_LOG_PROBS = "sequence_log_probs"
# Config attributes that change logits after the LM head's matmul; such models need their own head.
LOGIT_MODIFIERS = ("final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling", "output_logits_scaling")
LOGIT_CAPS = ("final_logit_softcapping", "logits_soft_cap")


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy of ``logits`` [n, V] against ``targets`` [n], in fp32."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None]).squeeze(1)


def _cross_entropy_and_grad_eager(logits: torch.Tensor, targets: torch.Tensor,
                                  row_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy (fp32) and d(sum of CE times ``row_weights``)/d(logits) in fp32, through one fp32
    copy of ``logits`` worked on in place."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, targets[:, None]).squeeze(1)
    # d(CE)/d(logits) = softmax - one_hot.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], torch.full_like(grad[:, :1], -1.0))
    if row_weights is not None:
        grad.mul_(row_weights[:, None])
    return ce, grad


def _cross_entropy_and_grad_fused(logits: torch.Tensor, targets: torch.Tensor,
                                  row_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``_cross_entropy_and_grad_eager`` written as one reduction and one element-wise map, which torch.compile
    fuses into two kernels that read ``logits`` in their own dtype and write the gradient in it (no fp32 copy)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, targets[:, None]).squeeze(1)
    softmax = torch.exp(x - lse[:, None])
    hit = torch.arange(x.shape[1], device=x.device) == targets[:, None]
    grad = torch.where(hit, softmax - 1.0, softmax)
    if row_weights is not None:
        grad = grad * row_weights[:, None]
    return ce, grad.to(logits.dtype)


def _scaled_eager(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (tensor.float() * scale).to(dtype)


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=None)


# Set when the fused kernels failed to compile (no C compiler for Triton's launcher, say): eager from then on.
_FUSION_FAILED: list[str] = []


def _fuse(tensor: torch.Tensor) -> bool:
    """Whether work on ``tensor`` runs as compiled, fused kernels: on CUDA with Triton, outside a region already
    being compiled (where the outer compile fuses it), unless they failed to compile before."""
    from torch.utils._triton import has_triton

    return tensor.is_cuda and not _FUSION_FAILED and not torch.compiler.is_compiling() and has_triton()


def _run_fused(fn: Callable[..., Any], eager: Callable[..., Any], *args: Any) -> Any:
    """``fn`` compiled, on ``args``; if it cannot be compiled, ``eager`` on them, with one warning for the process."""
    try:
        return _compiled(fn)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        import warnings

        _FUSION_FAILED.append(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
        warnings.warn(f"varpack: the loss-position head's fused kernels did not compile ({_FUSION_FAILED[0]}); "
                      "it runs its eager kernels instead, the same loss at more memory and time", stacklevel=2)
        return eager(*args)


def _cross_entropy_and_grad(logits: torch.Tensor, targets: torch.Tensor,
                            row_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy of ``logits`` against ``targets`` (fp32) and d(sum of CE times
    ``row_weights``)/d(logits): on CUDA in fused kernels and in the logits' dtype, else in fp32 in place."""
    if not _fuse(logits):
        return _cross_entropy_and_grad_eager(logits, targets, row_weights)
    # The rows of a chunk vary (the last chunk, each batch's labelled count): one kernel for every count.
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(targets, 0)
    if row_weights is not None:
        torch._dynamo.maybe_mark_dynamic(row_weights, 0)
    return _run_fused(_cross_entropy_and_grad_fused, _cross_entropy_and_grad_eager, logits, targets, row_weights)


def _scaled(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` times ``scale`` in fp32, as ``dtype``: on CUDA in one kernel, with no fp32 temporary."""
    if not _fuse(tensor):
        return _scaled_eager(tensor, scale, dtype)
    return _run_fused(_scaled_eager, _scaled_eager, tensor, scale, dtype)


def add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for an fp32 ``total``: on CUDA with half-precision ``a`` and ``b``, inside the product
    (cuBLAS adds into its fp32 output, as one product over every chunk would accumulate); else a product, then an
    addition."""
    if total.is_cuda and total.dtype == torch.float32 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", enabled=False):
            torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, each row times its
    ``row_weights`` when given, chunk by chunk; and, with ``keep_rows``, each row's cross-entropy
    (unweighted, fp32, without gradient; else an empty tensor).

    The forward pass computes each chunk's fp32 log-softmax and, when gradients are needed, its
    gradients for ``hidden``, ``weight`` and ``bias`` right away; backward only scales them. On CUDA the
    log-softmax and its gradient are two fused kernels over the chunk's logits (``_cross_entropy_and_grad``) and
    the weight's gradient is accumulated in fp32 inside each chunk's product (``add_product``).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                row_weights: torch.Tensor | None, chunk_rows: int, keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        rows = torch.empty(hidden.shape[0] if keep_rows else 0, device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in fp32, as one matmul over all rows would accumulate.
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_bias and bias is not None else None
        need_grad = need_hidden or need_weight or need_bias
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            t = targets[start : start + chunk_rows]
            w = None if row_weights is None else row_weights[start : start + chunk_rows].float()
            logits = torch.nn.functional.linear(h, weight, bias)
            if need_grad:
                ce, grad = _cross_entropy_and_grad(logits, t, w)
                grad = grad.to(h.dtype)
            else:
                ce = _cross_entropy(logits, t)
            total += (ce if w is None else ce * w).sum()
            if keep_rows:
                rows[start : start + chunk_rows] = ce
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_rows] = grad @ weight
            if grad_weight is not None:
                add_product(grad_weight, grad.t(), h)
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(rows)
        return total, rows

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_rows: torch.Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.float()
        return (
            None if grad_hidden is None else _scaled(grad_hidden, scale, grad_hidden.dtype),
            None if grad_weight is None else _scaled(grad_weight, scale, ctx.weight_dtype),
            None if grad_bias is None else _scaled(grad_bias, scale, ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


class _LinearLogProbs(torch.autograd.Function):
    """Each row's log-probability of its target under ``hidden @ weight.T + bias``, fp32 [N], chunk by chunk.

    Backward recomputes each chunk's logits, so no ``[N, vocab]`` tensor is kept between the passes.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk_rows: int) -> torch.Tensor:
        rows = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_rows):
            logits = torch.nn.functional.linear(hidden[start : start + chunk_rows], weight, bias).float()
            t = targets[start : start + chunk_rows]
            rows[start : start + chunk_rows] = logits.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_rows = chunk_rows
        return rows

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_bias and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            h = hidden[start : start + ctx.chunk_rows]
            t = targets[start : start + ctx.chunk_rows]
            # In the hidden states' dtype, as autocast ran the forward (backward runs outside autocast).
            head_weight = weight.to(h.dtype)
            logits = torch.nn.functional.linear(h, head_weight, None if bias is None else bias.to(h.dtype)).float()
            # d(log p_t)/d(logits) = one_hot - softmax, times each row's upstream gradient.
            grad = torch.softmax(logits, dim=-1).neg_()
            grad.scatter_add_(1, t[:, None], torch.ones_like(grad[:, :1]))
            grad.mul_(grad_rows[start : start + ctx.chunk_rows, None].float())
            grad = grad.to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.chunk_rows] = grad @ head_weight
            if grad_weight is not None:
                add_product(grad_weight, grad.t(), h)
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def sequence_log_probs(model: torch.nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None, num_loss_tokens: int | None = None,
                       chunk_rows: int | None = None) -> torch.Tensor:
    """Each packed sequence's summed log-probability of its labels and its label count, ``[2, n]`` fp32,
    differentiable in the sums: ``model``'s LM head on ``hidden_states`` [B, S, H] at labelled positions only.

    Sequences are those of ``cu_seqlens`` (without it, the B rows), as in ``sequence_losses``; a position's
    log-probability belongs to the sequence of the label it predicts.
    """
    head = cast(torch.nn.Linear, output_embeddings(model))  # check_supported's condition
    index, targets = loss_positions(labels, num_loss_tokens)
    states = hidden_states[:, :-1].reshape(-1, hidden_states.shape[-1])[index]
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_LOGITS // head.weight.shape[0])
    rows = cast(torch.Tensor, _LinearLogProbs.apply(states, head.weight, head.bias, targets, chunk_rows))
    return sequence_losses(rows, index, labels.shape, cu_seqlens)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, chunk_rows: int | None = None,
                         row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross-entropy of the logits ``hidden @ weight.T + bias`` ([N, H] x [V, H]) against
    ``targets`` ([N], every one a class), each row times ``row_weights`` ([N]) when given: fp32
    softmax, never more than ``chunk_rows`` rows of logits."""
    return _linear_cross_entropy(hidden, weight, targets, bias, chunk_rows, row_weights, keep_rows=False)[0]


def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None,
                          chunk_rows: int | None, row_weights: torch.Tensor | None,
                          keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_cross_entropy`` and, with ``keep_rows``, each row's unweighted cross-entropy (fp32 [N], no gradient)."""
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_LOGITS // weight.shape[0])
    if not torch.is_grad_enabled():
        # Under no_grad (evaluation) the inputs may still require gradients: none are computed.
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, row_weights, chunk_rows, keep_rows)


def loss_positions(labels: torch.Tensor, num_loss_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices into ``hidden[:, :-1]`` that predict a label, and those labels.

    ``labels`` [B, S] are unshifted, as transformers takes them: position ``s`` predicts
    ``labels[:, s + 1]``. With ``num_loss_tokens`` (the batch's count of labels that are not
    -100) the indices are found without a device-to-host sync.

    >>> loss_positions(torch.tensor([[-100, 5, 7, -100, -100, 9]]), 3)
    (tensor([0, 1, 4]), tensor([5, 7, 9]))
    """
    targets = labels[:, 1:].reshape(-1)
    mask = targets != IGNORE_INDEX
    if num_loss_tokens is None:
        index = mask.nonzero().squeeze(1)
    else:
        index = torch.nonzero_static(mask, size=num_loss_tokens).squeeze(1)
    return index, targets[index]


def output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """A transformers model's LM head (``model.get_output_embeddings()``)."""
    return cast(Callable[[], "torch.nn.Module | None"], model.get_output_embeddings)()


def check_supported(model: torch.nn.Module) -> None:
    """Raise ValueError unless the model's logits are its output embedding's linear map of the last hidden states."""
    head = output_embeddings(model)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}: the LM head is a {type(head).__name__}, not an nn.Linear; "
                         "the loss-position head needs logits = lm_head(hidden_states)")
    if not any(child is head for child in model.children()):
        # Nested in a prediction head (BERT's dense, activation and norm before it): not applied to the hidden states.
        raise ValueError(f"{type(model).__name__}: the LM head sits inside another module, which transforms the "
                         "hidden states first; the loss-position head needs logits = lm_head(hidden_states)")
    config = getattr(model, "config", None)
    for name in LOGIT_MODIFIERS:
        value = getattr(config, name, None)
        # A scale of 1 leaves the logits as they are; a cap of any value changes them.
        if value is not None and (name in LOGIT_CAPS or value != 1):
            raise ValueError(f"{type(model).__name__}: config.{name}={value!r} changes the logits after the LM head; "
                             "the loss-position head does not apply it, so train this model with its full logits")


def padded_loss_positions(labels: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loss_positions`` padded to ``rows`` entries (at least the labelled count): indices, labels,
    and which entries are real. Padding points at position 0 with label 0, to be weighted 0.

    A fixed number of rows keeps the shapes of a CUDA graph (``loaders/train/step_graph.py``) across
    batches whose labelled counts differ.

    >>> padded_loss_positions(torch.tensor([[-100, 5, 7, -100, -100, 9]]), 4)
    (tensor([0, 1, 4, 0]), tensor([5, 7, 9, 0]), tensor([ True,  True,  True, False]))
    """
    targets = labels[:, 1:].reshape(-1)
    found = torch.nonzero_static(targets != IGNORE_INDEX, size=rows, fill_value=-1).squeeze(1)
    real = found >= 0
    index = found.clamp(min=0)
    return index, torch.where(real, targets[index], 0), real


def sequence_losses(token_losses: torch.Tensor, positions: torch.Tensor, labels_shape: torch.Size,
                    cu_seqlens: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
    """Each packed sequence's summed token loss and loss tokens, ``[2, n]`` in the dtype of ``token_losses``.

    ``token_losses`` are the losses at ``positions``, flat indices into ``labels[:, 1:]`` as
    ``loss_positions`` gives them (``labels_shape`` is ``labels``' [B, S]); ``counted`` says which
    of them count (``padded_loss_positions``' padding does not). A position's loss belongs to the
    sequence of ``cu_seqlens`` that holds the label it predicts; without ``cu_seqlens`` each row
    is a sequence. No host sync.

    >>> sequence_losses(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 1, 4]), torch.Size([1, 6]), torch.tensor([0, 4, 6]))
    tensor([[3., 4.],
            [2., 1.]])
    """
    row = positions // (labels_shape[1] - 1)
    if cu_seqlens is None:
        sequence, count = row, labels_shape[0]
    else:
        # Position p of row b predicts token p + b + 1 of the flattened batch.
        bounds = cu_seqlens.to(positions.device, non_blocking=True)
        sequence = torch.searchsorted(bounds, (positions + row + 1).to(bounds.dtype), right=True) - 1
        count = cu_seqlens.numel() - 1
    weights = torch.ones_like(token_losses) if counted is None else counted.to(token_losses.dtype)
    totals = torch.zeros(2, count, dtype=token_losses.dtype, device=token_losses.device)
    return totals.index_add(1, sequence, torch.stack((token_losses * weights, weights)))


def loss_position_loss(model: torch.nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor,
                       num_items_in_batch: int | torch.Tensor | None = None, num_loss_tokens: int | None = None,
                       chunk_rows: int | None = None, loss_weights: torch.Tensor | None = None,
                       padded_rows: int | None = None, per_sequence: bool = False,
                       cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The causal-LM loss of ``model``'s LM head on ``hidden_states`` [B, S, H], at labelled positions
    only; and, with ``per_sequence``, each packed sequence's loss (else None).

    Equals transformers' ``ForCausalLMLoss``: the summed cross-entropy over labels that are not
    -100, divided by ``num_items_in_batch`` when given, else by their number. With
    ``loss_weights`` (a batch's, ``loaders/loss_weights.py``) each label's term is weighted and the
    default divisor is the sum of the weights, as in ``loaders.train.loss.weighted_causal_lm_loss``.
    With ``padded_rows`` the labelled positions are padded to that many rows of weight 0
    (``padded_loss_positions``), so the shapes do not depend on the batch's labelled count.
    ``per_sequence``: the summed, unweighted cross-entropy and the loss tokens of each sequence of
    ``cu_seqlens`` (``sequence_losses``), detached; the loss is the same with it or without.
    """
    head = cast(torch.nn.Linear, output_embeddings(model))  # check_supported's condition
    real = None
    if padded_rows is None:
        index, targets = loss_positions(labels, num_loss_tokens)
    else:
        index, targets, real = padded_loss_positions(labels, padded_rows)
    states = hidden_states[:, :-1].reshape(-1, hidden_states.shape[-1])[index]
    row_weights = None
    if loss_weights is not None:
        row_weights = loss_weights[:, 1:].reshape(-1).to(states.device)[index]
    if real is not None:
        row_weights = real.to(torch.float32) if row_weights is None else row_weights * real
    total, rows = _linear_cross_entropy(states, head.weight, targets, head.bias, chunk_rows, row_weights, per_sequence)
    by_sequence = sequence_losses(rows, index, labels.shape, cu_seqlens, real) if per_sequence else None
    if num_items_in_batch is None:
        return total / (targets.numel() if row_weights is None else row_weights.float().sum()), by_sequence
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch, by_sequence


@functools.cache
def _output_type() -> type:
    """transformers' ``CausalLMOutputWithPast`` with each packed sequence's loss (``sequence_losses``)."""
    from dataclasses import dataclass

    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class LossPositionOutput(CausalLMOutputWithPast):
        """The loss-position head's output: no logits; ``sequence_losses`` or ``sequence_log_probs`` [2, n] when asked for."""

        sequence_losses: torch.Tensor | None = None
        sequence_log_probs: torch.Tensor | None = None

    return LossPositionOutput


def use_loss_position_head(model: torch.nn.Module, chunk_rows: int | None = None) -> torch.nn.Module:
    """Make ``model(..., labels=...)`` compute its loss at labelled positions only; returns ``model``.

    Works on a transformers causal LM whose logits are ``lm_head(hidden_states)`` (Llama, Qwen,
    Mistral, GPT-2, ...): the forward with labels runs the base model, then the chunked LM head
    and cross-entropy over the positions with a label, and returns a ``CausalLMOutputWithPast``
    with the loss and no logits. Without labels the model runs as before. ``num_items_in_batch``
    is honoured as in transformers (the HF Trainer passes it), and a PackedIterableDataset
    batch's ``num_loss_tokens`` and ``num_real_tokens`` are consumed here, not passed to the
    layers, and its ``loss_weights`` (``loaders/loss_weights.py``) weigh the loss, so ``model(**batch)`` needs
    no device sync and compiled layers see no int arguments. ``model(**batch, sequence_losses=True)``
    also returns each sequence's summed token loss and loss tokens as ``.sequence_losses``.
    On a PEFT model the head goes on its underlying causal LM (``causal_lm``), as when put there before PEFT wraps it.
    """
    if causal_lm(model) is not model:
        use_loss_position_head(causal_lm(model), chunk_rows)
        return model
    check_supported(model)
    full_forward = model.forward

    @functools.wraps(full_forward)
    def forward(input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, **kwargs: Any):
        num_loss_tokens = kwargs.pop(NUM_LOSS_TOKENS, None)
        padded_rows = kwargs.pop(PADDED_LOSS_ROWS, None)
        per_sequence = bool(kwargs.pop(SEQUENCE_LOSSES, False))
        log_probs = bool(kwargs.pop(SEQUENCE_LOG_PROBS, False))
        kwargs.pop(NUM_REAL_TOKENS, None)
        loss_weights = kwargs.pop(LOSS_WEIGHTS, None)
        kwargs.pop(LOSS_WEIGHT_SUM, None)
        if labels is None:
            return full_forward(input_ids=input_ids, **kwargs)
        kwargs.pop("logits_to_keep", None)
        outputs = cast(torch.nn.Module, model.base_model)(input_ids=input_ids, **kwargs)
        if log_probs:  # a preference loss's input: no token loss here
            sums = sequence_log_probs(model, outputs[0], labels, kwargs.get("cu_seq_lens_q"), num_loss_tokens, chunk_rows)
            return _output_type()(sequence_log_probs=sums, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))
        loss, by_sequence = loss_position_loss(model, outputs[0], labels, num_items_in_batch, num_loss_tokens, chunk_rows,
                                               loss_weights, padded_rows, per_sequence, kwargs.get("cu_seq_lens_q"))
        return _output_type()(loss=loss, sequence_losses=by_sequence, hidden_states=getattr(outputs, "hidden_states", None),
                              attentions=getattr(outputs, "attentions", None))

    model.forward = forward
    # nn.Module.__setattr__ is typed for tensors and modules only; a plain value is stored as it is.
    model.varpack_loss_head = True  # type: ignore[assignment]
    return model


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM whose forward computes the logits: a PEFT model's underlying model (``get_base_model()``), else
    ``model`` (whose ``base_model`` returns hidden states)."""
    get_base_model = getattr(model, "get_base_model", None)
    return cast(torch.nn.Module, get_base_model()) if callable(get_base_model) else model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` without gradients, in eval mode, with its own loss-position head when ``model`` has one
    (a plain deep copy's head would still run the original's forward): a preference loss's reference model."""
    import copy

    frozen = copy.deepcopy(model)
    if getattr(model, "varpack_loss_head", False):
        del causal_lm(frozen).forward  # the instance attribute use_loss_position_head set, bound to the original
        use_loss_position_head(frozen)
    return frozen.requires_grad_(False).eval()
