"""Does this model, backend and setting keep packed examples apart? A check on one real batch.

    python -m loaders.check --model NAME_OR_DIR --shards DIR [--attn BACKEND]

runs the model on one packed batch of the shards and, for a few of its examples, verifies that

- each example's logits equal those of the example run alone, within the dtype's tolerance;
- changing every token of the batch's first example changes no other example's logits.

It prints one line and exits 0 when both hold. Otherwise it names the setting at fault, found by
running again without it: an ``attention_mask`` in the batch (transformers then ignores
``cu_seq_lens`` and ``position_ids``), ``config.use_cache=True`` (transformers' sdpa and eager
paths then ignore the packed ``position_ids``), or, when neither is there or removing them does
not help, an attention backend that ignores ``cu_seq_lens``; and exits 1. Silent attention across
examples depends on the model, the backend and the settings together, so check the combination
you train with. ``check_isolation(model, batch)`` is the same check on a model and batch in hand.

    python -m loaders.check --model NAME_OR_DIR --shards DIR --ranks K --grad-accum G

checks data-parallel training instead: K processes with G packed micro-batches each compute one
optimizer step's gradients as ``scripts/train.py`` does, and one process the same examples
unpacked, one at a time; it prints the largest relative gradient error and the loss difference,
and exits 1 past ``--tolerance``, 2 on bad input, a failed rank or one still running at ``--timeout``
(``loaders.train.rank_check``).

Imports only torch at module import; transformers is imported to load the model.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch

from loaders.loss_weights import LOSS_WEIGHT_SUM, LOSS_WEIGHTS, LossReduction
from loaders.train.models import check_token_ids, load_causal_lm, model_inputs, vocab_size
from loaders.train.rank_check import (
    DEFAULT_TIMEOUT,
    DEFAULT_TOLERANCE,
    FAULTS,
    MAX_TIMEOUT,
    RankCheck,
    RankCheckInterrupted,
    check_ranks,
)

# Largest |packed - alone| logit gap allowed, relative to the largest logit: about what a few
# layers of rounding give in each dtype, far below what a leak across examples gives.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# Examples that are not perturbed run through the same kernels on the same shapes: their logits
# should not move at all; this leaves room for kernels that are not bitwise deterministic.
PERTURBATION_SHARE = 0.1
# The check compares logits, so the model computes no loss.
LOSS_INPUTS = ("labels", LOSS_WEIGHTS, LOSS_WEIGHT_SUM)
SETTINGS = {
    "attention_mask": "an attention_mask is in the batch: transformers then ignores cu_seq_lens and position_ids, so "
                      "packed examples attend to each other; feed batches without one (PackedIterableDataset's have none)",
    "use_cache": "config.use_cache=True: transformers' sdpa and eager attention then ignore the packed position_ids, so "
                 "examples attend to each other; set model.config.use_cache = False for training",
}


@dataclass(frozen=True)
class IsolationReport:
    """The outcome of ``check_isolation``: the gaps measured, and the setting at fault when it failed."""

    ok: bool
    examples: int  # examples compared with their runs alone
    alone_gap: float  # largest |packed - alone| logit difference over them
    perturbation_gap: float  # largest change of another example's logits when the first one changes
    tolerance: float
    attn_implementation: str
    culprit: str | None = None  # "attention_mask", "use_cache", "attention_mask+use_cache", "backend", "numerics"

    @property
    def verdict(self) -> str:
        """One line: what was checked and, on failure, what to change."""
        measured = (f"{self.examples} packed examples vs alone: largest logit gap {self.alone_gap:.3g} (tolerance "
                    f"{self.tolerance:.3g}); another example changed: largest change {self.perturbation_gap:.3g}")
        if self.ok:
            return f"ok: packed examples are isolated with attention {self.attn_implementation!r} ({measured})"
        if self.culprit == "backend":
            reason = (f"attention implementation {self.attn_implementation!r} ignores cu_seq_lens, so packed examples "
                      "attend to each other; use varpack_fa2, varpack_varlen or varpack_segments "
                      "(loaders.train.attention.attn_implementation_for('auto')) or flash_attention_2")
        elif self.culprit == "numerics":
            reason = ("no example sees another, but the logits differ from the examples run alone by more than the "
                      "tolerance: check position_ids handling and the dtype")
        else:
            assert self.culprit is not None  # every failed check names one
            reason = "; and ".join(SETTINGS[name] for name in self.culprit.split("+"))
        return f"FAILED: {reason} ({measured})"


def _sequences(batch: dict) -> list[tuple[int, int]]:
    cu = batch["cu_seq_lens_q"].tolist()
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def _gaps(model: torch.nn.Module, batch: dict, examples: int) -> tuple[float, float, float, int]:
    """(alone gap, perturbation gap, largest logit, examples compared) on ``batch`` as the model takes it."""
    device = next(model.parameters()).device
    inputs = model_inputs({k: v for k, v in batch.items() if k not in LOSS_INPUTS}, device, full_logits=True)
    sequences = _sequences(batch)
    input_ids = inputs["input_ids"]
    with torch.no_grad():
        packed = model(**inputs).logits[0].float()
        alone_gap, scale = 0.0, 0.0
        compared = sequences[:examples]
        for a, b in compared:
            alone = model(input_ids=input_ids[:, a:b]).logits[0].float()
            alone_gap = max(alone_gap, (packed[a:b] - alone).abs().max().item())
            scale = max(scale, alone.abs().max().item())
        first_a, first_b = sequences[0]
        changed = input_ids.clone()
        vocab = vocab_size(model)
        changed[:, first_a:first_b] = (changed[:, first_a:first_b] + 1 + vocab // 2) % vocab
        perturbed = model(**{**inputs, "input_ids": changed}).logits[0].float()
        others = torch.cat([(perturbed[a:b] - packed[a:b]).abs().flatten() for a, b in sequences[1:]])
    return alone_gap, others.max().item(), scale, len(compared)


def check_isolation(model: torch.nn.Module, batch: dict, examples: int = 4) -> IsolationReport:
    """Run the check on ``model`` (as configured) and ``batch`` (as the training loop feeds it).

    ``batch`` is a PackedIterableDataset batch, with whatever a pipeline adds to it (an
    ``attention_mask`` is exactly what is checked for); it must hold at least two examples.
    """
    if len(_sequences(batch)) < 2:
        raise ValueError("the batch holds fewer than two examples, so there is nothing to keep apart; use a batch "
                         "with several packed examples (more rows, or shards with more than one example a row)")
    dtype = next(model.parameters()).dtype
    relative = RELATIVE_TOLERANCE.get(dtype, RELATIVE_TOLERANCE[torch.bfloat16])
    config: Any = model.config  # a transformers PretrainedConfig; its attributes vary by model
    implementation = str(getattr(config, "_attn_implementation", None))

    def measure(candidate: dict) -> tuple[bool, float, float, float, int]:
        alone, perturbation, scale, compared = _gaps(model, candidate, examples)
        tolerance = relative * max(1.0, scale)
        return alone <= tolerance and perturbation <= PERTURBATION_SHARE * tolerance, alone, perturbation, tolerance, compared

    ok, alone, perturbation, tolerance, compared = measure(batch)
    report = IsolationReport(ok, compared, alone, perturbation, tolerance, implementation)
    if ok:
        return report
    # Run again without the suspect settings, fewest first; the first set whose removal passes is at fault.
    suspects = [name for name, present in (("attention_mask", "attention_mask" in batch),
                                           ("use_cache", bool(getattr(config, "use_cache", False)))) if present]
    for size in range(1, len(suspects) + 1):
        for removed in itertools.combinations(suspects, size):
            candidate = {k: v for k, v in batch.items() if k != "attention_mask"} if "attention_mask" in removed else batch
            cache = config.use_cache
            config.use_cache = cache and "use_cache" not in removed
            try:
                passed = measure(candidate)[0]
            finally:
                config.use_cache = cache
            if passed:
                return IsolationReport(False, compared, alone, perturbation, tolerance, implementation, "+".join(removed))
    culprit = "numerics" if perturbation <= PERTURBATION_SHARE * tolerance else "backend"
    return IsolationReport(False, compared, alone, perturbation, tolerance, implementation, culprit)


def first_batch_with_examples(dataset, examples: int, limit: int = 64) -> dict:
    """The first of the dataset's first ``limit`` batches holding more than ``examples`` examples, else the fullest."""
    best = None
    for _, batch in zip(range(limit), dataset):
        if best is None or len(_sequences(batch)) > len(_sequences(best)):
            best = batch
        if len(_sequences(batch)) > examples:
            break
    if best is None:
        raise ValueError("the dataset yields no batch: check its shards")
    return best


def make_parser(prog: str = "python -m loaders.check") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hub id or local directory of the causal LM to check")
    parser.add_argument("--shards", required=True, help="shard directory or manifest (local or fsspec URL)")
    parser.add_argument("--attn", default="auto", help="attention backend: auto (the best here), flash_attn, "
                        "torch_varlen, sdpa_segments, sdpa, or a transformers implementation (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights' dtype (default: auto, bfloat16 on CUDA and float32 on CPU)")
    parser.add_argument("--device", default="auto", help="cuda, cpu, ... (default: auto, cuda when available)")
    parser.add_argument("--examples", type=int, default=4, help="examples compared with their runs alone (default: 4)")
    parser.add_argument("--batch-rows", type=int, default=2, help="packed rows in the batch checked (default: 2)")
    parser.add_argument("--no-cache", action="store_true",
                        help="set config.use_cache=False first, as training scripts do (default: the model's config)")
    parser.add_argument("--attention-mask", action="store_true",
                        help="add an all-ones attention_mask to the batch, as a padding collator would (default: off)")
    ranks = parser.add_argument_group("data-parallel check (with --ranks): one step's gradients on K ranks vs one process")
    ranks.add_argument("--ranks", type=int, default=0, help="processes of the data-parallel check: gloo on CPU, NCCL with "
                       "one GPU each (default: 0, the isolation check instead)")
    ranks.add_argument("--grad-accum", type=int, default=2, help="micro-batches per rank in the step (default: 2)")
    ranks.add_argument("--loss-reduction", default="token", choices=[r.value for r in LossReduction],
                       help="token or sequence, as train.py takes it (default: token)")
    ranks.add_argument("--full-logits", action="store_true",
                       help="the model's own loss over every token, not the loss-position head (default: off)")
    ranks.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                       help=f"largest relative gradient error and loss difference accepted, in float32 "
                            f"(default: {DEFAULT_TOLERANCE:g})")
    ranks.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                       help="seconds the whole check may take; a rank still running then is killed with the others "
                            f"and the check exits 2 (default: {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g})")
    ranks.add_argument("--inject-fault", default=None, choices=tuple(FAULTS), help=argparse.SUPPRESS)
    return parser


def main_ranks(args: argparse.Namespace) -> int:
    """``--ranks K``: the data-parallel check; returns the exit status: 0 equal, 1 not, 2 bad input, a failed
    rank or the time limit, 128 + the signal on SIGTERM or SIGINT."""
    from schemas import VarpackError

    try:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # the verdict is the one line printed
        check = RankCheck(args.model, args.shards, args.ranks, args.grad_accum, args.batch_rows, args.attn,
                          args.loss_reduction, args.full_logits, args.device, args.tolerance, args.inject_fault,
                          args.timeout)
        report = check_ranks(check)
    except RankCheckInterrupted as err:
        print(f"varpack check: {err}", file=sys.stderr)
        return 128 + err.signum
    except (VarpackError, ValueError, RuntimeError, OSError) as err:
        print(f"varpack check: error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"varpack check: {report.verdict}")
    return 0 if report.ok else 1


def main(argv: list[str] | None = None, prog: str = "python -m loaders.check") -> int:
    """The command line; returns the exit status: 0 isolated, 1 not, 2 bad input."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    # Each check's own options, refused with the other rather than ignored.
    given = [name for name, value in vars(args).items() if value != parser.get_default(name)]
    isolation_only = [name for name in given if name in ("dtype", "examples", "no_cache", "attention_mask")]
    ranks_only = [name for name in given if name in ("grad_accum", "loss_reduction", "full_logits", "tolerance",
                                                     "timeout", "inject_fault")]
    if args.ranks and isolation_only:
        parser.error(f"--{isolation_only[0].replace('_', '-')} applies to the isolation check, not with --ranks "
                     "(the data-parallel check runs in float32 without a cache or attention mask)")
    if not args.ranks and ranks_only:
        parser.error(f"--{ranks_only[0].replace('_', '-')} applies to the data-parallel check: add --ranks K")
    if args.ranks:
        return main_ranks(args)
    from loaders.dataset import PackedIterableDataset
    from loaders.train.attention import attn_implementation_for
    from schemas import VarpackError

    try:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # the verdict is the one line printed

        device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        dataset = PackedIterableDataset(args.shards, batch_rows=args.batch_rows, shuffle=False, verify_checksum=False)
        batch = first_batch_with_examples(dataset, args.examples)
        model = load_causal_lm(args.model, attn_implementation_for(args.attn), dtype).to(device).eval()
        check_token_ids(model, int(batch["input_ids"].max()), args.shards)
        if args.no_cache:
            cast(Any, model.config).use_cache = False
        if args.attention_mask:
            batch = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
        report = check_isolation(model, batch, args.examples)
    except (VarpackError, ValueError, RuntimeError) as err:
        print(f"varpack check: error: {err}", file=sys.stderr)
        return 2
    print(f"varpack check: {report.verdict}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
