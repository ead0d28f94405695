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

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from shard_factory import build_shard_dir

from loaders import PackedIterableDataset
from loaders.check import check_isolation, main
from loaders.train.models import check_token_ids
from loaders.train.rank_check import (
    DEFAULT_TOLERANCE,
    FAULTS,
    RankCheck,
    process_start,
    scratch_directory,
    step_examples,
)

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


@pytest.mark.parametrize("fault,reduction", [
    *((fault, "token") for fault in FAULTS if fault not in ("token_weights", "nan_gradient", "hung_rank")),
    ("token_weights", "sequence"),
])
def test_each_data_parallel_bug_fails_the_check(capsys, shards, tiny_model_dir, fault, reduction):
    """Each bug class injected on purpose: a per-rank or per-micro-batch mean, DDP's average not undone, packed
    examples attending to each other, position ids restarting a token late, a label across a boundary, every
    boundary a token late, per-example weights lost under the sequence reduction. The reference reads the
    examples from the build's rows, so a collator or weighting bug shared by every batch is caught too."""
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "2", "--loss-reduction", reduction, "--inject-fault", fault)
    assert status == 1 and "\n" not in line, line
    assert line.startswith("varpack check: FAILED: data-parallel gradients differ from one process's"), line
    assert gradient_error(line) > 10 * DEFAULT_TOLERANCE, line


def test_the_reference_reads_the_build_not_the_collator(shards, monkeypatch):
    """The reference's examples come from the shard rows: a collator that moves every boundary changes the
    batches but not them. Each is one segment of the build's first rows, labels -100 on its first token and
    where the loss mask is 0; under the sequence reduction each target weighs 1 / its example's targets."""
    import loaders.dataset

    def broken(*args, **kwargs):
        raise AssertionError("the reference collated a batch")

    monkeypatch.setattr(loaders.dataset, "collate_rows", broken)
    check = RankCheck("unused", str(shards), ranks=2, grad_accum=2, batch_rows=2, loss_reduction="sequence")
    examples = step_examples(check)
    reader = loaders.dataset.BuildReader(str(shards), loaders.dataset.LoaderOptions(shuffle=False))
    rows = [shard.row(i) for shard, i in reader.shard_rows(np.arange(8))]
    assert [e.input_ids.tolist() for e in examples] == [
        row["input_ids"][a:b].tolist() for row in rows for a, b in zip(row["cu_seqlens"][:-1], row["cu_seqlens"][1:])]
    for example in examples:  # the build splits no example here, so its targets are its own
        targets = int((example.targets != -100).sum())
        assert example.weights.tolist() == [1 / targets if t != -100 else 0.0 for t in example.targets.tolist()]
    first = rows[0]
    a, b = int(first["cu_seqlens"][0]), int(first["cu_seqlens"][1])
    mask = first["loss_mask"][a + 1 : b].astype(bool)
    assert examples[0].targets.tolist() == np.where(mask, first["input_ids"][a + 1 : b], -100).tolist()


def test_a_nan_gradient_fails_the_check(capsys, shards, tiny_model_dir):
    """A NaN in any parameter's gradient, not only the first's, fails the check (NaN never compares greater)."""
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "1", "--inject-fault", "nan_gradient")
    assert status == 1 and "\n" not in line, line
    assert "largest relative gradient error nan" in line, line


def test_a_hung_rank_ends_the_check_at_its_timeout(capsys, shards, tiny_model_dir):
    """A rank that never reaches its collective: the check kills every rank at --timeout and says so in one line."""
    started = time.monotonic()
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "1", "--timeout", "10", "--inject-fault", "hung_rank")
    assert status == 2 and "\n" not in line, line
    assert line.startswith("varpack check: error: ranks 0, 1 of 2 still running at --timeout 10 s"), line
    assert time.monotonic() - started < 30
    assert not multiprocessing.active_children()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_check_stops_its_ranks(shards, tiny_model_dir, signum):
    """SIGTERM or SIGINT to a running check: one line, exit 128 + the signal, no traceback, no rank left behind."""
    command = [sys.executable, "-m", "loaders.check", "--model", str(tiny_model_dir), "--shards", str(shards),
               "--attn", "sdpa_segments", "--ranks", "2", "--grad-accum", "1", "--inject-fault", "hung_rank"]
    check = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(session(check.pid)) < 3 and time.monotonic() < deadline:  # the check and its two ranks
            time.sleep(0.5)
        time.sleep(2)
        check.send_signal(signum)
        _, err = check.communicate(timeout=60)
        assert check.returncode == 128 + signum, err
        assert err.strip() == f"varpack check: interrupted by {signum.name}; its ranks were stopped", err
        deadline = time.monotonic() + 10
        while session(check.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session(check.pid)
    finally:
        if session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
def test_a_killed_check_leaves_no_rank_running_and_the_next_check_removes_its_scratch(
        capsys, monkeypatch, shards, tiny_model_dir, tmp_path):
    """SIGKILL of the check (the OOM killer, kill -9, a scheduler's hard stop), which no handler sees: its ranks,
    one hung and one waiting for it in a collective, end with it at once instead of keeping their memory. The
    scratch directory it could not remove (where the ranks' gradients go) is removed by the next check, which
    leaves alone a live check's, another user's, a link and what it points to; a directory whose process id was
    taken by another process since (another start time) goes too."""
    command = [sys.executable, "-m", "loaders.check", "--model", str(tiny_model_dir), "--shards", str(shards),
               "--attn", "sdpa_segments", "--ranks", "2", "--grad-accum", "1", "--inject-fault", "hung_rank"]
    check = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        stuck_ranks(check.pid)
        check.kill()
        check.wait()
        deadline = time.monotonic() + 5
        while session(check.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not session(check.pid), [cmdline(pid) for pid in session(check.pid)]
    finally:
        if session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)
    (killed,) = tmp_path.glob("varpack-check-*")
    assert killed.name.startswith(f"varpack-check-{check.pid}-"), killed.name
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with contextlib.ExitStack() as still_running:
        live = still_running.enter_context(scratch_directory())  # this process's: a check still running
        (live / "gradients.pt").write_bytes(b"in use")
        taken = tmp_path / killed.name.replace(f"-{check.pid}-", f"-{os.getpid()}-")  # this pid, another start time
        taken.mkdir()
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "keep.txt").write_text("not a check's")
        link = tmp_path / killed.name.replace(f"-{check.pid}-", "-999999999-")  # named as a dead check's
        link.symlink_to(victim)
        foreign = tmp_path / killed.name.replace(f"-{check.pid}-", "-999999998-")  # a dead check of another user's
        foreign.mkdir()
        if os.getuid() == 0:
            os.chown(foreign, 12345, 12345)
        else:
            foreign.rmdir()
        status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn",
                           "sdpa_segments", "--ranks", "2", "--grad-accum", "1")
        assert status == 0, line
        left = sorted(p.name for p in tmp_path.glob("varpack-check-*"))
        assert left == sorted([live.name, link.name] + ([foreign.name] if os.getuid() == 0 else [])), left
        assert (live / "gradients.pt").read_bytes() == b"in use" and link.is_symlink()
        assert (victim / "keep.txt").read_text() == "not a check's"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("rank", [1, 0], ids=["asleep", "waiting-in-a-collective"])
def test_a_rank_ended_by_sigint_is_named_at_once(shards, tiny_model_dir, rank):
    """SIGINT to one rank (torch's spawn wrapper would take it for a stop and exit 0, a rank done), whether it is in
    Python (rank 1, asleep under hung_rank) or blocked in a gloo collective (rank 0, waiting for rank 1), where a
    Python signal handler never runs: the check ends at once, naming that rank, exit 2, one line, instead of blaming
    another rank or waiting out --timeout."""
    command = [sys.executable, "-m", "loaders.check", "--model", str(tiny_model_dir), "--shards", str(shards),
               "--attn", "sdpa_segments", "--ranks", "2", "--grad-accum", "1", "--timeout", "100",
               "--inject-fault", "hung_rank"]
    check = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        by_start = sorted(stuck_ranks(check.pid), key=lambda pid: (process_start(pid) or 0, pid))  # rank 0 first
        time.sleep(2)  # well inside the collective
        os.kill(by_start[rank], signal.SIGINT)
        sent = time.monotonic()
        _, err = check.communicate(timeout=60)
        assert check.returncode == 2, err
        assert err.strip() == f"varpack check: error: rank {rank} ended by SIGINT", err
        assert time.monotonic() - sent < 15
    finally:
        if session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
def test_a_rank_sent_sigint_while_it_starts_up_is_named_in_one_line(shards, tiny_model_dir):
    """SIGINT to a rank still importing torch (the ranks start with it blocked, so it waits for the rank's own
    handling): one line naming the rank, exit 2, no KeyboardInterrupt traceback."""
    command = [sys.executable, "-m", "loaders.check", "--model", str(tiny_model_dir), "--shards", str(shards),
               "--attn", "sdpa_segments", "--ranks", "2", "--grad-accum", "1", "--timeout", "100",
               "--inject-fault", "hung_rank"]
    check = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, ranks = time.monotonic() + 120, []
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [pid for pid in session(check.pid) if "--multiprocessing-fork" in cmdline(pid)]
        time.sleep(0.4)  # rank 1 is still importing
        os.kill(max(ranks, key=lambda pid: (process_start(pid) or 0, pid)), signal.SIGINT)
        _, err = check.communicate(timeout=60)
        assert check.returncode == 2, err
        assert err.strip() == "varpack check: error: rank 1 ended by SIGINT", err
    finally:
        if session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)


def stuck_ranks(sid: int) -> list[int]:
    """The two ranks of the check whose session is ``sid``, once both are stuck (under 2% of a core): under the
    ``hung_rank`` fault, the last asleep and the other waiting for it in a collective."""
    deadline = time.monotonic() + 120
    ranks: list[int] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        ranks = [pid for pid in session(sid) if "--multiprocessing-fork" in cmdline(pid)]
    assert len(ranks) == 2, session(sid)
    used = cpu_time(ranks)
    while time.monotonic() < deadline:
        time.sleep(1)
        used, before = cpu_time(ranks), used
        if all(now - then <= 2 for now, then in zip(used, before)):
            break
    return ranks


def session(sid: int) -> list[int]:
    """The processes of session ``sid`` still running (an orphan's zombie is no process left running)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _, _, process_session = stat.read_text().rsplit(")", 1)[1].split()[:4]
            if int(process_session) == sid and state != "Z":
                found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> str:
    """The command line of process ``pid``, or "" when it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def cpu_time(pids: list[int]) -> list[int]:
    """The CPU time (user and system clock ticks) each of ``pids`` has used so far."""
    used = []
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        used.append(int(fields[11]) + int(fields[12]))
    return used


@pytest.mark.parametrize("args,error", [
    (["--grad-accum", "1000"], "rank 0 of 2 gets 6 batches of 2 rows, fewer than --grad-accum 1000"),
    (["--tolerance", "0"], "--tolerance is 0.0; give a positive number"),
    (["--ranks", "-1"], "--ranks is -1; give a positive integer"),
    (["--timeout", "0"], "--timeout is 0; give a positive number of seconds"),
    (["--timeout", "1e14"], "--timeout is 1e+14; give a positive number of seconds, at most 1e+06"),
    (["--device", "bogus"], "--device is 'bogus'; with --ranks give one of auto, cpu, cuda"),
    (["--device", "cuda:1"], "--device is 'cuda:1'; with --ranks give one of auto, cpu, cuda"),
])
def test_the_data_parallel_check_refuses_bad_input_in_one_line(capsys, shards, tiny_model_dir, args, error):
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--ranks", "2", *args)
    assert status == 2 and "\n" not in line, line
    assert line.startswith("varpack check: error:") and error in line, line


def test_token_ids_outside_the_models_vocabulary_are_one_line_before_the_ranks_start(capsys, shards, tmp_path):
    """A build of another tokenizer (ids up to 299) against a model of 100 tokens: refused naming the build, exit 2
    (not 1, which says the gradients differ), no traceback, no rank started."""
    import tiny_model

    tiny_model.tiny_llama(100, 2 * CAPACITY).save_pretrained(tmp_path / "model")
    capsys.readouterr()  # what saving the model printed
    status, line = run(capsys, "--model", str(tmp_path / "model"), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "1")
    assert status == 2 and "\n" not in line, line
    assert re.fullmatch(rf"varpack check: error: {re.escape(str(shards))}: token id 2\d\d is outside the model's "
                        r"vocabulary of 100: these shards were built with another tokenizer", line), line
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("vocab", [VOCAB, 100])
def test_the_vocabulary_of_an_adapter_with_trainable_tokens_is_read_from_its_embedding_weight(capsys, shards, tmp_path, vocab):
    """peft's wrapper of trainable tokens around the input embeddings has their weight but no ``num_embeddings``: an
    adapter of the build's vocabulary is checked, one of a smaller vocabulary is refused in one line, exit 2."""
    import tiny_model

    peft = pytest.importorskip("peft")
    tiny_model.tiny_llama(vocab, 2 * CAPACITY).save_pretrained(tmp_path / "base")  # the adapter names its base by path
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], trainable_token_indices={"embed_tokens": [5, vocab - 1]})
    peft.get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    capsys.readouterr()  # what saving the model printed
    status, line = run(capsys, "--model", str(tmp_path / "adapter"), "--shards", str(shards), "--attn", "sdpa_segments")
    assert "Traceback" not in line, line
    line = line.splitlines()[-1]
    if vocab == VOCAB:
        assert status == 0 and line.startswith("varpack check: ok: packed examples are isolated"), line
    else:
        assert status == 2 and f"is outside the model's vocabulary of {vocab}: these shards" in line, line


def test_a_model_without_an_input_embedding_weight_is_one_error_naming_it():
    """A model whose input embeddings hold no weight has no vocabulary to check ids against: a ValueError (one line,
    exit 2, from the command) naming what its get_input_embeddings() gives, not an AttributeError."""
    import tiny_model

    model = tiny_model.tiny_llama(VOCAB, 2 * CAPACITY)
    model.set_input_embeddings(torch.nn.Identity())
    with pytest.raises(ValueError, match=r"the model \(LlamaForCausalLM\) has no input embedding weight .*gives Identity"):
        check_token_ids(model, 5, "shards")


@pytest.fixture
def small_tmpdir(tmp_path, monkeypatch):
    """A temporary directory on a 120 KiB tmpfs, less than the tiny model's gradients (about 150 KB)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.setattr(tempfile, "tempdir", str(small))
    yield small
    subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("when", ["before the ranks start", "filled meanwhile"])
def test_a_full_scratch_directory_is_one_line_naming_it(capsys, monkeypatch, shards, tiny_model_dir, small_tmpdir,
                                                         when):
    """No room in $TMPDIR for the ranks' gradients: one line naming the scratch directory and "no space", exit 2,
    no traceback, nothing left there; found before any rank starts, or (a disk filled meanwhile) when rank 0
    cannot write them, nor why it failed."""
    import loaders.train.rank_check

    if when == "filled meanwhile":
        monkeypatch.setattr(loaders.train.rank_check, "check_scratch_space", lambda scratch, model: None)
    status, line = run(capsys, "--model", str(tiny_model_dir), "--shards", str(shards), "--attn", "sdpa_segments",
                       "--ranks", "2", "--grad-accum", "1")
    assert status == 2 and "\n" not in line, line
    assert re.match(rf"varpack check: error: (rank 0 failed: )?no space (left )?in the scratch directory "
                    rf"{re.escape(str(small_tmpdir))}/varpack-check-\S+[ ;]", line), line
    # torch's spawn may leave its own empty error file (pytorch-errorfile-*) of a rank that failed; no scratch is left.
    assert not [p for p in small_tmpdir.iterdir() if not p.name.startswith("pytorch-errorfile-")]
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("args,error", [
    (["--ranks", "2", "--attention-mask"], "--attention-mask applies to the isolation check, not with --ranks"),
    (["--grad-accum", "4"], "--grad-accum applies to the data-parallel check: add --ranks K"),
    (["--timeout", "60"], "--timeout applies to the data-parallel check: add --ranks K"),
])
def test_an_option_of_the_other_check_is_refused_not_ignored(capsys, args, error):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--shards", "s", *args])
    assert exit_.value.code == 2 and error in capsys.readouterr().err


def test_a_bad_loss_reduction_lists_the_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--shards", "s", "--ranks", "2", "--loss-reduction", "mean"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'mean' (choose from 'token', 'sequence')" in err, err


def test_looking_for_a_killed_checks_scratch_never_stops_a_check(tmp_path, monkeypatch, caplog):
    """The clean-up before a check passes over, with a warning, what it cannot list or remove: a temporary directory
    that may be written but not listed, and a dead check's directory deeper than rmtree's recursion; the check's own
    scratch directory is still made."""
    import shutil

    from loaders.train import rank_check

    deep = tmp_path / f"varpack-check-{dead_pid()}-1-{rank_check.host_scope()}-deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    depth = sys.getrecursionlimit() + 100
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch_directory() as scratch:
        assert scratch.is_dir()
    assert "could not remove" in caplog.text and str(deep) in caplog.text
    for level in range(depth, 0, -1):  # removed from the bottom up, as rmtree could not
        os.rmdir(deep / ("d/" * level))
    deep.rmdir()

    listed_not = tmp_path / "drop-box"
    listed_not.mkdir(mode=0o300)
    # Root reads any directory: drop the two capabilities that let it, as a user's check would run.
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.getuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to run without root's directory capabilities")
    code = ("import tempfile; from loaders.train.rank_check import scratch_directory\n"
            "with scratch_directory() as scratch: print('made', scratch)")
    done = subprocess.run([*drop, sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(listed_not)})
    assert done.returncode == 0 and "made" in done.stdout, done.stderr
    assert "could not look for scratch directories" in done.stderr


def dead_pid() -> int:
    """The id of a process that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.skipif(subprocess.run(["unshare", "-pfT", "true"], capture_output=True).returncode != 0,
                    reason="needs unshare with pid and time namespaces")
def test_the_scratch_scope_names_the_time_namespace_and_needs_this_pid_namespaces_proc():
    """A start time read in another time namespace is shifted, and a pid namespace that shows the host's /proc gives
    another process's start time for this pid: either would make a live check's directory look abandoned. So the
    scope differs across time namespaces, and is None (nothing removed, nothing named after this process) without a
    /proc of this pid namespace."""
    from loaders.train.rank_check import host_scope

    code = "from loaders.train.rank_check import host_scope; print(host_scope())"
    other_time = subprocess.run(["unshare", "-T", "--boottime", "100000", sys.executable, "-c", code],
                                capture_output=True, text=True, check=True).stdout.strip()
    assert other_time not in ("None", host_scope())
    host_proc = subprocess.run(["unshare", "-pf", sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout.strip()
    assert host_proc == "None"
