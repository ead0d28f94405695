"""A whole training step (forward, backward, gradient clipping, optimizer step) replayed as one
CUDA graph per batch shape.

With few tokens per step (a 0.5B model at 8k tokens) the GPU runs kernels faster than Python
launches them, and per-layer compile still leaves it idle a fifth of every step. A CUDA graph
launches the whole step at once. It needs shapes that repeat: batches padded with
``pad_to_fixed_shape=fixed_shape(..., buckets=True)`` have a fixed token count, and their
sequence count and ``max_length`` fall into a few buckets; the labelled positions, which the
loss-position head gathers, are padded to a multiple of LOSS_ROWS_BUCKET rows of weight 0.
A graph is captured the first time its shapes are seen, after one uncaptured forward and
backward that compiles what the shapes need. All graphs share one memory pool: nothing a step
leaves in it is read after the step::

    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"),
                                  fused=True, capturable=True)
    step = GraphedStep(use_loss_position_head(model), optimizer, max_grad_norm=1.0)
    for batch in loader:                       # PackedIterableDataset batches, bucketed
        loss = step(batch)                     # the step's loss, on the GPU
        scheduler.step()                       # changes the lr tensor the graphs read

The first step runs uncaptured: it creates the optimizer's state. ``step.prepare(batches)``
then captures the graphs of all the shapes among ``batches`` (an epoch's worth, say) at once;
``GraphedStep(..., shapes=batches)`` does so right after the first step, so that no later step
stops to capture (``scripts/train.py --step-graph`` passes an epoch of its loader's batches,
``scripts/bench_train.py`` the batches of its windows).
Each step is one micro-batch; the loss is divided by ``num_items_in_batch`` (default: the
batch's loss tokens). A batch with ``sequence_losses=True`` (``loaders.train.loss_head.SEQUENCE_LOSSES``)
leaves each packed sequence's summed token loss and loss tokens of the step in
``step.sequence_losses``, a second output of its graph (a mixture's loss per source:
``loaders.train.source_loss``).

``GraphedForwardBackward(model)`` captures a micro-batch's forward and backward alone, for a loop
that runs clipping, the optimizer and the scheduler itself, eagerly (``PackedTrainer`` with
``SpeedOptions(step_graph=True)``): each replay leaves the gradients in ``.grad`` and returns the
loss. Both share the shape keys, the padding of labelled rows, the warm-up stream and the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from loaders.collate import NUM_LOSS_TOKENS, NUM_REAL_TOKENS
from loaders.loss_weights import LOSS_WEIGHT_SUM
from loaders.train.loss_head import PADDED_LOSS_ROWS

# Batch entries that are no model setting: counts the head consumes, which differ from batch to batch.
_COUNTS = (NUM_LOSS_TOKENS, NUM_REAL_TOKENS, LOSS_WEIGHT_SUM)

# Labelled positions are padded to a multiple of this many rows, so batches share graphs.
LOSS_ROWS_BUCKET = 256


# One side stream per device for the uncaptured step before each capture. cuBLAS keeps a workspace (32 MiB on
# Hopper) for each pair of handle and stream it has run on, for the life of the process: a new stream per capture
# left 64 MiB (the forward's and the backward's handle) allocated per graph, never freed.
_WARM_UP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARM_UP_STREAMS[device]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # the graph reads its batch from these
    num_items: torch.Tensor  # and its loss divisor from this
    loss: torch.Tensor  # where it writes the loss
    sequence_losses: torch.Tensor | None  # and, when the batch asks, each sequence's loss
    grads: list[torch.Tensor | None]  # the gradients it leaves for after the replay, one per parameter, if any


class _ShapeGraphs:
    """One CUDA graph per batch shape of a model's forward and backward, and what follows the backward in the graph
    (``_update``); all graphs share one memory pool. What ``GraphedStep`` and ``GraphedForwardBackward`` share."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], autocast_dtype: torch.dtype | None,
                 shapes: Iterable[dict] | None) -> None:
        if not getattr(model, "varpack_loss_head", False):
            raise ValueError(f"{type(self).__name__} needs the loss-position head: use_loss_position_head(model) first")
        self.model = model
        self.params = params
        self.autocast_dtype = autocast_dtype
        self.graphs: dict[tuple, _Captured] = {}
        self.replays = 0
        # The last step's per-sequence losses ([2, n] on the GPU) when its batch asked for them, else None.
        self.sequence_losses: torch.Tensor | None = None
        self._pool: Any = None
        self._shapes_ahead = shapes

    def prepare(self, batches: Iterable[dict]) -> int:
        """Capture now the graph of every shape among ``batches`` not captured yet, so that training
        never stops to capture; returns how many were captured. The weights are untouched."""
        captured = 0
        for batch in batches:
            tensors, settings, rows, key = self._shapes(batch)
            if key not in self.graphs:
                self.graphs[key] = self._capture(tensors, settings, rows)
                captured += 1
        return captured

    def _prepare_ahead(self) -> None:
        """Capture the shapes given to the constructor, once."""
        if self._shapes_ahead is not None:
            shapes, self._shapes_ahead = self._shapes_ahead, None
            self.prepare(shapes)

    @staticmethod
    def _shapes(batch: dict) -> tuple[dict, dict, int, tuple]:
        """The batch's tensors, its other model settings, its padded labelled rows, and the key of its graph."""
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        settings = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor) and k not in _COUNTS}
        rows = -(-batch[NUM_LOSS_TOKENS] // LOSS_ROWS_BUCKET) * LOSS_ROWS_BUCKET
        key = (tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(tensors.items())), tuple(sorted(settings.items())), rows)
        return tensors, settings, rows, key

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)

    def _replay(self, batch: dict, num_items: torch.Tensor | float) -> _Captured:
        """Replay the graph of the batch's shape (captured now if it is new) on ``batch``, dividing its loss by
        ``num_items`` (a tensor on the device is copied there, without a host sync)."""
        tensors, settings, rows, key = self._shapes(batch)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(tensors, settings, rows)
        for name, value in tensors.items():
            captured.inputs[name].copy_(value, non_blocking=True)
        if isinstance(num_items, torch.Tensor):
            captured.num_items.copy_(num_items, non_blocking=True)
        else:
            captured.num_items.fill_(num_items)
        captured.graph.replay()
        self.replays += 1
        # Copied out: the next replay of any graph may reuse the pool memory they are in.
        self.sequence_losses = None if captured.sequence_losses is None else captured.sequence_losses.clone()
        return captured

    def _release_gradients(self) -> None:
        """Before each capture's uncaptured forward and backward, and before the capture itself."""
        raise NotImplementedError

    def _update(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """The captured work from the loss on, at least its backward; returns the gradients that outlive the replay,
        one per parameter (none: the graph consumes them)."""
        raise NotImplementedError

    def _capture(self, tensors: dict, settings: dict, rows: int) -> _Captured:
        """Capture the step for these shapes, after one uncaptured forward and backward (weights untouched)."""
        device = self.params[0].device
        inputs = {name: value.detach().to(device, copy=True) for name, value in tensors.items()}
        num_items = torch.ones((), device=device)

        def forward() -> Any:
            with self._autocast():
                return self.model(**inputs, **settings, num_items_in_batch=num_items, **{PADDED_LOSS_ROWS: rows})

        # The previous capture's gradients go first: a forward run while they are held would add a copy of them to
        # the peak (6 GiB on a 3B model).
        self._release_gradients()
        side = _warm_up_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward().loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        self._release_gradients()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a DataLoader's pin-memory thread may allocate meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = forward()
            grads = self._update(outputs.loss)
        self._pool = graph.pool()
        return _Captured(graph, inputs, num_items, outputs.loss.detach(), outputs.sequence_losses, grads)


def _reached_leaves(loss: torch.Tensor) -> set[int]:
    """The ids of the tensors whose gradient a backward from ``loss`` accumulates (a parameter the forward does not
    reach gets none, and keeps ``grad`` None)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            reached.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return reached


class GraphedStep(_ShapeGraphs):
    """``step(batch)``: one optimizer step on ``batch``, as a CUDA graph replay; returns the loss.

    ``model`` must use the loss-position head (``loaders.train.loss_head.use_loss_position_head``)
    and run without host syncs; ``optimizer`` must be capturable (``capturable=True``) with
    tensor learning rates on the GPU, so a scheduler's changes reach the captured steps.
    ``autocast_dtype``: run the forward under ``torch.autocast`` to that dtype (fp32 weights
    trained in bf16), without autocast's weight cache, which a graph cannot keep.
    ``shapes``: batches as the steps will take them (lazily made, read once) whose shapes are all
    captured right after the first step (``prepare``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None,
                 autocast_dtype: torch.dtype | None = None, shapes: Iterable[dict] | None = None):
        super().__init__(model, [p for group in optimizer.param_groups for p in group["params"]], autocast_dtype, shapes)
        for group in optimizer.param_groups:
            if not group.get("capturable"):
                raise ValueError("GraphedStep needs a capturable optimizer: pass capturable=True")
            lr = group["lr"]
            if not (isinstance(lr, torch.Tensor) and lr.is_cuda):
                raise ValueError("GraphedStep needs the learning rate as a tensor on the GPU (lr=torch.tensor(lr, "
                                 "device='cuda')): a captured step would keep a float learning rate for ever")
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm

    def __call__(self, batch: dict, num_items_in_batch: float | None = None) -> torch.Tensor:
        num_items = float(batch[NUM_LOSS_TOKENS] if num_items_in_batch is None else num_items_in_batch)
        if not self.optimizer.state:
            tensors, settings, _, _ = self._shapes(batch)
            loss = self._eager(tensors, settings, num_items)
            self._prepare_ahead()
            return loss
        self._prepare_ahead()  # a resumed run: the optimizer's state came from a checkpoint
        return self._replay(batch, num_items).loss.clone()

    def prepare(self, batches: Iterable[dict]) -> int:
        """Capture now the graph of every shape among ``batches`` not captured yet, so that training
        never stops to capture; returns how many were captured. The weights are untouched; call
        it after the first step, which creates the optimizer's state."""
        if not self.optimizer.state:
            raise RuntimeError("GraphedStep.prepare: take the first step first; it creates the optimizer's state")
        return super().prepare(batches)

    def _release_gradients(self) -> None:
        # Only the graphs write and read the gradients, each within its own replay.
        self.optimizer.zero_grad(set_to_none=True)

    def _update(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        return []

    def _eager(self, tensors: dict, settings: dict, num_items: float) -> torch.Tensor:
        """A step without a graph: the first one, which creates the optimizer's state."""
        divisor = torch.tensor(num_items, device=self.params[0].device)
        with self._autocast():
            outputs = self.model(**tensors, **settings, num_items_in_batch=divisor)
        self._update(outputs.loss)
        self.optimizer.zero_grad(set_to_none=True)
        self.sequence_losses = outputs.sequence_losses
        return outputs.loss.detach()


class GraphedForwardBackward(_ShapeGraphs):
    """``graphed(batch, num_items_in_batch)``: a micro-batch's forward and backward as a CUDA graph replay; returns
    the loss and leaves every trained parameter's gradient in ``.grad``, for an optimizer step run outside the graph
    (the Hugging Face Trainer's clipping, optimizer and scheduler: ``loaders.train.hf_trainer``).

    All graphs write one set of gradients, made at the first capture beside the parameters (one more copy of the
    trained parameters' size, held for the run): each replay zeroes it and its backward adds to it, and
    ``.grad`` is set to it after every replay, also after ``zero_grad()`` dropped it. A parameter the forward
    does not reach keeps ``.grad`` None; a frozen one (``requires_grad=False``, LoRA's base weights) has none.
    Run the model's first forward and backward uncaptured (it compiles), then ``prepare`` the shapes ahead.
    """

    def __init__(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None,
                 shapes: Iterable[dict] | None = None) -> None:
        super().__init__(model, [p for p in model.parameters() if p.requires_grad], autocast_dtype, shapes)
        self._gradients: list[torch.Tensor] = []

    def __call__(self, batch: dict, num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        self._prepare_ahead()
        captured = self._replay(batch, batch[NUM_LOSS_TOKENS] if num_items_in_batch is None else num_items_in_batch)
        for p, grad in zip(self.params, captured.grads):
            p.grad = grad
        return captured.loss.clone()

    def _release_gradients(self) -> None:
        # The backward adds to the one set of gradients: no copy of them is made in the pool.
        if not self._gradients:
            self._gradients = [torch.zeros_like(p) for p in self.params]
        for p, grad in zip(self.params, self._gradients):
            p.grad = grad

    def _update(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        reached = _reached_leaves(loss)
        torch._foreach_zero_(self._gradients)
        loss.backward()
        return [grad if id(p) in reached else None for p, grad in zip(self.params, self._gradients)]
