"""PackedTrainer (transformers) and PackedSFTTrainer (TRL) on packed shards, on CPU with a tiny Llama.

- After N optimizer steps with gradient accumulation, the weights equal those of a plain loop
  that divides each window's summed loss by the window's loss tokens (or weights): the trainers'
  ``num_items_in_batch`` covers the whole window, across epoch ends too.
- Stopping at a checkpoint and resuming with ``resume_from_checkpoint=True`` ends with the same
  weights as an uninterrupted run: the loader continues at the exact batch.
- The loss reductions of ``loaders/loss_weights.py`` reach the trainers.
Two ranks under torchrun are tested through ``scripts/train.py --trainer hf`` in test_train.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_model
import torch
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.loss_weights import LOSS_WEIGHTS, batch_normalizer
from loaders.train.loss import weighted_causal_lm_loss

transformers = pytest.importorskip("transformers")

VOCAB = 128
CAPACITY = 64
STEPS = 4
GRAD_ACCUM = 3
LR = 0.5


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # 11 rows, 2 per batch: 5 batches an epoch, so windows of 3 batches run across epoch ends.
    lengths = np.random.default_rng(7).integers(4, 40, 30)
    return build_shard_dir(tmp_path_factory.mktemp("trainer-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB).path


def tiny_llama() -> torch.nn.Module:
    return tiny_model.tiny_llama(VOCAB, 2 * CAPACITY)


def dataset(shards, **kwargs) -> PackedIterableDataset:
    return PackedIterableDataset(shards, batch_rows=2, seed=0, **kwargs)


def plain_loop(shards, steps: int = STEPS, **kwargs) -> dict[str, torch.Tensor]:
    """SGD on windows of GRAD_ACCUM batches, each window's loss normalised over the whole window."""
    model, data = tiny_llama(), dataset(shards, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = iter(data)
    for _ in range(steps):
        window = []
        while len(window) < GRAD_ACCUM:
            batch = next(batches, None)
            if batch is None:
                batches = iter(data)
                continue
            window.append(batch)
        normalizer = sum(batch_normalizer(b) for b in window)
        for b in window:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            weighted_causal_lm_loss(logits, b["labels"], b.get(LOSS_WEIGHTS), normalizer).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def training_args(out, **kwargs):
    values = dict(output_dir=str(out), max_steps=STEPS, gradient_accumulation_steps=GRAD_ACCUM, learning_rate=LR,
                  optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_steps=2,
                  report_to="none", use_cpu=True, seed=0, disable_tqdm=True, bf16=False)
    return {**values, **kwargs}


def tokenizer():
    """A word-level tokenizer over the shards' ids: what TRL expects as the processing class."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t1", pad_token="t0"
    )


def make_trainer(kind: str, shards, out, data_kwargs=None, eval_dataset=None, **args):
    data_kwargs = data_kwargs or {}
    if kind == "hf":
        from loaders.train.hf_trainer import PackedTrainer

        train_args = transformers.TrainingArguments(**training_args(out, **args))
        return PackedTrainer(model=tiny_llama(), args=train_args, train_dataset=dataset(shards, **data_kwargs),
                             eval_dataset=eval_dataset)
    from trl import SFTConfig

    from loaders.train.hf_trainer import PackedSFTTrainer

    train_args = SFTConfig(**training_args(out, **args))
    return PackedSFTTrainer(model=tiny_llama(), args=train_args, train_dataset=dataset(shards, **data_kwargs),
                            processing_class=tokenizer(), eval_dataset=eval_dataset)


def assert_same_weights(actual: dict, expected: dict) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-5, msg=name)


def trained(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module", params=["hf", "sft"])
def straight(request, shards, tmp_path_factory):
    """An uninterrupted run of STEPS steps, checkpointed every 2: (kind, trainer, output directory)."""
    if request.param == "sft":
        pytest.importorskip("trl")
    out = tmp_path_factory.mktemp(f"straight-{request.param}")
    trainer = make_trainer(request.param, shards, out)
    trainer.train()
    return request.param, trainer, out


def test_trainer_equals_the_plain_loop_over_accumulated_windows(shards, straight):
    _, trainer, out = straight
    assert trainer.packed_dataset.epoch == 2  # 12 batches read, 5 an epoch: set_epoch moved it on twice
    assert_same_weights(trained(trainer), plain_loop(shards))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == STEPS and all(entry["real_tokens_per_s"] > 0 for entry in logs)
    saved = sorted(p.name for p in (out / "checkpoint-2").glob("loader_state*"))
    assert saved == ["loader_state.json"]


def test_resume_from_checkpoint_continues_at_the_exact_batch(shards, tmp_path, straight):
    kind, trainer, _ = straight
    make_trainer(kind, shards, tmp_path, max_steps=2).train()
    resumed = make_trainer(kind, shards, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    assert_same_weights(trained(resumed), trained(trainer))
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]
    finished = make_trainer(kind, shards, tmp_path)  # resuming a finished run trains no further
    finished.train(resume_from_checkpoint=True)
    assert finished.state.global_step == STEPS
    assert_same_weights(trained(finished), trained(trainer))


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_sequence_loss_reduction_reaches_the_trainer(shards, tmp_path, kind):
    if kind == "sft":
        pytest.importorskip("trl")
    weights = np.random.default_rng(1).uniform(0.5, 2.0, 30)
    data_kwargs = {"loss_reduction": "sequence", "example_weights": weights}
    trainer = make_trainer(kind, shards, tmp_path, data_kwargs=data_kwargs, max_steps=2)
    trainer.train()
    expected = plain_loop(shards, steps=2, **data_kwargs)
    assert_same_weights(trained(trainer), expected)
    token_mean = plain_loop(shards, steps=2)
    assert any(not torch.allclose(expected[k], token_mean[k], rtol=1e-4, atol=1e-5) for k in expected)


def test_evaluation_on_packed_shards_during_training(shards, tmp_path):
    from loaders.train.evaluate import evaluate_packed

    trainer = make_trainer("hf", shards, tmp_path, eval_dataset=dataset(shards, shuffle=False), eval_strategy="steps",
                           eval_steps=2)
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [2, 4]
    summary = evaluate_packed(trainer.model, shards).summary
    assert evals[-1]["eval_loss"] == pytest.approx(summary["mean_token_loss"], rel=1e-6)
    assert evals[-1]["eval_mean_example_loss"] == pytest.approx(summary["mean_example_loss"], rel=1e-6)
    assert evals[0]["eval_loss"] != pytest.approx(evals[-1]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("kind", ["hf", "trl"])
def test_an_eval_build_of_another_tokenizer_is_refused_in_one_line(shards, tmp_path, kind):
    """An eval build packed with another tokenizer than the training build's (its loss would be of ids the model
    never learned to read): refused in one line naming both builds and tokenizers, when given (before the output
    directory is made, alone or in a dict) and when passed to evaluate()."""
    import re

    if kind == "trl":
        pytest.importorskip("trl")
    other = build_shard_dir(tmp_path / "other", [20, 30, 40], capacity=CAPACITY, vocab_size=2 * VOCAB).path
    refused = re.escape(f"the eval build {other} and the training build {shards} were tokenized differently (tokenizer "
                        f"synthetic vocab-{VOCAB} vs synthetic vocab-{2 * VOCAB}): evaluate a build packed with the "
                        "training build's tokenizer")
    held_out = PackedIterableDataset(other, batch_rows=2)
    for eval_dataset in (held_out, {"held_out": held_out}):
        with pytest.raises(ValueError, match=f"^{refused}$"):
            make_trainer(kind, shards, tmp_path / "run", eval_dataset=eval_dataset)
        assert not (tmp_path / "run").exists()
    trainer = make_trainer(kind, shards, tmp_path / "run")
    with pytest.raises(ValueError, match=f"^{refused}$"):
        trainer.evaluate(held_out)


@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_each_eval_build_of_a_dict_is_evaluated_packed_under_its_name(shards, tmp_path, kind):
    """A dict eval_dataset, the trainer's or passed to evaluate(), went the stock Trainer path: each build is now
    evaluated as it is alone, under the Trainer's own per-key prefix; an entry of another tokenizer refuses the
    whole dict before any is evaluated."""
    from loaders.train.evaluate import evaluate_packed

    if kind == "sft":
        pytest.importorskip("trl")
    other = build_shard_dir(tmp_path / "other", [20, 30, 40, 12, 7], capacity=CAPACITY, vocab_size=VOCAB).path
    builds = {"a": PackedIterableDataset(shards, batch_rows=2), "b": PackedIterableDataset(other, batch_rows=1)}
    trainer = make_trainer(kind, shards, tmp_path / "run", eval_dataset=builds)
    for metrics in (trainer.evaluate(), trainer.evaluate(builds)):
        for name, build in (("a", shards), ("b", other)):
            summary = evaluate_packed(trainer.model, build).summary
            assert metrics[f"eval_{name}_loss"] == pytest.approx(summary["mean_token_loss"], rel=1e-6)
            assert metrics[f"eval_{name}_mean_example_loss"] == pytest.approx(summary["mean_example_loss"], rel=1e-6)
            assert metrics[f"eval_{name}_perplexity"] == pytest.approx(summary["token_perplexity"], rel=1e-6)
    assert trainer.evaluate("b")["eval_loss"] == pytest.approx(metrics["eval_b_loss"], rel=1e-6)
    logged = len(trainer.state.log_history)
    mismatched = build_shard_dir(tmp_path / "mismatched", [20, 30], capacity=CAPACITY, vocab_size=2 * VOCAB).path
    with pytest.raises(ValueError, match=r"^the eval build .*mismatched and the training build .* were tokenized differently"):
        trainer.evaluate({"a": builds["a"], "mismatched": PackedIterableDataset(mismatched, batch_rows=1)})
    assert len(trainer.state.log_history) == logged

def test_the_dataset_must_know_the_ranks(shards, tmp_path):
    from loaders.train.hf_trainer import PackedTrainer

    args = transformers.TrainingArguments(**training_args(tmp_path))
    data = PackedIterableDataset(shards, batch_rows=2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="reads rank 0 of 2 but training runs on 1"):
        PackedTrainer(model=tiny_llama(), args=args, train_dataset=data)


class MarkerPayload:
    """Unpickling this creates ``path``: the code a forged checkpoint would run."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_resume_reads_the_loader_state_as_json(shards, tmp_path, capsys):
    """The loader position is JSON, read without unpickling; an old pickled loader state is refused, not run."""
    import shutil

    from loaders.train.checkpoint import CheckpointError

    make_trainer("hf", shards, tmp_path, max_steps=2).train()
    checkpoint = tmp_path / "checkpoint-2"
    saved = json.loads((checkpoint / "loader_state.json").read_text())
    assert saved["next_batch"] == 2 * GRAD_ACCUM - 5 and saved["epoch"] == 1  # 6 batches read, 5 an epoch
    resumed = make_trainer("hf", shards, tmp_path)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS

    forged = tmp_path / "forged"
    shutil.copytree(checkpoint, forged)
    (forged / "loader_state.json").unlink()
    marker = tmp_path / "ran"
    torch.save(MarkerPayload(marker), forged / "loader_state.pt")
    with pytest.raises(CheckpointError, match=r"loader_state.pt: a loader state in the old pickle format, which is "
                                              r"not read because unpickling can run code"):
        make_trainer("hf", shards, tmp_path).train(resume_from_checkpoint=str(forged))
    assert not marker.exists()
    (forged / "loader_state.json").write_text(json.dumps(saved)[:20])
    with pytest.raises(CheckpointError, match=r"loader_state.json: not a loader state .*truncated or corrupt"):
        make_trainer("hf", shards, tmp_path).train(resume_from_checkpoint=str(forged))


def test_resume_passes_over_a_checkpoint_a_killed_save_left_incomplete(shards, tmp_path, straight):
    """A save killed before the loader state was written leaves checkpoint-4 without it: resume takes checkpoint-2."""
    kind, trainer, _ = straight
    make_trainer(kind, shards, tmp_path).train()
    (tmp_path / "checkpoint-4" / "loader_state.json").unlink()
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"")
    resumed = make_trainer(kind, shards, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    assert_same_weights(trained(resumed), trained(trainer))


def test_logged_epochs_and_speeds_are_the_true_counts(shards, tmp_path):
    """The trainer's own figures assume 8 samples a batch and an epoch of max_steps: the logs give the share of the
    dataset's epochs read, and the sequences and tokens per second actually trained on."""
    from loaders.train.hf_trainer import num_sequences

    with pytest.warns(UserWarning, match=r"per_device_train_batch_size=8 does not apply: each micro-batch is one "
                                         r"batch of the PackedIterableDataset \(2 packed rows\)"):
        trainer = make_trainer("hf", shards, tmp_path, per_device_train_batch_size=8)
    assert trainer.args.per_device_train_batch_size == 1
    trainer.train()
    batches_per_epoch = len(dataset(shards))
    assert batches_per_epoch == 5
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["epoch"] for entry in logs] == pytest.approx(
        [step * GRAD_ACCUM / batches_per_epoch for step in range(1, STEPS + 1)])  # 0.6, 1.2, 1.8, 2.4

    reference, read = dataset(shards), []
    while len(read) < STEPS * GRAD_ACCUM:
        read.extend(reference)
        reference.set_epoch(reference.epoch + 1)
    read = read[: STEPS * GRAD_ACCUM]
    sequences, tokens = sum(map(num_sequences, read)), sum(b["num_real_tokens"] for b in read)
    assert sequences == sum(b["cu_seq_lens_q"].numel() - 1 for b in read)  # unpadded: every entry is a sequence
    (final,) = [entry for entry in trainer.state.log_history if "train_runtime" in entry]
    assert (final["train_samples"], final["train_tokens"]) == (sequences, tokens)
    assert final["train_samples_per_second"] == pytest.approx(sequences / final["train_runtime"], rel=1e-3)
    assert final["train_tokens_per_second"] == pytest.approx(tokens / final["train_runtime"], rel=1e-3)
    assert final["epoch"] == pytest.approx(2.4)


class KilledMidSave(Exception):
    """Stands for a kill -9 at this point of a save: what is on disk then is what a kill leaves."""


def test_a_save_killed_under_save_total_limit_keeps_the_previous_checkpoint(shards, tmp_path, monkeypatch):
    """With save_total_limit=1 the trainer removed checkpoint-2 before checkpoint-4 held its loader state, so a kill
    there left no complete checkpoint and a resume started from step 0: the rotation now waits for the state."""
    from loaders.train import hf_trainer
    from loaders.train.checkpoint import latest_checkpoint

    write = hf_trainer.save_loader_state

    def killed_at_step_4(path, rank, state):
        if str(path).endswith("checkpoint-4"):
            raise KilledMidSave
        write(path, rank, state)

    monkeypatch.setattr(hf_trainer, "save_loader_state", killed_at_step_4)
    with pytest.raises(KilledMidSave):
        make_trainer("hf", shards, tmp_path, save_total_limit=1).train()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    monkeypatch.setattr(hf_trainer, "save_loader_state", write)
    resumed = make_trainer("hf", shards, tmp_path, save_total_limit=1, max_steps=6)
    resumed.train(resume_from_checkpoint=True)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6"]  # rotated once complete


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state.pth", "pytorch_model.bin", "trainer_state.json"])
def test_a_forged_trainer_file_is_refused_in_one_line(shards, tmp_path, name):
    """A checkpoint whose optimizer, RNG state or weights carry a pickle payload, or whose step is forged, is refused
    with a line naming the file (an UnpicklingError traceback before), and the payload never runs."""
    from loaders.train.checkpoint import CheckpointError

    make_trainer("hf", shards, tmp_path, max_steps=2).train()
    checkpoint = tmp_path / "checkpoint-2"
    marker = tmp_path / "ran"
    if name == "trainer_state.json":
        state = json.loads((checkpoint / name).read_text())
        (checkpoint / name).write_text(json.dumps({**state, "global_step": -5}))
        expected = f"{checkpoint / name}: global_step -5 is not the checkpoint's step (2); the file is corrupt or was edited"
    else:
        if name == "pytorch_model.bin":
            (checkpoint / "model.safetensors").unlink()
        torch.save({"state": MarkerPayload(marker)}, checkpoint / name)
        expected = (f"{checkpoint / name}: refused: it holds objects other than tensors and plain values, and loading "
                    "it would run their code")
    with pytest.raises(CheckpointError) as refused:
        make_trainer("hf", shards, tmp_path).train(resume_from_checkpoint=True)
    assert str(refused.value).endswith(expected) and "\n" not in str(refused.value)
    assert not marker.exists()
