"""A training run's log: one JSON object a line, to stdout and ``OUT/log.jsonl``.

Each line holds the step, the loss, real tokens/s and peak memory since the last line; on a
mixture also each source's real and loss tokens (``source_tokens``) and mean token loss
(``source_loss``, summed on the device: ``loaders.train.source_loss``; the plain mean, whatever
the loss reduction). Under ``torchrun`` every rank counts and rank 0 writes::

    log = Logger(out, dataset_sources, device, writes=rank == 0)
    log.add_batch(batch)                          # each micro-batch trained
    log.log_steps(step, losses, lr=...)           # the mean of the steps' losses, all ranks' tokens

``PackedTrainer`` logs through ``callbacks=[log.trainer_callback()]``, with the same keys. The log is
never written through a link planted at its path.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from loaders.collate import NUM_REAL_TOKENS, SOURCE_IDS
from loaders.mixture import source_counts
from loaders.train.distributed import world_size
from loaders.train.models import count_on_device, peak_memory_gib
from loaders.train.preference import REWARD_METRICS
from loaders.train.source_loss import SourceLosses

LOG = "log.jsonl"


class Logger:
    """Real tokens/s, loss and peak memory since the last line, as JSON to stdout and ``OUT/log.jsonl``."""

    def __init__(self, out: Path, sources: list[str] | None = None, device: torch.device | str = "cpu",
                 writes: bool = True) -> None:
        self.path = out / LOG
        self.device = torch.device(device)
        self.writes = writes  # under torchrun, rank 0 writes; every rank counts and starts again at each line
        self.tokens = 0
        self.sources = sources or []
        self.source_tokens = np.zeros((2, len(self.sources)), dtype=np.int64)
        self.source_losses = SourceLosses(self.sources, device) if self.sources else None
        self.start = time.perf_counter()

    @staticmethod
    def check(out: Path) -> None:
        """OSError when ``OUT/log.jsonl`` is a link, before a run starts."""
        if (out / LOG).is_symlink():
            raise OSError(f"{out / LOG}: is a link, and the log is never written through one; remove it")

    def add_batch(self, batch: dict) -> None:
        """Count a micro-batch's real tokens (and, on a mixture, each source's)."""
        self.tokens += batch[NUM_REAL_TOKENS]
        if SOURCE_IDS in batch:
            counts = source_counts(batch, len(self.sources))
            self.source_tokens += np.stack((counts["tokens"], counts["loss_tokens"]))

    def log_steps(self, step: int, losses: list[torch.Tensor], **values: Any) -> dict:
        """A line for the steps since the last one: their mean loss over all ranks, and all ranks' tokens."""
        mean_loss = torch.stack(losses).mean()
        ranks = world_size()
        if ranks > 1:
            totals = torch.stack([mean_loss, count_on_device(self.tokens, self.device)])
            torch.distributed.all_reduce(totals)
            mean_loss, self.tokens = totals[0] / ranks, int(totals[1].item())
            if self.sources:
                sources = torch.from_numpy(self.source_tokens).to(self.device)
                torch.distributed.all_reduce(sources)
                self.source_tokens = sources.cpu().numpy()
        return self.log(step, loss=mean_loss.item(), **values)

    def log(self, step: int, **values: Any) -> dict:
        """A line of ``values`` with the tokens/s and peak memory since the last line; counting starts again."""
        now = time.perf_counter()
        record = {"step": step, **values, "tokens_per_s": self.tokens / max(now - self.start, 1e-9),
                  "peak_mem_gib": peak_memory_gib()}
        if self.sources:
            record["source_tokens"] = {name: {"tokens": int(tokens), "loss_tokens": int(loss)}
                                       for name, tokens, loss in zip(self.sources, *self.source_tokens)}
            self.source_tokens[:] = 0
        if self.source_losses is not None:
            record["source_loss"] = self.source_losses.pop(distributed=True)
        self.tokens, self.start = 0, now
        if self.writes:
            self.write(record)
        return record

    def trainer_callback(self) -> Any:
        """A transformers ``TrainerCallback`` that writes each training log of rank 0 as a line (``trainer_record``)."""
        from transformers import TrainerCallback

        log = self

        class LogToFile(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if state.is_world_process_zero and logs and "loss" in logs:
                    log.write(log.trainer_record(state.global_step, logs))

        return LogToFile()

    def trainer_record(self, step: int, logs: dict[str, Any]) -> dict:
        """The line of a ``PackedTrainer`` training log (``loss`` and ``real_tokens_per_s`` in ``logs``): the same keys,
        with a preference objective's reward metrics and, on a mixture, its ``train_NAME_loss`` as ``source_loss``."""
        record = {"step": step, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                  "tokens_per_s": logs["real_tokens_per_s"], "peak_mem_gib": peak_memory_gib()}
        record.update({name: logs[name] for name in REWARD_METRICS if name in logs})
        if self.sources:
            record["source_loss"] = {name: logs.get(f"train_{name}_loss") for name in self.sources}
        return record

    def write(self, record: dict) -> None:
        """Print ``record`` as a JSON line and append it to the log file."""
        print(json.dumps(record), flush=True)
        with open_log(self.path) as f:
            f.write(json.dumps(record) + "\n")


def open_log(path: Path) -> IO[str]:
    """``path`` opened to append, never through a link planted there (O_NOFOLLOW): an OSError naming it instead."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if not path.is_symlink():
            raise
        raise OSError(f"{path}: is a link, and the log is never written through one; remove it") from err
    return os.fdopen(fd, "a")
