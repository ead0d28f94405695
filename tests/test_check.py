"""``python -m loaders.check`` on CPU: a tiny random Llama saved with ``save_pretrained``.

It passes with the backends that keep examples apart, and fails, naming the setting, for each
way packed examples come to attend to each other: a cache enabled (transformers' sdpa then
ignores the packed position ids), an attention mask in the batch, and an attention backend that
ignores ``cu_seq_lens``.

With ``--ranks K --grad-accum G`` it checks data-parallel training instead: 2 gloo ranks of 2
packed micro-batches against one process on the same examples one at a time; it passes, and fails
on each data-parallel bug injected on purpose.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.check import check_isolation, main
from loaders.train.rank_check import DEFAULT_TOLERANCE, FAULTS

transformers = pytest.importorskip("transformers")

VOCAB = 300
CAPACITY = 64
WHOLE_ROW = "test_whole_row_causal"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(4).integers(4, 40, 60)
    return build_shard_dir(tmp_path_factory.mktemp("check-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB).path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama as a user has it on disk; its config keeps the default use_cache=True."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * CAPACITY)
    path = tmp_path_factory.mktemp("model")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def whole_row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A backend that ignores cu_seq_lens: causal attention over the whole packed row."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def run(capsys, *args: str) -> tuple[int, str]:
    status = main(list(args))
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).strip()


@pytest.mark.parametrize("attn", ["sdpa_segments", "sdpa"])
def test_isolated_backends_pass(capsys, shards, model_dir, attn):
    status, line = run(capsys, "--model", str(model_dir), "--shards", str(shards), "--attn", attn, "--no-cache")
    assert status == 0, line
    assert line.startswith("varpack check: ok:") and "\n" not in line


def test_per_example_backend_passes_with_the_cache_on(capsys, shards, model_dir):
    """varpack_segments reads cu_seq_lens itself, so the config's use_cache=True does not matter there."""
    status, line = run(capsys, "--model", str(model_dir), "--shards", str(shards), "--attn", "sdpa_segments")
    assert status == 0, line


def test_a_cache_enabled_is_named(capsys, shards, model_dir):
    status, line = run(capsys, "--model", str(model_dir), "--shards", str(shards), "--attn", "sdpa")
    assert status == 1
    assert line.startswith("varpack check: FAILED: config.use_cache=True") and "use_cache = False" in line


def test_an_attention_mask_is_named(capsys, shards, model_dir):
    status, line = run(capsys, "--model", str(model_dir), "--shards", str(shards), "--attn", "sdpa", "--no-cache",
                       "--attention-mask")
    assert status == 1
    assert line.startswith("varpack check: FAILED: an attention_mask is in the batch")


def test_a_backend_ignoring_cu_seq_lens_is_named(shards, model_dir):
    transformers.AttentionInterface.register(WHOLE_ROW, whole_row_attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=WHOLE_ROW).eval()
    model.config.use_cache = False
    batch = next(iter(PackedIterableDataset(shards, batch_rows=2, shuffle=False)))
    report = check_isolation(model, batch)
    assert not report.ok and report.culprit == "backend"
    assert report.perturbation_gap > 100 * report.tolerance
    assert f"attention implementation '{WHOLE_ROW}' ignores cu_seq_lens" in report.verdict


def test_bad_input_is_one_line_and_exit_2(capsys, shards, tmp_path):
    status, line = run(capsys, "--model", str(tmp_path / "missing"), "--shards", str(shards), "--attn", "sdpa")
    assert status == 2
    assert line.startswith("varpack check: error: --model") and "\n" not in line


# ---- the data-parallel check: python -m loaders.check --ranks K --grad-accum G ---------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """tests/tiny_model.py's Llama, saved as a user has it on disk."""
    import tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.tiny_llama(VOCAB, 2 * CAPACITY).save_pretrained(path)
    return path


def gradient_error(line: str) -> float:
    return float(re.search(r"largest relative gradient error (\S+)", line)[1])


@pytest.mark.parametrize("reduction,head", [("token", "--full-logits"), ("sequence", None)])
def test_two_ranks_of_two_micro_batches_equal_one_process(capsys, shards, tiny_model_dir, reduction, head):
    """2 gloo ranks x 2 micro-batches of packed rows give the gradients of one process taking the same
    examples one at a time, per token and per sequence, through the model's loss and the loss-position head."""
    args = ["--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments", "--ranks", "2",
            "--grad-accum", "2", "--loss-reduction", reduction, *([head] if head else [])]
    status, line = run(capsys, *args)
    assert status == 0, line
    assert line.startswith("varpack check: ok: data-parallel gradients equal one process's (2 ranks (gloo) x 2 "
                           "micro-batches") and "\n" not in line
    assert gradient_error(line) < DEFAULT_TOLERANCE / 10


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_data_parallel_bug_fails_the_check(capsys, shards, tiny_model_dir, fault):
    """Each bug class injected on purpose: a per-rank or per-micro-batch mean, DDP's average not undone, packed
    examples attending to each other, position ids restarting a token late, a label across a boundary."""
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "2", "--inject-fault", fault)
    assert status == 1 and "\n" not in line, line
    assert line.startswith("varpack check: FAILED: data-parallel gradients differ from one process's"), line
    assert gradient_error(line) > 10 * DEFAULT_TOLERANCE, line


@pytest.mark.parametrize("args,error", [
    (["--grad-accum", "1000"], "rank 0 of 2 gets 6 batches of 2 rows, fewer than --grad-accum 1000"),
    (["--tolerance", "0"], "--tolerance is 0.0; give a positive number"),
    (["--ranks", "-1"], "--ranks is -1; give a positive integer"),
])
def test_the_data_parallel_check_refuses_bad_input_in_one_line(capsys, shards, tiny_model_dir, args, error):
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--ranks", "2", *args)
    assert status == 2 and "\n" not in line, line
    assert line.startswith("varpack check: error:") and error in line, line


@pytest.mark.parametrize("args,error", [
    (["--ranks", "2", "--attention-mask"], "--attention-mask applies to the isolation check, not with --ranks"),
    (["--grad-accum", "4"], "--grad-accum applies to the data-parallel check: add --ranks K"),
])
def test_an_option_of_the_other_check_is_refused_not_ignored(capsys, args, error):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--shards", "s", *args])
    assert exit_.value.code == 2 and error in capsys.readouterr().err
