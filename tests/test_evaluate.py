"""Packed evaluation equals evaluating each example alone, reported by example id in source order.

CPU, fp32, a tiny random Llama: the per-example losses from ``evaluate_packed`` (several
examples per row, several rows per forward) equal each example's own mean token loss computed
unpacked, for every example of the build, and the summary's means follow from them.
``scripts/evaluate.py`` writes the same numbers, one JSON line per example.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import tiny_model
import torch
import torch.nn.functional as F
from shard_factory import build_shard_dir

from loaders.train.attention import attn_implementation_for
from loaders.train.evaluate import evaluate_packed

transformers = pytest.importorskip("transformers")

VOCAB = 300
CAPACITY = 64
NUM_EXAMPLES = 50
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "evaluate.py"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(9).integers(3, 45, NUM_EXAMPLES)
    return build_shard_dir(tmp_path_factory.mktemp("eval-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB)


def tiny_llama(backend: str) -> torch.nn.Module:
    return tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, attn_implementation_for(backend))


def unpacked_losses(model, shards) -> np.ndarray:
    """Each example's mean token loss, run alone (targets: loss-mask tokens after the first)."""
    losses = []
    with torch.no_grad():
        for i in range(NUM_EXAMPLES):
            tokens, mask = shards.example(i)
            ids = torch.from_numpy(tokens.astype(np.int64))[None]
            labels = torch.where(torch.from_numpy(mask.astype(bool)), ids[0], -100)[1:]
            logits = model(input_ids=ids).logits[0, :-1]
            losses.append(F.cross_entropy(logits, labels, ignore_index=-100).item())
    return np.array(losses)


@pytest.mark.parametrize(("backend", "head"), [("sdpa", "loss positions"), ("sdpa_segments", "loss positions"),
                                             ("sdpa_segments", "every token")])
def test_packed_evaluation_equals_unpacked_examples(shards, backend, head, monkeypatch):
    """The LM head runs at the labelled positions only where the loss-position head applies, over every token
    of a model it cannot serve (a logit modifier in its config); both equal each example run alone."""
    from loaders.train import loss_head

    model = tiny_llama(backend)
    logits_of_every_token = []
    original = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda x: logits_of_every_token.append(x.shape[1]) or original(x))
    if head == "every token":
        monkeypatch.setattr(loss_head, "LOGIT_MODIFIERS", ("varpack_test_modifier",))
        model.config.varpack_test_modifier = 2.0  # refused by check_supported; llama's forward does not apply it
    result = evaluate_packed(model, shards.path, batch_rows=3)
    assert bool(logits_of_every_token) == (head == "every token")  # the model's own LM head over [1, T]
    assert result.example_ids.tolist() == list(range(NUM_EXAMPLES))  # every example, in source order
    expected = unpacked_losses(model, shards)
    np.testing.assert_allclose(result.example_loss, expected, rtol=1e-5)
    summary = result.summary
    assert summary["mean_example_loss"] == pytest.approx(expected.mean(), rel=1e-5)
    targets = np.array([int(shards.example(i)[1][1:].sum()) for i in range(NUM_EXAMPLES)])
    assert result.target_tokens.tolist() == targets.tolist()
    assert summary["mean_token_loss"] == pytest.approx((expected * targets).sum() / targets.sum(), rel=1e-5)
    assert summary["token_perplexity"] == pytest.approx(math.exp(summary["mean_token_loss"]))


def evaluate_rank(rank: int, path: str, init_file: str, out: str) -> None:
    """One of two gloo ranks: ``evaluate_packed(distributed=True)``, every rank's result saved."""
    import torch.distributed as dist

    from loaders.train.distributed import finish_distributed_run

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = evaluate_packed(tiny_llama("sdpa_segments"), path, batch_rows=1, distributed=True)
    torch.save(result, f"{out}/rank{rank}.pt")
    finish_distributed_run()


def test_ranks_share_the_evaluation_and_each_gets_the_whole_result(tmp_path):
    """Two ranks evaluate alternate batches; examples split across rows (so across ranks) are summed back."""
    import torch.multiprocessing as mp

    lengths = np.random.default_rng(4).integers(3, 150, 30)
    split = build_shard_dir(tmp_path / "split", lengths, capacity=CAPACITY, vocab_size=VOCAB)
    assert split.manifest.stats.examples_split > 0
    alone = evaluate_packed(tiny_llama("sdpa_segments"), split.path, batch_rows=1)
    mp.spawn(evaluate_rank, args=(str(split.path), str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        shared = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert shared.example_ids.tolist() == alone.example_ids.tolist() == list(range(30))
        assert shared.target_tokens.tolist() == alone.target_tokens.tolist()
        np.testing.assert_allclose(shared.loss_sum, alone.loss_sum, rtol=1e-6)


def test_evaluate_script_writes_every_example(shards, tmp_path, capsys):
    # Loaded by path: a package named `evaluate` (Hugging Face's) may be installed.
    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    main = script.main

    model_dir = tmp_path / "model"
    tiny_llama("sdpa").save_pretrained(model_dir)
    out = tmp_path / "eval.jsonl"
    summary = main(["--model", str(model_dir), "--shards", str(shards.path), "--out", str(out), "--attn", "sdpa",
                    "--batch-rows", "2"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["example_id"] for r in records] == list(range(NUM_EXAMPLES))
    expected = unpacked_losses(tiny_llama("sdpa"), shards)
    np.testing.assert_allclose([r["loss"] for r in records], expected, rtol=1e-5)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["examples"] == NUM_EXAMPLES and summary["examples_without_targets"] == 0


@pytest.mark.parametrize(("args", "error"), [
    (["--batch-rows", "0"], "--batch-rows is 0; give a positive integer"),
    (["--out", "missing/eval.jsonl"], "--out missing/eval.jsonl: the directory missing does not exist; create it first"),
    (["--out", "."], "--out . is a directory; give a file name for the JSON lines"),
])
def test_bad_evaluate_options_fail_in_one_line_before_the_evaluation(shards, tmp_path, monkeypatch, capsys, args,
                                                                      error):
    """Checked before the model loads (the model here does not exist), not after a whole evaluation."""
    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        script.main(["--model", str(tmp_path / "no-model"), "--shards", str(shards.path), *args])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f" error: {error}")
    assert list(tmp_path.iterdir()) == []


class MarkerPayload:
    """Unpickling this creates ``path``: the code a downloaded model's weights would run."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_weights_are_refused_in_one_line_naming_the_file(shards, tmp_path):
    """A --model whose pytorch_model.bin carries a pickle payload: one line naming the file (an UnpicklingError
    traceback before); the payload never runs."""
    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model_dir = tmp_path / "model"
    tiny_llama("sdpa").save_pretrained(model_dir)
    (model_dir / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": MarkerPayload(marker)}, model_dir / "pytorch_model.bin")
    with pytest.raises(SystemExit) as refused:
        script.main(["--model", str(model_dir), "--shards", str(shards.path), "--attn", "sdpa"])
    assert str(refused.value) == (f"evaluate.py: error: {model_dir / 'pytorch_model.bin'}: its weights are refused: "
                                  "the file holds objects other than tensors, and loading them would run their code; "
                                  "use weights saved as safetensors")
    assert not marker.exists()


def test_a_full_disk_leaves_no_half_written_out(shards, tmp_path):
    """--out on a disk that fills up (a 1000-byte file size limit, EFBIG as ENOSPC): one line, and neither --out nor
    a temporary file is left (before, a traceback and a half-written .eval.jsonl.XXXX)."""
    import resource

    spec = importlib.util.spec_from_file_location("evaluate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model_dir = tmp_path / "model"
    tiny_llama("sdpa").save_pretrained(model_dir)
    out_dir = tmp_path / "results"
    out_dir.mkdir()

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))  # Python ignores SIGXFSZ: a write fails with EFBIG
    try:
        with pytest.raises(SystemExit) as refused:
            script.main(["--model", str(model_dir), "--shards", str(shards.path), "--attn", "sdpa",
                         "--out", str(out_dir / "eval.jsonl")])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(refused.value) == (f"evaluate.py: error: --out {out_dir / 'eval.jsonl'}: cannot be written "
                                  "(File too large); nothing was written")
    assert list(out_dir.iterdir()) == []
