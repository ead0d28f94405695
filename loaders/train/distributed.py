"""Loss normalisation across data-parallel ranks: the mean over every loss token of the global batch.

A packed batch holds a different number of loss tokens on every rank. Averaging each rank's
own mean (what DDP does with per-rank means) weighs a token on a rank with few loss tokens more
than one on a busy rank, and averaging each micro-batch's mean does the same across gradient
accumulation. Dividing every micro-batch's summed loss by the step's global count, times the
world size that DDP's gradient averaging divides by, gives exactly the gradient of one process
training on all ranks' batches at once:

    normalizer = step_normalizer(sum(batch_normalizer(b) for b in window), device)   # one all-reduce
    loss = model(**inputs, num_items_in_batch=normalizer).loss   # each micro-batch of the window

With K ranks, counts ``n_r`` and summed losses ``L_r``: DDP's gradient is
``(1/K) sum_r grad(L_r / (N / K)) = grad(sum_r L_r) / N`` with ``N = sum_r n_r``.
``varpack check --ranks K --grad-accum G`` (``loaders.check``) measures it on a model and build.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, torch.device]:
    """Join the process group ``torchrun`` describes (NCCL on GPUs, gloo on CPUs): ``(rank, device)``.

    A plain ``python scripts/train.py`` is rank 0 of one.
    """
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` under ``DistributedDataParallel`` when several processes train, else ``model`` itself."""
    if world_size() == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def world_size() -> int:
    """The data-parallel world size: torch.distributed's when it is initialised, else 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_loss_tokens(count: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` summed over all ranks, as a float tensor on ``device`` (one all-reduce; none on one rank).

    ``count`` is a batch's ``num_loss_tokens`` (a Python int the loader computes), so nothing
    waits on the device before the all-reduce.
    """
    total = torch.tensor(float(count), device=device)
    if world_size() > 1:
        dist.all_reduce(total)
    return total


def step_normalizer(count: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """What each micro-batch of an optimizer step divides its summed loss by: the step's global loss tokens (or
    loss weight), over every rank and micro-batch, divided by the world size that DDP's gradient average divides by.

    ``count`` is this rank's total over the step's micro-batches (``batch_normalizer`` of each), a Python number.
    """
    return global_loss_tokens(count, device) / world_size()


def finish_distributed_run() -> NoReturn:
    """End this rank of a multi-process run: wait at a barrier for every rank, flush, and exit 0
    without tearing the process group down.

    Tearing a gloo process group down from Python hangs or aborts a rank now and then: the
    main thread holds the GIL while it joins gloo's worker thread, which may still need the GIL
    to free a finished collective's tensors, and a rank that leaves early closes connections
    another rank still reads. After the barrier nothing more is exchanged, so skipping the
    teardown loses nothing. Call it last, once every file is written: from a script's
    ``__main__`` under torchrun, or at the end of a spawned worker.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
