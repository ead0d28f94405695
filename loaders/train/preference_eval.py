"""Evaluation of a preference build: the objective's loss and TRL's reward metrics over every pair.

Every row of the build is read once, in order (``loaders.train.evaluate.packed_batches``: no shuffle,
nothing dropped, shards checked as training's are), ``batch_rows`` rows per forward, without gradients and
with the model in eval mode. Each pair's loss and rewards are those training computes
(``preference_terms`` with the same ``PreferenceConfig`` and ``Reference``); the result holds them per pair,
by pair id, and its ``metrics`` are their means over pairs, under the names TRL's ``DPOTrainer`` logs::

    result = evaluate_preference(model, "shards/DIR-validation", PreferenceConfig("dpo", beta=0.1), reference)
    result.metrics   # {"loss": ..., "rewards/chosen": ..., "rewards/rejected": ..., "rewards/accuracies": ..., "rewards/margins": ...}

With ``distributed=True`` the ranks share the batches and every rank gets the whole result.

Imports only torch, numpy and the read side.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from loaders.collate import CHOSEN, PAIR_IDS, ROLES
from loaders.remote import locate
from loaders.train.evaluate import packed_batches
from loaders.train.preference import REWARD_METRICS, PreferenceConfig, Reference, model_inputs, preference_terms


@dataclass(frozen=True)
class PreferenceEvalResult:
    """Each pair's loss and rewards (by pair id, ascending: every pair of the build once) and the seconds taken."""

    pair_ids: np.ndarray  # int64
    losses: np.ndarray  # float64
    chosen_rewards: np.ndarray  # float64
    rejected_rewards: np.ndarray  # float64
    seconds: float

    @property
    def metrics(self) -> dict[str, float]:
        """The mean over pairs of the loss and of TRL's ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies`` (the share of pairs whose chosen reward is above the rejected one) and
        ``rewards/margins``."""
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        rewards = (chosen.mean(), rejected.mean(), (chosen > rejected).mean(), (chosen - rejected).mean())
        return {"loss": float(self.losses.mean()), **{name: float(value) for name, value in zip(REWARD_METRICS, rewards)}}


def evaluate_preference(model: torch.nn.Module, source: str | os.PathLike[str], config: PreferenceConfig,
                        reference: Reference | None = None, batch_rows: int = 1,
                        distributed: bool = False) -> PreferenceEvalResult:
    """``config``'s loss and rewards of every pair of the preference build ``source`` under ``model`` (with the
    loss-position head, on its device), compared with ``reference`` (DPO and IPO need one).

    ``distributed``: under an initialised ``torch.distributed``, every rank evaluates its share of the batches,
    and every rank returns the whole build's result (one gather of per-pair values).
    """
    manifest = locate(source).read_manifest()
    if manifest.preference_layout is None:
        raise ValueError(f"{source}: not a build of preference pairs (pack it with --format preference)")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed and dist.is_initialized() else (0, 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    parts: list[tuple[np.ndarray, ...]] = []
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for batch, _ in packed_batches(source, batch_rows, rank, world):
                inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs(batch).items()}
                terms = preference_terms(model, batch, config, reference, inputs)
                roles = cast(torch.Tensor, batch[ROLES])
                parts.append((cast(torch.Tensor, batch[PAIR_IDS])[roles == CHOSEN].numpy(),
                              *(t.double().cpu().numpy() for t in (terms.losses, terms.chosen_rewards, terms.rejected_rewards))))
    finally:
        model.train(was_training)
    local = tuple(np.concatenate(column) for column in zip(*parts)) if parts else (np.zeros(0, np.int64), *[np.zeros(0)] * 3)
    gathered: list = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    pair_ids, losses, chosen, rejected = (np.concatenate(column) for column in zip(*gathered))
    order = np.argsort(pair_ids, kind="stable")
    pair_ids = pair_ids[order]
    if pair_ids.size != manifest.stats.pairs or np.any(pair_ids[1:] == pair_ids[:-1]):
        raise ValueError(f"{source}: read {pair_ids.size} pairs ({np.unique(pair_ids).size} distinct); the build packed "
                         f"{manifest.stats.pairs}: its shards do not match its manifest; rebuild it")
    return PreferenceEvalResult(pair_ids.astype(np.int64), losses[order], chosen[order], rejected[order],
                                time.perf_counter() - start)
