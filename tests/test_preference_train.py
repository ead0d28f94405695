"""Preference pairs on the read side: batches, exact shared-prompt attention, DPO/IPO/SimPO/ORPO, TRL parity.

Builds are written with the preference row schema (``shard_factory.build_preference_dir``) and read
by the real loader; the model is the tiny random Llama of ``tiny_model`` on ``varpack_segments``
(sdpa per sequence; with a shared prompt, each branch over the prompt's keys and its own).
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import tiny_model
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_factory import PreferencePair, build_preference_dir

from loaders import PackedIterableDataset
from loaders.collate import CHOSEN, IGNORE_INDEX, KEY_INDEX, NUM_PAIRS, PAIR_IDS, PROMPT, REJECTED, ROLES
from loaders.train.attention import register_segment_attention
from loaders.train.loss_head import frozen_copy, use_loss_position_head
from loaders.train.preference import (
    PreferenceConfig,
    Reference,
    ReferenceLogProbs,
    model_inputs,
    pair_log_probs,
    preference_terms,
    reference_identity,
    sequence_sums,
    write_reference_log_probs,
)

transformers = pytest.importorskip("transformers")

VOCAB = 128
CAPACITY = 64
LAYOUTS = ("separate", "shared-prompt")


def random_pairs(count: int, seed: int = 0, longest: int = 12) -> list[PreferencePair]:
    """Pairs of random ids in [2, VOCAB), prompts of 1 to ``longest`` tokens (1 gives the separate shape)."""
    rng = np.random.default_rng(seed)
    return [PreferencePair(*(rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(1, longest, 3)))
            for _ in range(count)]


def tiny_llama() -> torch.nn.Module:
    return tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, register_segment_attention())


@pytest.fixture(scope="module")
def pairs() -> list[PreferencePair]:
    return random_pairs(24)


@pytest.fixture(scope="module", params=LAYOUTS)
def build(request, pairs, tmp_path_factory):
    """(layout, build directory) of ``pairs``."""
    path = tmp_path_factory.mktemp(f"pairs-{request.param}")
    build_preference_dir(path, pairs, layout=request.param, capacity=CAPACITY)
    return request.param, path


def batches(path, **kwargs) -> list[dict]:
    """Every batch of one epoch, in order, three rows a batch."""
    return list(PackedIterableDataset(path, **{"batch_rows": 3, "shuffle": False, **kwargs}))


def unpacked_log_probs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The summed log-prob of ``completion`` after ``prompt``, computed on prompt + completion alone."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion, device=device)[:, None]).sum()


def unpacked_pairs(model, pairs: list[PreferencePair], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.stack([unpacked_log_probs(model, pairs[i].prompt, pairs[i].chosen) for i in ids])
    rejected = torch.stack([unpacked_log_probs(model, pairs[i].prompt, pairs[i].rejected) for i in ids])
    return chosen, rejected


# ---- the batch -------------------------------------------------------------------------------


def test_batches_carry_pair_ids_and_roles(build, pairs):
    layout, path = build
    seen = []
    for batch in batches(path, batch_rows=1):  # one row a batch: no row left out at the epoch's end
        roles, pair_ids = batch[ROLES], batch[PAIR_IDS]
        assert roles.dtype == torch.uint8 and pair_ids.dtype == torch.int64
        assert torch.equal(pair_ids[roles == CHOSEN], pair_ids[roles == REJECTED])
        assert batch[NUM_PAIRS] == int((roles == CHOSEN).sum())
        seen += pair_ids[roles == CHOSEN].tolist()
        assert (KEY_INDEX in batch) == bool((roles == PROMPT).any())
    assert sorted(seen) == list(range(len(pairs)))  # every pair once, none split
    if layout == "shared-prompt":
        assert any(KEY_INDEX in b for b in batches(path))


def test_prompt_is_masked_in_both_halves(build, pairs):
    """OpenRLHF #294: the prompt masked only in the chosen half. Here every sequence's labels are its completion."""
    _, path = build
    for batch in batches(path):
        labels, cu = batch["labels"][0], batch["cu_seq_lens_q"].tolist()
        for k, (pair_id, role) in enumerate(zip(batch[PAIR_IDS].tolist(), batch[ROLES].tolist())):
            trained = labels[cu[k] : cu[k + 1]]
            trained = trained[trained != IGNORE_INDEX].tolist()
            pair = pairs[pair_id]
            assert trained == {PROMPT: [], CHOSEN: pair.chosen, REJECTED: pair.rejected}[role]


def test_shared_prompt_positions_continue_the_prompt(pairs, tmp_path):
    build_preference_dir(tmp_path, pairs, layout="shared-prompt", capacity=CAPACITY)
    for batch in batches(tmp_path):
        positions, cu = batch["position_ids"][0], batch["cu_seq_lens_q"].tolist()
        for k, (pair_id, role) in enumerate(zip(batch[PAIR_IDS].tolist(), batch[ROLES].tolist())):
            prompt = len(pairs[pair_id].prompt)
            first = 0 if role == PROMPT or prompt == 1 else prompt - 1
            assert positions[cu[k] : cu[k + 1]].tolist() == list(range(first, first + cu[k + 1] - cu[k]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), capacity=st.integers(24, 80), batch_rows=st.integers(1, 3),
       world_size=st.integers(1, 3), layout=st.sampled_from(LAYOUTS))
def test_a_pair_is_never_split_across_batches_or_ranks(tmp_path_factory, seed, capacity, batch_rows, world_size, layout):
    """Both halves of every pair read land in one batch of one rank: rows are whole pairs."""
    pairs = random_pairs(30, seed, longest=capacity // 4)
    path = tmp_path_factory.mktemp("split")
    build_preference_dir(path, pairs, layout=layout, capacity=capacity)
    for rank in range(world_size):
        dataset = PackedIterableDataset(path, batch_rows=batch_rows, rank=rank, world_size=world_size, seed=seed)
        for batch in dataset:
            roles, pair_ids = batch[ROLES], batch[PAIR_IDS]
            assert torch.equal(pair_ids[roles == CHOSEN], pair_ids[roles == REJECTED])


def test_chosen_and_rejected_that_do_not_pair_up_are_refused(tmp_path):
    """A row whose roles do not pair up (a corrupt or foreign build) is refused on opening, naming the shard and row."""
    import pyarrow as pa

    from loaders.shard_reader import open_shard

    build_preference_dir(tmp_path, random_pairs(2), layout="separate", capacity=CAPACITY, rows_per_shard=1)
    shard = open_shard(tmp_path / "shard-00000.arrow", CAPACITY)
    from schemas import PREFERENCE_ROW_SCHEMA

    roles = shard.table.schema.get_field_index("roles")
    table = shard.table.set_column(roles, "roles", pa.array([[1, 1, 2, 2]], pa.list_(pa.uint8()))).cast(PREFERENCE_ROW_SCHEMA)
    path = tmp_path / "forged.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    from loaders.collate import collate_rows

    from schemas.errors import ShardError

    with pytest.raises(ShardError, match=r"forged.arrow row 0: a pair's roles must be \[chosen, rejected\]"):
        collate_rows([(open_shard(path, CAPACITY), 0)])


# ---- exactness: packed equals unpacked --------------------------------------------------------


def test_completion_logits_equal_the_unpacked_computation(build, pairs):
    """Each completion token's logits, packed (in either layout), equal those of prompt + completion alone."""
    _, path = build
    model = tiny_llama().eval()
    with torch.no_grad():
        for batch in batches(path):
            logits = model(**model_inputs(batch)).logits[0]
            cu = batch["cu_seq_lens_q"].tolist()
            for k, (pair_id, role) in enumerate(zip(batch[PAIR_IDS].tolist(), batch[ROLES].tolist())):
                if role == PROMPT:
                    continue
                pair = pairs[pair_id]
                completion = pair.chosen if role == CHOSEN else pair.rejected
                alone = model(input_ids=torch.tensor([pair.prompt + completion])).logits[0]
                # The logits that predict the completion: the last prompt token's and the completion's but the last.
                n = len(completion)
                torch.testing.assert_close(logits[cu[k + 1] - n - 1 : cu[k + 1] - 1], alone[-n - 1 : -1], rtol=1e-5, atol=1e-5)


def test_offsets_of_several_rows_in_one_batch(pairs, tmp_path):
    """open-instruct #1466: offsets wrong once chosen and rejected are concatenated. Rows of a batch laid end to end
    keep every sequence's and every key range's offsets: the per-pair sums equal the unpacked ones."""
    build_preference_dir(tmp_path, pairs, layout="shared-prompt", capacity=CAPACITY)
    model = use_loss_position_head(tiny_llama().eval())
    (batch,) = batches(tmp_path, batch_rows=len(PackedIterableDataset(tmp_path, batch_rows=1)))
    assert batch["cu_seq_lens_k"][-1] == batch[KEY_INDEX].numel() > batch["cu_seq_lens_q"][-1]
    with torch.no_grad():
        packed = pair_log_probs(sequence_sums(model, model_inputs(batch)), batch[ROLES])
        chosen, rejected = unpacked_pairs(model, pairs, batch[PAIR_IDS][batch[ROLES] == CHOSEN].tolist())
    torch.testing.assert_close(packed.chosen, chosen, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed.rejected, rejected, rtol=1e-5, atol=1e-4)


def test_per_pair_log_prob_sums_equal_unpacked(build, pairs):
    _, path = build
    model = use_loss_position_head(tiny_llama().eval())
    with torch.no_grad():
        for batch in batches(path):
            packed = pair_log_probs(sequence_sums(model, model_inputs(batch)), batch[ROLES])
            ids = batch[PAIR_IDS][batch[ROLES] == CHOSEN].tolist()
            chosen, rejected = unpacked_pairs(model, pairs, ids)
            torch.testing.assert_close(packed.chosen, chosen, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(packed.rejected, rejected, rtol=1e-5, atol=1e-4)
            assert packed.chosen_tokens.tolist() == [len(pairs[i].chosen) for i in ids]


def test_shared_prompt_needs_an_attention_that_honours_key_index(pairs, tmp_path):
    """transformers' sdpa would let the rejected answer attend to the chosen one: refused in one line."""
    build_preference_dir(tmp_path, pairs, layout="shared-prompt", capacity=CAPACITY)
    model = use_loss_position_head(tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, "sdpa"))
    with pytest.raises(ValueError, match="ignores a shared-prompt batch's key_index"):
        preference_terms(model, batches(tmp_path)[0], PreferenceConfig("simpo"), None)


# ---- losses -----------------------------------------------------------------------------------


def test_dpo_at_step_zero_is_ln2_with_zero_rewards(build):
    """Policy == reference: every pair's DPO loss is ln 2, every reward 0, accuracy 0 (TRL counts chosen > rejected)."""
    _, path = build
    model = use_loss_position_head(tiny_llama())
    reference = Reference(frozen_copy(model))
    for batch in batches(path):
        terms = preference_terms(model, batch, PreferenceConfig("dpo", beta=0.1), reference)
        assert terms.losses.numel() == batch[NUM_PAIRS]
        torch.testing.assert_close(terms.losses.mean(), torch.tensor(math.log(2)), rtol=0, atol=1e-6)
        assert terms.chosen_rewards.abs().max() < 1e-6 and terms.rejected_rewards.abs().max() < 1e-6


def test_padding_is_never_a_fake_pair(pairs, tmp_path):
    """open-instruct #1900: padding counted as a fake rejected sequence made the initial loss 6 ln 2. Fixed-shape
    batches pad with sequences that carry no pair: the pairs are the real ones and the step-0 loss is ln 2."""
    build_preference_dir(tmp_path, pairs, layout="separate", capacity=CAPACITY)
    model = use_loss_position_head(tiny_llama())
    reference = Reference(frozen_copy(model))
    for batch in batches(tmp_path, pad_to_fixed_shape=True):
        assert batch["input_ids"].shape[1] == 3 * CAPACITY and batch["cu_seq_lens_q"].numel() - 1 > batch[ROLES].numel()
        terms = preference_terms(model, batch, PreferenceConfig("dpo"), reference)
        assert terms.losses.numel() == batch[NUM_PAIRS] == int((batch[ROLES] == CHOSEN).sum())
        torch.testing.assert_close(terms.losses.sum() / batch[NUM_PAIRS], torch.tensor(math.log(2)), rtol=0, atol=1e-6)


def perturbed(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved a little: a reference that differs from the policy."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return other


def trl_formulas(policy: torch.nn.Module, reference: torch.nn.Module, pairs: list[PreferencePair], ids: list[int],
                 config: PreferenceConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair of ``ids``, computed unpacked: TRL's loss of ``config``'s objective and its chosen and rejected rewards
    (DPOTrainer's sigmoid and IPO; CPOTrainer's SimPO, gamma/beta subtracted; ORPOTrainer's odds ratio and NLL)."""
    F = torch.nn.functional
    with torch.no_grad():
        pc, pr = unpacked_pairs(policy, pairs, ids)
        rc, rr = unpacked_pairs(reference, pairs, ids)
    nc = torch.tensor([float(len(pairs[i].chosen)) for i in ids])
    nr = torch.tensor([float(len(pairs[i].rejected)) for i in ids])
    beta, objective = config.beta, config.objective
    if objective == "dpo":
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))), beta * (pc - rc), beta * (pr - rr)
    if objective == "ipo":
        return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr)
    ac, ar = pc / nc, pr / nr
    if objective == "simpo":
        return -F.logsigmoid(beta * (ac - ar - config.simpo_gamma / beta)), beta * ac, beta * ar
    log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    return -ac - beta * F.logsigmoid(log_odds), beta * ac, beta * ar


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_losses_equal_trl_formulas_on_unpacked_log_probs(build, pairs, objective):
    """Each objective on packed per-pair sums equals TRL's formula on log-probs computed unpacked, pair by pair."""
    _, path = build
    policy = use_loss_position_head(tiny_llama())
    reference_model = use_loss_position_head(perturbed(tiny_llama()))
    config = PreferenceConfig(objective, beta=0.5, simpo_gamma=0.3)
    for batch in batches(path):
        terms = preference_terms(policy, batch, config, Reference(reference_model))
        expected, _, _ = trl_formulas(policy, reference_model, pairs, batch[PAIR_IDS][batch[ROLES] == CHOSEN].tolist(), config)
        torch.testing.assert_close(terms.losses.detach(), expected, rtol=1e-4, atol=1e-5)


def trl_tokenizer():
    """A word-level tokenizer over ids ``<0>``..``<127>`` split on spaces (no id's word inside another's, as
    transformers matches special tokens anywhere): TRL's processing class for token-id text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<1>", pad_token="<0>")


@pytest.mark.parametrize(("layout", "label_smoothing"), [("separate", 0.0), ("shared-prompt", 0.0), ("separate", 0.3)])
def test_loss_and_gradients_equal_trl_dpo_trainer(layout, label_smoothing, tmp_path):
    """TRL's DPOTrainer on the pairs unpacked and padded, one batch: the same loss and gradients as the packed batch,
    for DPO and for robust DPO (loss_type "robust", label_smoothing)."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    text = random_pairs(6, seed=3)

    def words(ids: list[int]) -> str:
        return " ".join(f"<{i}>" for i in ids)

    # TRL joins prompt + answer as text and appends the EOS text (<1>): spaces keep the words apart.
    data = datasets.Dataset.from_dict({"prompt": [words(p.prompt) for p in text], "chosen": [f" {words(p.chosen)} " for p in text],
                                       "rejected": [f" {words(p.rejected)} " for p in text]})
    policy, reference = tiny_llama(), perturbed(tiny_llama())
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, report_to="none", use_cpu=True, bf16=False,
                         per_device_train_batch_size=len(text), max_length=None, disable_tqdm=True,
                         loss_type="robust" if label_smoothing else "sigmoid", label_smoothing=label_smoothing)
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args, train_dataset=data,
                             processing_class=trl_tokenizer())
    examples = [trainer.train_dataset[i] for i in range(len(text))]
    trl_loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(examples)))
    trl_loss.backward()

    # The same token ids (TRL added the EOS to each answer), packed into one batch.
    pairs = [PreferencePair(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
    assert pairs == [PreferencePair(p.prompt, p.chosen + [1], p.rejected + [1]) for p in text]
    build_preference_dir(tmp_path / "build", pairs, layout=layout, capacity=CAPACITY)
    model = use_loss_position_head(policy)
    (batch,) = batches(tmp_path / "build", batch_rows=len(PackedIterableDataset(tmp_path / "build", batch_rows=1)))
    config = PreferenceConfig("dpo", beta=0.3, label_smoothing=label_smoothing)
    terms = preference_terms(model, batch, config, Reference(use_loss_position_head(reference)))
    loss = terms.losses.sum() / batch[NUM_PAIRS]
    loss.backward()
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)
    trl_grads = dict(trainer.model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, trl_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    metrics = trainer._metrics["train"]
    torch.testing.assert_close(terms.chosen_rewards.mean().item(), metrics["rewards/chosen"][-1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(terms.rejected_rewards.mean().item(), metrics["rewards/rejected"][-1], rtol=1e-4, atol=1e-6)


def test_a_lora_models_reference_is_the_model_with_its_adapter_off(build, pairs):
    """Reference(adapter_off=True): the base model's log-probs, computed by the policy with its LoRA adapter off."""
    peft = pytest.importorskip("peft")
    _, path = build
    base = tiny_llama()
    alone = copy.deepcopy(base)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    policy = peft.get_peft_model(use_loss_position_head(base), lora)
    batch = batches(path)[0]
    ids = batch[PAIR_IDS][batch[ROLES] == CHOSEN].tolist()
    reference = Reference(adapter_off=True).pairs(policy, batch, model_inputs(batch))
    with torch.no_grad():
        chosen, rejected = unpacked_pairs(alone, pairs, ids)
        adapted = pair_log_probs(sequence_sums(policy, model_inputs(batch)), batch[ROLES])
    torch.testing.assert_close(reference.chosen, chosen, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(reference.rejected, rejected, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(adapted.chosen, chosen, atol=1e-3)  # the adapter is on again, and matters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
def test_flash_attention_over_gathered_keys_equals_unpacked(pairs, tmp_path):
    """FA2 varlen with a shared-prompt batch's gathered K/V and separate query and key offsets: per-pair sums equal
    the unpacked computation (bf16 tolerance)."""
    from loaders.train.attention import attn_implementation_for

    build_preference_dir(tmp_path, pairs, layout="shared-prompt", capacity=CAPACITY)
    model = tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, attn_implementation_for("flash_attn")).cuda().to(torch.bfloat16)
    model = use_loss_position_head(model.eval())
    (batch,) = batches(tmp_path, batch_rows=len(PackedIterableDataset(tmp_path, batch_rows=1)))
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in model_inputs(batch).items()}
    with torch.no_grad():
        packed = pair_log_probs(sequence_sums(model, inputs), batch[ROLES])
        chosen, rejected = unpacked_pairs(model, pairs, batch[PAIR_IDS][batch[ROLES] == CHOSEN].tolist())
    torch.testing.assert_close(packed.chosen.cpu(), chosen.cpu(), rtol=2e-2, atol=0.5)
    torch.testing.assert_close(packed.rejected.cpu(), rejected.cpu(), rtol=2e-2, atol=0.5)


# ---- the reference stored beside the build ---------------------------------------------------


def test_stored_reference_equals_the_frozen_model_and_names_its_build(build, tmp_path):
    layout, path = build
    reference_model = use_loss_position_head(perturbed(tiny_llama()))
    written = write_reference_log_probs(reference_model, path, directory=tmp_path)
    fingerprint = PackedIterableDataset(path, batch_rows=1).manifest.fingerprint
    stored = ReferenceLogProbs(written, fingerprint, reference_identity(reference_model))
    policy = use_loss_position_head(tiny_llama())
    for batch in batches(path):
        inputs = model_inputs(batch)
        from_file = Reference(stored=stored).pairs(policy, batch, inputs)
        frozen = Reference(reference_model).pairs(policy, batch, inputs)
        torch.testing.assert_close(from_file.chosen, frozen.chosen, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(from_file.rejected, frozen.rejected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="computed on the build .*, not this one"):
        ReferenceLogProbs(written, "0" * 64)
    with pytest.raises(ValueError, match="computed by the reference model"):
        ReferenceLogProbs(written, fingerprint, reference_identity(policy))


def test_storing_the_reference_into_a_missing_directory_says_it_does_not_exist(build, tmp_path):
    """A missing directory was reported as a write error telling the user to free some space."""
    _, path = build
    before = sorted(p.name for p in path.iterdir())
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(missing))}: no such directory to store the reference "
                                                r"log-probs in; make it or give another$"):
        write_reference_log_probs(use_loss_position_head(tiny_llama()), path, directory=missing)
    (tmp_path / "a-file").write_text("kept\n")
    with pytest.raises(NotADirectoryError, match=rf"^{re.escape(str(tmp_path / 'a-file'))}: not a directory"):
        write_reference_log_probs(use_loss_position_head(tiny_llama()), path, directory=tmp_path / "a-file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and (tmp_path / "a-file").read_text() == "kept\n"
    assert sorted(p.name for p in path.iterdir()) == before

# ---- the trainer ------------------------------------------------------------------------------


def manual_dpo(path, steps: int, grad_accum: int, lr: float, beta: float) -> dict[str, torch.Tensor]:
    """SGD on windows of ``grad_accum`` batches, each window's summed per-pair losses over its pairs."""
    model = use_loss_position_head(tiny_llama())
    reference = Reference(use_loss_position_head(tiny_llama()).eval())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataset = PackedIterableDataset(path, batch_rows=1, seed=0)
    batches_read = iter(dataset)
    for _ in range(steps):
        window = [next(batches_read) for _ in range(grad_accum)]
        pairs = sum(b[NUM_PAIRS] for b in window)
        for batch in window:
            (preference_terms(model, batch, PreferenceConfig("dpo", beta=beta), reference).losses.sum() / pairs).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_dpo_trainer_logs_trl_rewards_and_trains_as_a_plain_loop(layout, pairs, tmp_path):
    """PackedDPOTrainer, given TRL's DPOConfig: the first loss is ln 2 with rewards 0 (policy = reference), the
    reward metrics are logged by TRL's names, and after 3 steps of 2 micro-batches the weights are a plain loop's."""
    trl = pytest.importorskip("trl")
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout=layout, capacity=CAPACITY)
    args = trl.DPOConfig(output_dir=str(tmp_path / "run"), beta=0.5, max_steps=3, gradient_accumulation_steps=2,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                         save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True, bf16=False,
                         per_device_train_batch_size=1)
    trainer = PackedDPOTrainer(model=tiny_llama(), args=args,
                               train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=1, seed=0))
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert logs[-1]["rewards/margins"] > 0 and 0 < logs[-1]["rewards/accuracies"] <= 1
    expected = manual_dpo(tmp_path / "build", steps=3, grad_accum=2, lr=0.5, beta=0.5)
    for name, value in expected.items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)


# ---- scripts/train.py --------------------------------------------------------------------------

TRAIN_MODEL = "llama:hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1"


def train_script():
    import importlib.util
    import sys
    from pathlib import Path

    if "varpack_train_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("varpack_train_script",
                                                      Path(__file__).resolve().parent.parent / "scripts" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["varpack_train_script"]


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_train_script_dpo_logs_rewards_from_ln2(pairs, tmp_path, trainer):
    import json

    build_preference_dir(tmp_path / "build", pairs, layout="shared-prompt", capacity=CAPACITY)
    out = tmp_path / "run"
    train_script().main(["--shards", str(tmp_path / "build"), "--random-init", TRAIN_MODEL, "--attn", "sdpa_segments",
                         "--precision", "fp32", "--objective", "dpo", "--beta", "0.5", "--max-steps", "3", "--log-every", "1",
                         "--lr", "1e-2", "--batch-rows", "2", "--trainer", trainer, "--out", str(out)])
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logs] == [1, 2, 3]
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and logs[0]["rewards/accuracies"] == 0.0
    assert logs[-1]["rewards/margins"] > 0 and logs[-1]["loss"] < math.log(2)


def test_train_script_refuses_a_preference_objective_on_an_sft_build(tmp_path):
    from shard_factory import build_shard_dir

    build_shard_dir(tmp_path / "sft", [20, 30, 40], capacity=CAPACITY, vocab_size=VOCAB)
    with pytest.raises(SystemExit, match="train.py: error: --objective dpo trains on preference pairs, and the "
                                         "batches hold none: the build is not a preference build"):
        train_script().main(["--shards", str(tmp_path / "sft"), "--random-init", TRAIN_MODEL, "--attn", "sdpa_segments",
                             "--precision", "fp32", "--objective", "dpo", "--max-steps", "1", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # a refused run leaves no --out behind


def train_main(build, out, *args: str) -> None:
    """scripts/train.py on ``build`` with the tiny random Llama, fp32, on CPU."""
    train_script().main(["--shards", str(build), "--random-init", TRAIN_MODEL, "--attn", "sdpa_segments",
                         "--precision", "fp32", "--max-steps", "1", "--log-every", "1", "--out", str(out), *args])


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_train_script_refuses_sft_on_a_preference_build(pairs, tmp_path, trainer):
    """--objective sft (the default) would train next-token loss on the rejected answers too: refused in one line
    naming --objective, before --out is made."""
    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    with pytest.raises(SystemExit, match=r"^train.py: error: --objective sft: .* is a build of preference pairs: "
                                         r"next-token loss would train on its rejected answers too; give --objective dpo"):
        train_main(tmp_path / "build", tmp_path / "run", "--trainer", trainer)
    assert not (tmp_path / "run").exists()


def test_packed_trainer_refuses_a_preference_dataset(pairs, tmp_path):
    from loaders.train.hf_trainer import PackedTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="PackedTrainer: the dataset is a build of preference pairs: .* train it with PackedDPOTrainer"):
        PackedTrainer(model=tiny_llama(), args=args, train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=1))


def test_a_reference_models_attention_is_checked_on_shared_prompt_builds(pairs, tmp_path):
    """A reference on transformers' sdpa ignores key_index (its rejected answer would attend to the chosen one), as a
    frozen model, a PackedDPOTrainer ref_model or the model writing stored log-probs: refused in one line."""
    trl = pytest.importorskip("trl")
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="shared-prompt", capacity=CAPACITY)
    policy = use_loss_position_head(tiny_llama())
    on_sdpa = use_loss_position_head(tiny_model.tiny_llama(VOCAB, 2 * CAPACITY, "sdpa"))
    batch = batches(tmp_path / "build")[0]
    refused = "attn_implementation 'sdpa' ignores a shared-prompt batch's key_index"
    with pytest.raises(ValueError, match=refused):
        preference_terms(policy, batch, PreferenceConfig("dpo"), Reference(on_sdpa))
    with pytest.raises(ValueError, match=refused):
        write_reference_log_probs(on_sdpa, tmp_path / "build", directory=tmp_path)
    assert not list(tmp_path.glob("reference_log_probs-*"))
    args = trl.DPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", use_cpu=True, bf16=False,
                         per_device_train_batch_size=1, save_strategy="no", disable_tqdm=True)
    trainer = PackedDPOTrainer(model=policy, ref_model=on_sdpa, args=args,
                               train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=2, shuffle=False))
    with pytest.raises(ValueError, match=refused):
        trainer.compute_loss(policy, batch)


def start_model(build) -> torch.nn.Module:
    """The model scripts/train.py starts from with TRAIN_MODEL (seeded), with the loss-position head."""
    from loaders.train.attention import attn_implementation_for

    script = train_script()
    config = script.parse_args(["--shards", str(build), "--random-init", TRAIN_MODEL, "--out", "unused"])
    return use_loss_position_head(script.load_model(config, VOCAB, attn_implementation_for("sdpa_segments")))


@pytest.mark.parametrize("trainer", ["plain", "hf"])
def test_train_script_takes_stored_reference_log_probs_only_of_its_starting_model(pairs, tmp_path, trainer):
    """--reference-log-probs: the file the starting model wrote trains from ln 2; one another model wrote is
    refused in one line, before --out is made (docs: a file of another build or model is refused)."""
    import json

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    own = write_reference_log_probs(start_model(tmp_path / "build"), tmp_path / "build", directory=tmp_path)
    other = write_reference_log_probs(use_loss_position_head(perturbed(start_model(tmp_path / "build"))), tmp_path / "build",
                                      directory=tmp_path)
    with pytest.raises(SystemExit, match=f"^train.py: error: {re.escape(str(other))}: computed by the reference model"):
        train_main(tmp_path / "build", tmp_path / "refused", "--objective", "dpo", "--reference-log-probs", str(other),
                   "--trainer", trainer)
    assert not (tmp_path / "refused").exists()
    train_main(tmp_path / "build", tmp_path / "run", "--objective", "dpo", "--reference-log-probs", str(own),
               "--trainer", trainer)
    (first,) = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_packed_dpo_trainer_checks_the_identity_of_stored_reference_log_probs(pairs, tmp_path):
    trl = pytest.importorskip("trl")
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    policy, other = use_loss_position_head(tiny_llama()), use_loss_position_head(perturbed(tiny_llama()))
    path = write_reference_log_probs(other, tmp_path / "build", directory=tmp_path)
    args = trl.DPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", use_cpu=True, bf16=False,
                         per_device_train_batch_size=1, save_strategy="no", disable_tqdm=True)
    dataset = PackedIterableDataset(tmp_path / "build", batch_rows=2, shuffle=False)
    with pytest.raises(ValueError, match="computed by the reference model"):
        PackedDPOTrainer(model=policy, args=args, train_dataset=dataset, reference_log_probs=path)
    assert not (tmp_path / "run").exists()
    trainer = PackedDPOTrainer(model=policy, ref_model=other, args=args, train_dataset=dataset, reference_log_probs=path)
    assert trainer.reference.stored is not None


def forged_reference(build, path, pair_ids: list[int], identity: str = "") -> str:
    """A reference log-probs file of ``build`` holding ``pair_ids`` (chosen -1, rejected -2)."""
    import pyarrow as pa

    from loaders.train.preference import REFERENCE_SCHEMA

    fingerprint = PackedIterableDataset(build, batch_rows=1).manifest.fingerprint
    table = pa.table([pa.array(pair_ids, pa.int64()), pa.array([-1.0] * len(pair_ids), pa.float64()),
                      pa.array([-2.0] * len(pair_ids), pa.float64())], schema=REFERENCE_SCHEMA)
    table = table.replace_schema_metadata({"fingerprint": fingerprint, "reference": identity})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return str(path)


@pytest.mark.parametrize(("pair_ids", "refused"), [
    ("negative", "pair_id -1 is negative"),
    ("repeated", "pair_id 0 appears more than once"),
    ("huge", f"pair_id {2**40} is not a pair of this build"),
    ("missing", "holds 23 pairs; the build packed 24"),
])
def test_a_forged_reference_file_is_refused_in_one_line(pairs, tmp_path, pair_ids, refused):
    """Stored pair ids must be exactly the build's pairs: no negative id read as another pair's, no repeat, no id
    past the build's (nothing is sized by one), none missing. train.py names the file in one line."""
    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    ids = {"negative": [-1, *range(1, 24)], "repeated": [0, *range(0, 23)], "huge": [*range(23), 2**40],
           "missing": list(range(23))}[pair_ids]
    manifest = PackedIterableDataset(tmp_path / "build", batch_rows=1).manifest
    path = forged_reference(tmp_path / "build", tmp_path / "forged.arrow", ids)
    with pytest.raises(ValueError, match=f"forged.arrow: {refused}"):
        ReferenceLogProbs(path, manifest)
    path = forged_reference(tmp_path / "build", tmp_path / "forged.arrow", ids, reference_identity(start_model(tmp_path / "build")))
    with pytest.raises(SystemExit, match=f"^train.py: error: {re.escape(path)}: {refused}"):
        train_main(tmp_path / "build", tmp_path / "run", "--objective", "dpo", "--reference-log-probs", path)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("options", "refused"), [
    (["--objective", "dpo", "--beta", "inf"], "--objective dpo needs a finite positive --beta"),
    (["--objective", "ipo", "--beta", "nan"], "--objective ipo needs a finite positive --beta"),
    (["--objective", "simpo", "--reference-log-probs", "ref.arrow"],
     "--reference-log-probs applies to --objective dpo or ipo, not simpo"),
    (["--objective", "orpo", "--reference-log-probs", "ref.arrow"],
     "--reference-log-probs applies to --objective dpo or ipo, not orpo"),
    (["--objective", "dpo", "--reference-log-probs", "missing.arrow"], "--reference-log-probs missing.arrow: no such file"),
    (["--objective", "kto"], r"--objective: invalid choice: 'kto' \(choose from '?sft'?, '?dpo'?, '?ipo'?, '?simpo'?, '?orpo'?\)"),
])
def test_train_script_refuses_bad_preference_options_in_one_line(tmp_path, capsys, monkeypatch, options, refused):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ref.arrow").write_bytes(b"")
    with pytest.raises(SystemExit) as exit:
        train_script().parse_args(["--shards", "pairs", "--out", "run", *options])
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert re.search(refused, line), line


def test_packed_dpo_trainer_runs_label_smoothing_and_refuses_dpoconfig_settings_it_does_not_run(pairs, tmp_path):
    """DPOConfig(loss_type="robust", label_smoothing=e) gives TRL's robust DPO,
    (-(1-e) log sigmoid(beta z) + e log sigmoid(-beta z)) / (1 - 2e); label_smoothing with a loss that leaves it
    unused, and every other setting that changes TRL's loss, is refused in one line naming it, not silently dropped."""
    trl = pytest.importorskip("trl")
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    dataset = PackedIterableDataset(tmp_path / "build", batch_rows=2, shuffle=False)
    common = dict(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", use_cpu=True, bf16=False,
                  per_device_train_batch_size=1, save_strategy="no", disable_tqdm=True, beta=0.5)
    policy, reference = use_loss_position_head(tiny_llama()), use_loss_position_head(perturbed(tiny_llama()))
    trainer = PackedDPOTrainer(model=policy, ref_model=reference, train_dataset=dataset,
                               args=trl.DPOConfig(**common, loss_type="robust", label_smoothing=0.3))
    batch = batches(tmp_path / "build", batch_rows=2)[0]
    with torch.no_grad():
        loss = trainer.compute_loss(policy, batch)
        pol = pair_log_probs(sequence_sums(policy, model_inputs(batch)), batch[ROLES])
        ref = pair_log_probs(sequence_sums(reference, model_inputs(batch)), batch[ROLES])
    z = 0.5 * ((pol.chosen - ref.chosen) - (pol.rejected - ref.rejected))
    expected = ((-0.7 * torch.nn.functional.logsigmoid(z) + 0.3 * torch.nn.functional.logsigmoid(-z)) / 0.4).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(loss, -torch.nn.functional.logsigmoid(z).mean())
    for setting in ({"f_divergence_type": "js_divergence"}, {"use_weighting": True}, {"ld_alpha": 0.5},
                    {"loss_weights": [0.5]}, {"sync_ref_model": True}):
        ((name, value),) = setting.items()
        with pytest.raises(ValueError, match=re.escape(f"PackedDPOTrainer does not run DPOConfig's {name}={value!r}")):
            PackedDPOTrainer(model=policy, ref_model=reference, args=trl.DPOConfig(**common, **setting), train_dataset=dataset)
    for loss_type in ("sigmoid", "ipo"):
        with pytest.raises(ValueError, match=f"label_smoothing=0.3: TRL's '{loss_type}' loss leaves it unused"):
            PackedDPOTrainer(model=policy, ref_model=reference, train_dataset=dataset,
                             args=trl.DPOConfig(**common, loss_type=loss_type, label_smoothing=0.3))
    with pytest.raises(ValueError, match=re.escape("label_smoothing applies to DPO (robust DPO), not ipo")):
        PreferenceConfig("ipo", label_smoothing=0.1)


def test_bench_preference_runs_on_cpu_with_its_trl_anchor(tmp_path):
    """scripts/bench_preference.py measures both layouts and TRL's DPOTrainer on the same pairs in one run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_preference.py"), "--model-config", "tiny",
                           "--pairs", "2", "--prompt-tokens", "16", "--completion-tokens", "8", "--capacity", "128",
                           "--device", "cpu", "--warmup", "0", "--steps", "1", "--repeats", "1",
                           "--methods", "separate,shared-prompt,trl_sdpa", "--json", str(tmp_path / "bench.json")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["pairs_per_s"]) == {"separate", "shared-prompt", "trl_sdpa"}
    assert result["best_vs_trl"] > 0 and result["shared_prompt_vs_separate"] > 0
    assert result["methods"]["shared-prompt"]["tokens_per_step"] < result["methods"]["separate"]["tokens_per_step"]
    assert json.loads((tmp_path / "bench.json").read_text()) == result


# ---- evaluation -------------------------------------------------------------------------------

EVAL_PAIRS = 13
EVAL_ROWS = 4  # a batch; the eval builds' 6 rows are not a multiple of it


def dpo_args(tmp_path, **kwargs):
    """TRL's DPOConfig for a few CPU steps of SGD, beta 0.5, one log per step."""
    trl = pytest.importorskip("trl")
    return trl.DPOConfig(**{"output_dir": str(tmp_path / "run"), "beta": 0.5, "max_steps": 2, "learning_rate": 0.5,
                            "optim": "sgd", "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "logging_steps": 1,
                            "save_strategy": "no", "report_to": "none", "use_cpu": True, "seed": 0, "disable_tqdm": True,
                            "bf16": False, "per_device_train_batch_size": 1, **kwargs})


def eval_build(tmp_path, layout: str = "separate", name: str = "eval") -> tuple[list[PreferencePair], object]:
    """A held-out preference build of EVAL_PAIRS pairs in ``layout``, read EVAL_ROWS rows a batch in order."""
    held_out = random_pairs(EVAL_PAIRS, seed=7)
    build_preference_dir(tmp_path / name, held_out, layout=layout, capacity=CAPACITY)
    return held_out, PackedIterableDataset(tmp_path / name, batch_rows=EVAL_ROWS, shuffle=False)


def expected_metrics(policy, reference, pairs: list[PreferencePair], config: PreferenceConfig) -> dict[str, float]:
    """The loss and TRL's reward metrics of every pair computed unpacked, averaged over pairs."""
    losses, chosen, rejected = trl_formulas(policy, reference, pairs, list(range(len(pairs))), config)
    return {"loss": losses.mean().item(), "rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).double().mean().item(), "rewards/margins": (chosen - rejected).mean().item()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_dpo_trainer_evaluates_the_dpo_loss_ln2_at_step_zero(layout, tmp_path):
    """evaluate() on a preference build reports the DPO loss, not token cross-entropy: ln 2 with every reward 0
    while the policy is its reference, under TRL's eval_ names."""
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", random_pairs(6), layout=layout, capacity=CAPACITY)
    _, held_out = eval_build(tmp_path, layout)
    trainer = PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path), eval_dataset=held_out,
                               train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=1))
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in ("chosen", "rejected", "accuracies", "margins"):
        assert metrics[f"eval_rewards/{name}"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["eval_runtime"] > 0 and trainer.state.log_history[-1] == {**metrics, "epoch": 0.0, "step": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_dpo_trainer_evaluation_equals_each_pair_unpacked(layout, pairs, tmp_path):
    """After 2 steps, the evaluation eval_strategy="steps" logs is each held-out pair run unpacked through the plain
    model, TRL's formulas applied per pair and averaged, every pair once."""
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout=layout, capacity=CAPACITY)
    held_out_pairs, held_out = eval_build(tmp_path, layout)
    trainer = PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path, eval_strategy="steps", eval_steps=2),
                               train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=1, seed=0),
                               eval_dataset=held_out)
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    expected = expected_metrics(trainer.model, tiny_llama(), held_out_pairs, trainer.preference)
    assert expected["rewards/margins"] != pytest.approx(0.0, abs=1e-3)  # the policy has moved from its reference
    for name, value in expected.items():
        assert logged[f"eval_{name}"] == pytest.approx(value, rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("objective", ["ipo", "simpo", "orpo"])
def test_evaluate_preference_counts_every_pair_once_with_each_objective(objective, tmp_path):
    """Every pair of the build once, the rows of its last, partial batch included, each objective's mean loss and
    rewards equal to TRL's formulas per pair unpacked; the model's training mode is restored."""
    from loaders.train.preference_eval import evaluate_preference

    held_out_pairs, held_out = eval_build(tmp_path)
    assert len(PackedIterableDataset(held_out.source, batch_rows=1)) % EVAL_ROWS != 0
    policy, reference = use_loss_position_head(tiny_llama()), use_loss_position_head(perturbed(tiny_llama()))
    config = PreferenceConfig(objective, beta=0.5, simpo_gamma=0.3)
    result = evaluate_preference(policy.train(), held_out.source, config, Reference(reference), batch_rows=EVAL_ROWS)
    assert result.pair_ids.tolist() == list(range(EVAL_PAIRS)) and policy.training
    for name, value in expected_metrics(policy, reference, held_out_pairs, config).items():
        assert result.metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def evaluate_preference_rank(rank: int, path: str, init_file: str, out: str) -> None:
    """One of two gloo ranks: ``evaluate_preference(distributed=True)``, every rank's result saved."""
    import torch.distributed as dist

    from loaders.train.distributed import finish_distributed_run
    from loaders.train.preference_eval import evaluate_preference

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    reference = Reference(use_loss_position_head(perturbed(tiny_llama())))
    result = evaluate_preference(use_loss_position_head(tiny_llama()), path, PreferenceConfig("dpo", beta=0.5), reference,
                                 batch_rows=EVAL_ROWS, distributed=True)
    torch.save(result, f"{out}/rank{rank}.pt")
    finish_distributed_run()


def test_ranks_share_the_preference_evaluation_and_each_gets_the_whole_result(tmp_path):
    import torch.multiprocessing as mp

    from loaders.train.preference_eval import evaluate_preference

    _, held_out = eval_build(tmp_path, "shared-prompt")
    reference = Reference(use_loss_position_head(perturbed(tiny_llama())))
    alone = evaluate_preference(use_loss_position_head(tiny_llama()), held_out.source, PreferenceConfig("dpo", beta=0.5),
                                reference, batch_rows=EVAL_ROWS)
    mp.spawn(evaluate_preference_rank, args=(held_out.source, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        shared = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert shared.pair_ids.tolist() == alone.pair_ids.tolist() == list(range(EVAL_PAIRS))
        # fp32 sums in another order (one thread a rank, the test's threads alone): about 1e-7 apart, no more.
        assert shared.metrics == pytest.approx(alone.metrics, rel=1e-5, abs=1e-6)


def test_packed_dpo_trainer_refuses_an_eval_dataset_that_is_not_one_preference_build(pairs, tmp_path):
    """An SFT build (its eval_loss would be token cross-entropy), a mixture, or another kind of dataset: refused in one
    line when given, before the output directory is made, and when passed to evaluate()."""
    from shard_factory import build_shard_dir

    from loaders import PackedMixture
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    train = PackedIterableDataset(tmp_path / "build", batch_rows=1)
    build_shard_dir(tmp_path / "sft", [20, 30, 40], capacity=CAPACITY, vocab_size=VOCAB)
    sft = PackedIterableDataset(tmp_path / "sft", batch_rows=1)
    not_preference = r"the eval dataset .*sft is not a build of preference pairs: its eval_loss would be token cross-entropy"
    refusals = [(sft, ValueError, not_preference),
                (PackedMixture({"a": tmp_path / "build", "b": tmp_path / "build"}, weights={"a": 1, "b": 1}), ValueError,
                 "evaluates one preference build, not a mixture"),
                ({"held_out": sft}, ValueError, not_preference),
                ([1, 2, 3], TypeError, "evaluates a PackedIterableDataset of a preference build, got list")]
    for dataset, error, refused in refusals:
        with pytest.raises(error, match=refused):
            PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path), train_dataset=train, eval_dataset=dataset)
        assert not (tmp_path / "run").exists()
    trainer = PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path), train_dataset=train)
    for dataset, error, refused in refusals:
        with pytest.raises(error, match=refused):
            trainer.evaluate(dataset)
    with pytest.raises(ValueError, match="no eval dataset; pass eval_dataset="):
        trainer.evaluate()
    by_name = trainer.evaluate({"held_out": train})  # a dict of builds: each under its name, as Trainer.evaluate does
    assert by_name["eval_held_out_loss"] == pytest.approx(math.log(2), abs=1e-6) and "eval_held_out_rewards/margins" in by_name


def test_packed_dpo_trainer_refuses_an_eval_build_of_another_tokenizer(pairs, tmp_path):
    """A preference build packed with another tokenizer than the training build's (its rewards would be of ids the
    model never learned to read): refused in one line naming both builds and tokenizers, when given (before the
    output directory is made) and when passed to evaluate()."""
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    build_preference_dir(tmp_path / "other", pairs, layout="separate", capacity=CAPACITY, vocab_size=2 * VOCAB)
    train = PackedIterableDataset(tmp_path / "build", batch_rows=1)
    other = PackedIterableDataset(tmp_path / "other", batch_rows=2)
    refused = re.escape(f"the eval build {other.source} and the training build {train.source} were tokenized "
                        f"differently (tokenizer synthetic vocab-{VOCAB} vs synthetic vocab-{2 * VOCAB}): evaluate a "
                        "build packed with the training build's tokenizer")
    for eval_dataset in (other, {"held_out": other}):
        with pytest.raises(ValueError, match=f"^{refused}$"):
            PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path), train_dataset=train, eval_dataset=eval_dataset)
        assert not (tmp_path / "run").exists()
    trainer = PackedDPOTrainer(model=tiny_llama(), args=dpo_args(tmp_path), train_dataset=train)
    for eval_dataset in (other, {"held_out": other}):
        with pytest.raises(ValueError, match=f"^{refused}$"):
            trainer.evaluate(eval_dataset)


def test_packed_dpo_trainer_puts_the_head_of_a_peft_model_on_its_causal_lm(pairs, tmp_path):
    """PackedDPOTrainer(model=get_peft_model(base, lora)), the head not put on first: the head goes on the base
    causal LM (as when put there before PEFT wraps it); evaluate() is ln 2 while the adapter is off (B = 0), one
    step trains the adapter alone, and the evaluation then equals each held-out pair unpacked, against the base."""
    peft = pytest.importorskip("peft")
    from loaders.train.hf_trainer import PackedDPOTrainer

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    held_out_pairs, held_out = eval_build(tmp_path)
    base = tiny_llama()
    before = copy.deepcopy(base.state_dict())
    policy = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0))
    trainer = PackedDPOTrainer(model=policy, args=dpo_args(tmp_path, max_steps=1, learning_rate=2.0), eval_dataset=held_out,
                               train_dataset=PackedIterableDataset(tmp_path / "build", batch_rows=2, seed=0))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    trainer.train()
    metrics = trainer.evaluate()
    merged, unloaded = copy.deepcopy(policy).merge_and_unload(), copy.deepcopy(policy).unload()
    for name, value in before.items():  # the base weights are frozen: the adapter alone trained
        torch.testing.assert_close(unloaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    reference = tiny_llama()
    reference.load_state_dict(before)
    expected = expected_metrics(merged, reference, held_out_pairs, trainer.preference)
    assert expected["rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # the adapter has moved the policy
    for name, value in expected.items():
        assert metrics[f"eval_{name}"] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def test_stored_reference_log_probs_evaluate_another_build_only_with_its_own_file(pairs, tmp_path):
    """reference_log_probs are the training build's: evaluating another build is refused in one line naming
    eval_reference_log_probs, which takes that build's file (computed by the same reference) and evaluates as the
    reference model would; a file of another build is refused."""
    from loaders.train.hf_trainer import PackedDPOTrainer
    from loaders.train.preference_eval import evaluate_preference

    build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
    _, held_out = eval_build(tmp_path)
    policy, reference = use_loss_position_head(tiny_llama()), use_loss_position_head(perturbed(tiny_llama()))
    train_file = write_reference_log_probs(reference, tmp_path / "build", directory=tmp_path)
    eval_file = write_reference_log_probs(reference, held_out.source, directory=tmp_path)
    train = PackedIterableDataset(tmp_path / "build", batch_rows=1)
    common = dict(model=policy, ref_model=reference, args=dpo_args(tmp_path), train_dataset=train, reference_log_probs=train_file)
    with pytest.raises(ValueError, match="reference_log_probs holds the training build's reference log-probs, not those of "
                                         "the eval build .*eval: pass eval_reference_log_probs="):
        PackedDPOTrainer(**common, eval_dataset=held_out)
    with pytest.raises(ValueError, match="computed on the build"):
        PackedDPOTrainer(**common, eval_dataset=held_out, eval_reference_log_probs=train_file)
    with pytest.raises(ValueError, match="eval_reference_log_probs: give reference_log_probs too"):
        PackedDPOTrainer(model=policy, args=dpo_args(tmp_path), train_dataset=train, eval_reference_log_probs=eval_file)
    assert not (tmp_path / "run").exists()
    trainer = PackedDPOTrainer(**common, eval_dataset=held_out, eval_reference_log_probs=eval_file)
    metrics = trainer.evaluate()
    expected = evaluate_preference(policy, held_out.source, trainer.preference, Reference(reference), batch_rows=EVAL_ROWS).metrics
    assert {name: metrics[f"eval_{name}"] for name in expected} == pytest.approx(expected, rel=1e-5, abs=1e-6)
    on_train = trainer.evaluate(train, metric_key_prefix="train_build")  # the training build takes the training file
    assert on_train["train_build_loss"] == pytest.approx(
        evaluate_preference(policy, train.source, trainer.preference, Reference(reference)).metrics["loss"], rel=1e-5)


class EvaluationsSeen(transformers.TrainerCallback):
    """Counts the evaluations a trainer announces to its callbacks."""

    def __init__(self) -> None:
        self.evaluations = 0

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_dict_eval_dataset_is_checked_whole_before_any_build_is_evaluated(pairs, tmp_path, kind):
    """PackedTrainer and PackedDPOTrainer evaluate a dict passed to evaluate() alike: a bad second entry (a build of
    another tokenizer) refuses the whole dict before the first is evaluated, nothing logged and no callback told;
    a good dict logs each build under its name, and a name picks the trainer's entry of that name."""
    from shard_factory import build_shard_dir

    from loaders.train.hf_trainer import PackedDPOTrainer, PackedTrainer

    seen = EvaluationsSeen()
    if kind == "sft":
        build_shard_dir(tmp_path / "build", [20, 30, 40], capacity=CAPACITY, vocab_size=VOCAB)
        build_shard_dir(tmp_path / "other", [20, 30], capacity=CAPACITY, vocab_size=2 * VOCAB)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none", use_cpu=True,
                                              per_device_train_batch_size=1)
        make = PackedTrainer
    else:
        build_preference_dir(tmp_path / "build", pairs, layout="separate", capacity=CAPACITY)
        build_preference_dir(tmp_path / "other", pairs, layout="separate", capacity=CAPACITY, vocab_size=2 * VOCAB)
        args, make = dpo_args(tmp_path), PackedDPOTrainer
    train = PackedIterableDataset(tmp_path / "build", batch_rows=1)
    builds = {"held_out": train, "other": PackedIterableDataset(tmp_path / "other", batch_rows=1)}
    trainer = make(model=tiny_llama(), args=args, train_dataset=train, callbacks=[seen])
    with pytest.raises(ValueError, match=r"^the eval build .*other and the training build .*build were tokenized differently"):
        trainer.evaluate(builds)
    assert trainer.state.log_history == [] and seen.evaluations == 0
    metrics = trainer.evaluate({"held_out": train, "again": train})
    assert [sorted(entry) for entry in trainer.state.log_history] == [
        sorted([*(name for name in metrics if name.startswith(f"eval_{build}_")), "epoch", "step"])
        for build in ("held_out", "again")] and seen.evaluations == 2
    assert metrics["eval_held_out_loss"] == pytest.approx(metrics["eval_again_loss"], rel=1e-6)
    trainer.eval_dataset = {"held_out": train}
    assert trainer.evaluate("held_out")["eval_loss"] == pytest.approx(metrics["eval_held_out_loss"], rel=1e-6)
