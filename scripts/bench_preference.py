"""DPO steps on packed pairs against TRL's DPOTrainer on the same model and pairs: pairs/s and peak memory.

    python scripts/bench_preference.py --json benchmarks/bench_preference_h200.json       # on a GPU
    python scripts/bench_preference.py --model-config tiny --pairs 4 --device cpu         # a smoke run

Every method trains the same randomly initialised model (a Qwen2-0.5B shape by default, bf16 weights) on
the same ``--pairs`` synthetic pairs per step, prompts twice as long as each answer by default (the
shape of UltraFeedback-style data, prompt about 2x a completion), with a frozen reference and AdamW:

- ``separate``: the pairs packed as prompt+chosen, prompt+rejected (FA2 varlen, ``varpack_fa2``);
- ``shared-prompt``: each prompt once, both answers attending to it (FA2 varlen, K/V gathered);
- ``separate_compiled``, ``shared-prompt_compiled``: the same with each decoder layer compiled;
- ``trl_sdpa``, ``trl_sdpa_compiled``, ``trl_fa2``: TRL's ``DPOTrainer.compute_loss`` on its own padded
  batch of the pairs (its collator, its fused LM head, its reference forward), with transformers' sdpa,
  the same with each decoder layer compiled, and with transformers' flash_attention_2 on the padded batch.

A step is forward, backward and the optimizer step; each method runs ``--warmup`` steps, then ``--repeats``
timings of ``--steps`` steps, and reports the median pairs/s. The last line printed is one JSON object
with ``pairs_per_s`` per method and ``best_vs_trl`` (the fastest varpack method over the fastest TRL run).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loaders import PackedIterableDataset  # noqa: E402
from loaders.collate import NUM_PAIRS  # noqa: E402
from loaders.train import preference  # noqa: E402
from loaders.train.attention import attn_implementation_for  # noqa: E402
from loaders.train.loss_head import frozen_copy, use_loss_position_head  # noqa: E402
from loaders.train.models import compile_layers  # noqa: E402
from pipeline.write.preference_build import PreferencePair, preference_build  # noqa: E402

LAYOUTS = ("separate", "shared-prompt")
MODEL_CONFIGS = {
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768),
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}


def synthetic_pairs(count: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> list[PreferencePair]:
    """``count`` pairs of random ids, lengths uniform in [0.5, 1.5] x the given means."""
    rng = np.random.default_rng(seed)

    def ids(mean: int) -> list[int]:
        return rng.integers(2, vocab, int(rng.integers(mean // 2, mean * 3 // 2 + 1))).tolist()

    return [PreferencePair(ids(prompt), ids(completion), ids(completion)) for _ in range(count)]


def make_model(spec: str, attn: str, device: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(MODEL_CONFIGS[spec])
    config = AutoConfig.for_model(values.pop("model_type"), **values, use_cache=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):  # initialised where it runs: on a CPU a 0.5B init takes tens of seconds
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).train()


def packed_step(pairs, layout: str, compiled: bool, spec: str, device: str, capacity: int, beta: float,
                work: Path) -> tuple[Callable[[], None], int]:
    """One DPO step of varpack on ``pairs`` packed in ``layout`` (its decoder layers compiled or not); and the tokens it runs."""
    build = work / layout
    preference_build(build, pairs, layout=layout, capacity=capacity, rows_per_shard=1024,
                     vocab_size=MODEL_CONFIGS[spec]["vocab_size"])
    rows = len(PackedIterableDataset(build, batch_rows=1))
    batch = next(iter(PackedIterableDataset(build, batch_rows=rows, shuffle=False)))
    assert batch[NUM_PAIRS] == len(pairs)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    backend = "flash_attn" if device == "cuda" else "sdpa_segments"
    model = use_loss_position_head(make_model(spec, attn_implementation_for(backend), device))
    reference = preference.Reference(frozen_copy(model))
    if compiled:
        compile_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    config = preference.PreferenceConfig("dpo", beta=beta)
    inputs = preference.model_inputs(batch)

    def step() -> None:
        terms = preference.preference_terms(model, batch, config, reference, inputs)
        (terms.losses.sum() / batch[NUM_PAIRS]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, int(batch["num_real_tokens"])


def trl_step(pairs, attn: str, compiled: bool, spec: str, device: str, beta: float, work: Path) -> tuple[Callable[[], None], int]:
    """One step of TRL's DPOTrainer loss on its padded batch of ``pairs``; and the padded tokens it runs."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = MODEL_CONFIGS[spec]["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<1>", pad_token="<0>")

    def words(ids: list[int]) -> str:
        return " ".join(f"<{i}>" for i in ids)

    # The answers end with the EOS (<1>), as TRL adds it; the packed pairs have the same lengths + 1.
    # TRL joins prompt + answer as text, and appends the EOS text to an answer: spaces keep the words apart.
    data = datasets.Dataset.from_dict({"prompt": [words(p.prompt) for p in pairs],
                                       "chosen": [f" {words(p.chosen)} " for p in pairs],
                                       "rejected": [f" {words(p.rejected)} " for p in pairs]})
    model = make_model(spec, attn, device)
    reference = make_model(spec, attn, device).eval().requires_grad_(False)
    args = trl.DPOConfig(output_dir=str(work / f"trl-{attn}-{compiled}"), beta=beta, report_to="none",
                         bf16=device == "cuda", use_cpu=device == "cpu", per_device_train_batch_size=len(pairs),
                         max_length=None, disable_tqdm=True)
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)
    if compiled:
        compile_layers(trainer.model)
    examples = [trainer.train_dataset[i] for i in range(len(pairs))]
    if any(e["prompt_ids"] != p.prompt or e["chosen_ids"] != p.chosen + [1] for e, p in zip(examples, pairs)):
        raise ValueError("TRL tokenized the pairs into other tokens than the packed ones")
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-6)

    def step() -> None:
        trainer.compute_loss(trainer.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, int(batch["input_ids"].numel())


def measure(step: Callable[[], None], warmup: int, steps: int, repeats: int, device: str) -> list[float]:
    """Seconds per ``steps`` steps, ``repeats`` times, after ``warmup`` steps."""
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def summarize(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict:
    """The result object, with the ratios; written to ``--json`` when given."""
    rates = {name: r["pairs_per_s"] for name, r in results.items() if "pairs_per_s" in r}
    ours = {name: rate for name, rate in rates.items() if not name.startswith("trl")}
    trl_rates = {name: rate for name, rate in rates.items() if name.startswith("trl")}
    summary = {
        "bench": "preference",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": args.model_config,
        "pairs_per_step": args.pairs,
        "prompt_tokens_mean": args.prompt_tokens,
        "completion_tokens_mean": args.completion_tokens,
        "median_of": args.repeats,
        "methods": results,
        "pairs_per_s": rates,
        "best_trl": max(trl_rates, key=lambda name: trl_rates[name]) if trl_rates else None,
        "best_vs_trl": max(ours.values()) / max(trl_rates.values()) if ours and trl_rates else None,
        "shared_prompt_vs_separate": (rates["shared-prompt"] / rates["separate"]
                                      if "shared-prompt" in rates and "separate" in rates else None),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default="qwen2-0.5b")
    parser.add_argument("--pairs", type=int, default=16, help="pairs per step (default: 16)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="mean prompt length (default: 512)")
    parser.add_argument("--completion-tokens", type=int, default=256, help="mean length of each answer (default: 256)")
    parser.add_argument("--capacity", type=int, default=4096, help="packed row capacity (default: 4096)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    # The anchor first, so that a run cut short still holds a ratio.
    parser.add_argument("--methods", default="trl_sdpa,separate,shared-prompt,trl_fa2,trl_sdpa_compiled,separate_compiled,"
                                             "shared-prompt_compiled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="", help="also write the result here")
    args = parser.parse_args(argv)

    vocab = MODEL_CONFIGS[args.model_config]["vocab_size"]
    pairs = synthetic_pairs(args.pairs, args.prompt_tokens, args.completion_tokens, vocab)
    # The answers as TRL tokenizes them (with the EOS it appends), so both sides train the same tokens.
    packed_pairs = [PreferencePair(p.prompt, p.chosen + [1], p.rejected + [1]) for p in pairs]
    # Each method is "not reached" until measured, so a run stopped at its time limit says which it left out.
    results: dict[str, dict[str, Any]] = {method: {"error": "not reached"} for method in args.methods.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                if method.removesuffix("_compiled") in LAYOUTS:
                    step, tokens = packed_step(packed_pairs, method.removesuffix("_compiled"), method.endswith("_compiled"),
                                               args.model_config, args.device, args.capacity,
                                               args.beta, Path(tmp))
                else:
                    attn = {"trl_sdpa": "sdpa", "trl_sdpa_compiled": "sdpa", "trl_fa2": "flash_attention_2"}[method]
                    step, tokens = trl_step(pairs, attn, method == "trl_sdpa_compiled", args.model_config, args.device,
                                            args.beta, Path(tmp))
                times = measure(step, args.warmup, args.steps, args.repeats, args.device)
            except (ImportError, RuntimeError, ValueError) as err:  # a method that cannot run here is reported, not fatal
                results[method] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
                print(json.dumps({method: results[method]}), flush=True)
                continue
            rates = sorted(args.pairs * args.steps / t for t in times)
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
            results[method] = {"pairs_per_s": statistics.median(rates), "runs": rates, "tokens_per_step": tokens,
                               "peak_mem_gib": peak}
            print(json.dumps({method: results[method]}), flush=True)
            del step
            summarize(args, results)  # written after every method, so a run cut short keeps what it measured
    summary = summarize(args, results)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
