"""Preference losses on packed pairs: DPO (sigmoid), IPO, SimPO and ORPO, and the reference model's log-probs.

A preference build's batch (``loaders.collate.preference_fields``) names each sequence's pair and role
(chosen or rejected, and for the shared-prompt layout the prompt). The loss-position head, asked for
``sequence_log_probs``, gives each sequence's summed log-probability of its completion tokens; the
chosen and rejected sums of each pair go into the objective::

    model = use_loss_position_head(model)                        # the policy
    terms = preference_terms(model, batch, PreferenceConfig("dpo", beta=0.1), reference)
    (terms.losses.sum() / pairs_in_the_step).backward()

The formulas are TRL's (``DPOTrainer`` for DPO and IPO, ``CPOTrainer(loss_type="simpo")`` for SimPO,
``ORPOTrainer``), and so are the logged names: ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies`` and ``rewards/margins``. Each loss is a mean over pairs; ORPO's negative
log-likelihood term is each chosen answer's mean token loss, averaged over pairs (TRL averages it over the
batch's chosen tokens).

The reference model's log-probs come from one of (``Reference``):

- a frozen copy of the model, run on the same batch without gradients;
- the policy itself with its LoRA adapter turned off (a PEFT model, no copy);
- a sidecar file computed once beside the build (``write_reference_log_probs``), an Arrow table of each
  pair's chosen and rejected sums whose metadata holds the build's fingerprint and the reference
  model's identity (a hash of its weights); a file of another build or model is refused.

Imports only torch, numpy and pyarrow (and the read side).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from loaders.collate import CHOSEN, KEY_INDEX, NUM_PAIRS, PAIR_IDS, PREFERENCE_KEYS, REJECTED, ROLES
from loaders.dataset import PackedIterableDataset
from loaders.mixture import PackedMixture
from loaders.train.attention import check_key_index_attention
from loaders.train.loss_head import SEQUENCE_LOG_PROBS
from schemas.row import PreferenceLayout
from schemas.io import atomic_file
from schemas.manifest import Manifest


class Objective(StrEnum):
    """The preference objectives ``scripts/train.py --objective`` takes (``sft`` is plain fine-tuning)."""

    DPO = "dpo"
    IPO = "ipo"
    SIMPO = "simpo"
    ORPO = "orpo"


# Objectives that compare the policy with a reference model; SimPO and ORPO need none.
NEEDS_REFERENCE = (Objective.DPO, Objective.IPO)
NOT_PREFERENCE = ("trains on preference pairs, and the batches hold none: the build is not a preference build "
                  "(pack it with --format preference)")
NOT_SFT = "is a build of preference pairs: next-token loss would train on its rejected answers too"
# TRL's logged reward metrics, each a mean over pairs.
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@dataclass(frozen=True)
class PreferenceConfig:
    """A preference objective and its settings: ``beta`` (DPO, IPO, SimPO's scale, ORPO's lambda),
    ``simpo_gamma`` (SimPO's target margin; TRL's ``simpo_gamma``) and ``label_smoothing`` (the share of
    preference labels assumed flipped, robust DPO: TRL's ``label_smoothing`` with ``loss_type="robust"``)."""

    objective: str = Objective.DPO
    beta: float = 0.1
    simpo_gamma: float = 0.5
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.objective not in tuple(Objective):
            raise ValueError(f"unknown preference objective {self.objective!r}; choose one of "
                             f"{', '.join(o.value for o in Objective)}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta is {self.beta}; give a finite positive number")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing is {self.label_smoothing}; give a share in [0, 0.5)")
        if self.label_smoothing and self.objective != Objective.DPO:
            raise ValueError(f"label_smoothing applies to DPO (robust DPO), not {self.objective}")


@dataclass(frozen=True)
class PairLogProbs:
    """Per pair (in batch order): the chosen and rejected answers' summed log-probs and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass(frozen=True)
class PreferenceTerms:
    """A batch's per-pair losses (differentiable) and rewards (detached), fp32 [pairs]."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_log_probs(sums: torch.Tensor, roles: torch.Tensor) -> PairLogProbs:
    """``sums`` [2, n] (each sequence's summed log-prob and label count, ``sequence_log_probs``) -> per pair.

    ``roles`` [m <= n] are the batch's real sequences' roles; sequences past them (padding) are never read.
    The k-th chosen sequence pairs with the k-th rejected one (the collator checked their pair ids).

    >>> pair = pair_log_probs(torch.tensor([[0.0, -3.0, -5.0], [0.0, 2.0, 4.0]]), torch.tensor([0, 1, 2]))
    >>> pair.chosen.tolist(), pair.rejected.tolist(), pair.rejected_tokens.tolist()
    ([-3.0], [-5.0], [4.0])
    """
    roles = roles.to(sums.device)
    real = sums[:, : roles.numel()]
    chosen, rejected = real[:, roles == CHOSEN], real[:, roles == REJECTED]
    return PairLogProbs(chosen[0], rejected[0], chosen[1], rejected[1])


def dpo(policy: PairLogProbs, reference: PairLogProbs | None, config: PreferenceConfig) -> PreferenceTerms:
    """DPO, sigmoid loss: ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``; rewards ``beta * (p - r)``.

    With ``label_smoothing`` e, robust DPO (TRL's ``loss_type="robust"``):
    ``(-(1 - e) log sigmoid(beta z) + e log sigmoid(-beta z)) / (1 - 2e)``.
    """
    assert reference is not None  # NEEDS_REFERENCE
    chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    logits = config.beta * (chosen - rejected)
    smoothing = config.label_smoothing
    losses = -F.logsigmoid(logits)
    if smoothing:
        losses = ((1 - smoothing) * losses + smoothing * F.logsigmoid(-logits)) / (1 - 2 * smoothing)
    return PreferenceTerms(losses, config.beta * chosen.detach(), config.beta * rejected.detach())


def ipo(policy: PairLogProbs, reference: PairLogProbs | None, config: PreferenceConfig) -> PreferenceTerms:
    """IPO on per-token log-ratios, as TRL computes it: ``(chosen/|yc| - rejected/|yr| - 1/(2 beta))^2``."""
    assert reference is not None  # NEEDS_REFERENCE
    chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    delta = chosen / policy.chosen_tokens.clamp(min=1) - rejected / policy.rejected_tokens.clamp(min=1)
    return PreferenceTerms((delta - 1 / (2 * config.beta)) ** 2, config.beta * chosen.detach(), config.beta * rejected.detach())


def simpo(policy: PairLogProbs, reference: PairLogProbs | None, config: PreferenceConfig) -> PreferenceTerms:
    """SimPO: length-normalised log-probs, no reference: ``-log sigmoid(beta * (ac - ar) - gamma)``; rewards ``beta * a``."""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    logits = chosen - rejected - config.simpo_gamma / config.beta
    return PreferenceTerms(-F.logsigmoid(config.beta * logits), config.beta * chosen.detach(), config.beta * rejected.detach())


def orpo(policy: PairLogProbs, reference: PairLogProbs | None, config: PreferenceConfig) -> PreferenceTerms:
    """ORPO, no reference: the chosen answer's mean token loss minus ``beta * log sigmoid(log odds ratio)``,
    on mean token log-probs ``a``: ``log odds = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar))``; rewards ``beta * a``."""
    chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return PreferenceTerms(-chosen - config.beta * F.logsigmoid(log_odds),
                           config.beta * chosen.detach(), config.beta * rejected.detach())


LOSSES: dict[str, Callable[[PairLogProbs, PairLogProbs | None, PreferenceConfig], PreferenceTerms]] = {
    Objective.DPO: dpo, Objective.IPO: ipo, Objective.SIMPO: simpo, Objective.ORPO: orpo,
}


def model_inputs(batch: dict) -> dict:
    """A preference batch's keys the model takes: without the pair ids, roles and pair count."""
    return {k: v for k, v in batch.items() if k not in PREFERENCE_KEYS}


def sequence_sums(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """``model(**inputs, sequence_log_probs=True)``'s per-sequence sums [2, n] (the loss-position head)."""
    if not getattr(model, "varpack_loss_head", False) and not getattr(getattr(model, "module", None), "varpack_loss_head", False):
        raise ValueError("a preference loss needs the loss-position head's per-sequence log-probs: "
                         "call loaders.train.loss_head.use_loss_position_head(model) first")
    return model(**inputs, **{SEQUENCE_LOG_PROBS: True}).sequence_log_probs


class Reference:
    """Where a batch's reference log-probs come from: a frozen ``model``, the policy with its LoRA adapter
    off (``adapter_off=True``), or a sidecar file (``ReferenceLogProbs``)."""

    def __init__(self, model: torch.nn.Module | None = None, *, adapter_off: bool = False,
                 stored: ReferenceLogProbs | None = None) -> None:
        if sum((model is not None, adapter_off, stored is not None)) != 1:
            raise ValueError("give exactly one reference: a frozen model, adapter_off=True, or stored log-probs")
        self.model, self.adapter_off, self.stored = model, adapter_off, stored

    def pairs(self, policy: torch.nn.Module, batch: dict, inputs: dict) -> PairLogProbs:
        """The reference's per-pair log-probs for ``batch`` (``inputs``: its model inputs on the device)."""
        roles = batch[ROLES]
        if self.stored is not None:
            chosen_ids = batch[PAIR_IDS][roles == CHOSEN]
            chosen, rejected = self.stored.lookup(chosen_ids)
            nothing = torch.zeros_like(chosen)
            return PairLogProbs(chosen.to(inputs["input_ids"].device), rejected.to(inputs["input_ids"].device), nothing, nothing)
        if self.model is not None and KEY_INDEX in inputs:  # the policy's attention is checked by preference_terms
            check_key_index_attention(getattr(self.model, "module", self.model))
        with torch.no_grad(), self._adapter_off(policy):
            sums = sequence_sums(self.model if self.model is not None else policy, inputs)
        return pair_log_probs(sums, roles)

    @contextlib.contextmanager
    def _adapter_off(self, policy: torch.nn.Module) -> Iterator[None]:
        if not self.adapter_off:
            yield
            return
        disable = getattr(policy, "disable_adapter", None) or getattr(getattr(policy, "module", None), "disable_adapter", None)
        if disable is None:
            raise ValueError(f"{type(policy).__name__} has no LoRA adapter to turn off (a PEFT model's disable_adapter)")
        with disable():
            yield


def preference_terms(model: torch.nn.Module, batch: dict, config: PreferenceConfig,
                     reference: Reference | None, inputs: dict | None = None) -> PreferenceTerms:
    """The per-pair losses and rewards of one preference batch under ``config``'s objective.

    ``inputs`` are the batch's model inputs already on the model's device (default: ``model_inputs(batch)``).
    A shared-prompt batch (``key_index``) needs an attention implementation that honours it.
    """
    if ROLES not in batch:
        raise ValueError(f"a {config.objective} objective {NOT_PREFERENCE}")
    inputs = model_inputs(batch) if inputs is None else inputs
    if KEY_INDEX in inputs:
        check_key_index_attention(getattr(model, "module", model))
    if config.objective in NEEDS_REFERENCE and reference is None:
        raise ValueError(f"--objective {config.objective} compares with a reference model; give one")
    policy = pair_log_probs(sequence_sums(model, inputs), batch[ROLES])
    ref = reference.pairs(model, batch, inputs) if reference is not None and config.objective in NEEDS_REFERENCE else None
    return LOSSES[config.objective](policy, ref, config)


class RewardMetrics:
    """TRL's reward metrics summed on the device over the pairs seen since the last ``pop`` (no sync per step)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.totals = torch.zeros(len(REWARD_METRICS) + 1, dtype=torch.float64, device=device)

    def add(self, terms: PreferenceTerms) -> None:
        chosen, rejected = terms.chosen_rewards.double(), terms.rejected_rewards.double()
        values = torch.stack((chosen.sum(), rejected.sum(), (chosen > rejected).double().sum(), (chosen - rejected).sum(),
                              torch.tensor(float(chosen.numel()), dtype=torch.float64, device=chosen.device)))
        self.totals += values.to(self.totals.device)

    def pop(self, distributed: bool = False) -> dict[str, float]:
        """The means over pairs since the last pop (over all ranks with ``distributed``), then start again."""
        totals = self.totals.clone()
        if distributed and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        self.totals.zero_()
        pairs = float(totals[-1].item())
        return {name: float(value) / pairs if pairs else 0.0 for name, value in zip(REWARD_METRICS, totals[:-1].tolist())}


@dataclass
class PairLoss:
    """A micro-batch's preference loss: its pairs' summed losses over the step's pairs, so that the loss of a step is
    the mean over all its pairs; a training batch's reward metrics are added to ``metrics``. Both of varpack's loops
    (``scripts/train.py``'s and ``PackedDPOTrainer``) take it."""

    config: PreferenceConfig
    reference: Reference | None
    metrics: RewardMetrics

    def __call__(self, model: torch.nn.Module, batch: dict, inputs: dict, pairs: torch.Tensor | float | None = None
                 ) -> torch.Tensor:
        """The loss of ``batch`` (``inputs``: its model inputs on the device); ``pairs`` defaults to its own."""
        return self.loss_and_terms(model, batch, inputs, pairs)[0]

    def loss_and_terms(self, model: torch.nn.Module, batch: dict, inputs: dict, pairs: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, PreferenceTerms]:
        """The loss of ``batch`` and its per-pair terms."""
        terms = preference_terms(model, batch, self.config, self.reference, model_inputs(inputs))
        if model.training:
            self.metrics.add(terms)
        return terms.losses.sum() / (terms.losses.numel() if pairs is None else pairs), terms


# ---- reference log-probs stored beside the build ---------------------------------------------------

REFERENCE_FILE = "reference_log_probs-{fingerprint}-{reference}.arrow"
REFERENCE_SCHEMA = pa.schema([
    pa.field("pair_id", pa.int64(), nullable=False),
    pa.field("chosen", pa.float64(), nullable=False),
    pa.field("rejected", pa.float64(), nullable=False),
])


def reference_identity(model: torch.nn.Module) -> str:
    """The identity of a reference model: the sha256 of its parameters' names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def reference_path(directory: str | os.PathLike[str], fingerprint: str, identity: str) -> Path:
    """Where the log-probs of the reference ``identity`` on the build ``fingerprint`` are stored in ``directory``."""
    return Path(directory) / REFERENCE_FILE.format(fingerprint=fingerprint[:16], reference=identity[:16])


def write_reference_log_probs(model: torch.nn.Module, build: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None,
                              device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None) -> Path:
    """Compute the reference ``model``'s log-probs of every pair of the preference ``build`` once and store them.

    The file (``reference_path``; in the build's local directory by default, else in ``directory``) is an Arrow table of ``pair_id``,
    ``chosen`` and ``rejected`` whose metadata holds the build's fingerprint and the model's identity;
    it is written atomically. ``model`` must have the loss-position head. Returns the path. A ``directory`` that does
    not exist (FileNotFoundError) or is no directory (NotADirectoryError) is refused before any pair is computed.
    """
    # One row a batch, one rank, in order: every row is read once.
    dataset = PackedIterableDataset(build, batch_rows=1, shuffle=False, rank=0, world_size=1)
    if directory is None:
        if not Path(build).exists():
            raise ValueError(f"{build}: not a local build; give the directory to store the reference log-probs in")
        directory = build if Path(build).is_dir() else Path(build).parent
    elif not Path(directory).exists():  # before the pass over the build, which may take long
        raise FileNotFoundError(f"{directory}: no such directory to store the reference log-probs in; make it or give another")
    elif not Path(directory).is_dir():
        raise NotADirectoryError(f"{directory}: not a directory; give the directory to store the reference log-probs in")
    if dataset.manifest.preference_layout is None:
        raise ValueError(f"{build}: not a build of preference pairs (pack it with --format preference)")
    if dataset.manifest.preference_layout == PreferenceLayout.SHARED_PROMPT:
        check_key_index_attention(model)
    identity = reference_identity(model)
    path = reference_path(directory, dataset.manifest.fingerprint, identity)
    pair_ids, chosen, rejected = [], [], []
    autocast = torch.autocast(torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    model.eval()
    dataset.set_epoch(0)
    for batch in dataset:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs(batch).items()}
        roles = cast(torch.Tensor, batch[ROLES])
        with torch.no_grad(), autocast:
            pairs = pair_log_probs(sequence_sums(model, inputs), roles)
        pair_ids.append(cast(torch.Tensor, batch[PAIR_IDS])[roles == CHOSEN].numpy())
        chosen.append(pairs.chosen.double().cpu().numpy())
        rejected.append(pairs.rejected.double().cpu().numpy())
    table = pa.table([np.concatenate(pair_ids), np.concatenate(chosen), np.concatenate(rejected)], schema=REFERENCE_SCHEMA)
    table = table.replace_schema_metadata({"fingerprint": dataset.manifest.fingerprint, "reference": identity})
    with atomic_file(path) as file, pa.ipc.new_file(file, table.schema) as writer:
        writer.write_table(table)
    return path


class ReferenceLogProbs:
    """Stored reference log-probs (``write_reference_log_probs``), looked up by pair id."""

    def __init__(self, path: str | os.PathLike[str], build: Manifest | str, identity: str | None = None) -> None:
        """Read ``path``; refuse it unless it was computed on the ``build`` (its manifest, or only its fingerprint)
        and, when given, by the reference model ``identity``.

        Given the manifest, the file must hold exactly the build's pairs: as many as it packed, each id once and
        below its ``num_example_ids``. Any file's ids must be non-negative and unique.
        """
        self.path = Path(path)
        fingerprint = build if isinstance(build, str) else build.fingerprint
        try:
            with pa.memory_map(str(self.path)) as source:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"{self.path}: not a readable reference log-probs file ({err})") from None
        metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if not table.schema.remove_metadata().equals(REFERENCE_SCHEMA):
            raise ValueError(f"{self.path}: columns {table.schema.names} are not {REFERENCE_SCHEMA.names}")
        if metadata.get("fingerprint") != fingerprint:
            raise ValueError(f"{self.path}: computed on the build {metadata.get('fingerprint')}, not this one ({fingerprint}); "
                             "compute the reference log-probs of this build")
        if identity is not None and metadata.get("reference") != identity:
            raise ValueError(f"{self.path}: computed by the reference model {metadata.get('reference')}, not {identity}")
        self.identity = metadata.get("reference", "")
        ids = table.column("pair_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        self._chosen = table.column("chosen").to_numpy()[order]
        self._rejected = table.column("rejected").to_numpy()[order]
        self._check_ids(None if isinstance(build, str) else build)

    def _check_ids(self, manifest: Manifest | None) -> None:
        """Refuse pair ids that are negative, repeated, or (given the build's manifest) not exactly its pairs."""
        ids = self._ids
        if ids.size and ids[0] < 0:
            raise ValueError(f"{self.path}: pair_id {int(ids[0])} is negative; not a reference log-probs file of this build")
        repeated = np.flatnonzero(ids[1:] == ids[:-1])
        if repeated.size:
            raise ValueError(f"{self.path}: pair_id {int(ids[repeated[0]])} appears more than once")
        if not np.isfinite(self._chosen).all() or not np.isfinite(self._rejected).all():
            raise ValueError(f"{self.path}: a log-prob is not finite")
        if manifest is None:
            return
        if ids.size and ids[-1] >= manifest.num_example_ids:
            raise ValueError(f"{self.path}: pair_id {int(ids[-1])} is not a pair of this build "
                             f"(its ids lie below {manifest.num_example_ids})")
        if ids.size != manifest.stats.pairs:
            raise ValueError(f"{self.path}: holds {ids.size} pairs; the build packed {manifest.stats.pairs}")

    def lookup(self, pair_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected reference log-probs of ``pair_ids`` (fp32); ValueError naming a missing pair."""
        ids = pair_ids.cpu().numpy()
        at = np.minimum(np.searchsorted(self._ids, ids), max(self._ids.size - 1, 0))
        missing = np.flatnonzero(self._ids[at] != ids) if self._ids.size else np.arange(ids.size)
        if missing.size:
            raise ValueError(f"{self.path}: holds no reference log-probs for pair {int(ids[missing[0]])}")
        return torch.from_numpy(self._chosen[at]).float(), torch.from_numpy(self._rejected[at]).float()


def pairs_in(batches: list[dict[str, Any]]) -> int:
    """The pairs in a window of preference batches: what its per-pair losses are divided by."""
    if any(NUM_PAIRS not in b for b in batches):
        raise ValueError(f"a preference objective {NOT_PREFERENCE}")
    return sum(int(b[NUM_PAIRS]) for b in batches)


def is_preference_build(dataset: PackedIterableDataset) -> bool:
    """Whether ``dataset`` (or a source of a mixture) is a build of preference pairs."""
    manifests = dataset.manifests().values() if isinstance(dataset, PackedMixture) else [dataset.manifest]
    return any(manifest.preference_layout is not None for manifest in manifests)
