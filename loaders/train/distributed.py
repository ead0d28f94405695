"""Loss normalisation across data-parallel ranks: the mean over every loss token of the global batch.

A packed batch holds a different number of loss tokens on every rank. Averaging each rank's
own mean (what DDP does with per-rank means) weighs a token on a rank with few loss tokens more
than one on a busy rank. Dividing each rank's summed loss by the global count, times the world
size that DDP's gradient averaging divides by, gives exactly the gradient of one process
training on all ranks' batches at once:

    count = global_loss_tokens(sum(b["num_loss_tokens"] for b in window), device)
    loss = model(**inputs, num_items_in_batch=count / world_size()).loss   # per micro-batch
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


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
