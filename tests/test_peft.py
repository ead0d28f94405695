"""LoRA (PEFT) on packed batches: the loss and the adapters' gradients equal the same examples unpacked,
and PackedTrainer trains and resumes a LoRA model exactly. CPU, fp32, a tiny random Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from shard_factory import build_shard_dir
from tiny_model import tiny_llama

from loaders import PackedIterableDataset
from loaders.train.attention import attn_implementation_for
from loaders.train.loss_head import use_loss_position_head

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 300
CAPACITY = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    lengths = np.random.default_rng(6).integers(4, 50, 60)
    return build_shard_dir(tmp_path_factory.mktemp("peft-shards"), lengths, capacity=CAPACITY, vocab_size=VOCAB).path


def lora_llama(backend: str = "sdpa", head: bool = False):
    model = tiny_llama(VOCAB, 2 * CAPACITY, attn_implementation_for(backend))
    if head:
        use_loss_position_head(model)  # before PEFT wraps the model
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():  # LoRA starts with B = 0; give both factors gradients
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def lora_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad])


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_segments"])
@pytest.mark.parametrize("head", [False, True], ids=["logits", "loss-head"])
def test_lora_packed_loss_and_gradients_equal_unpacked(shards, backend, head):
    batch = next(iter(PackedIterableDataset(shards, batch_rows=3, seed=1)))
    model = lora_llama(backend, head)
    packed = model(**batch).loss
    packed.backward()
    packed_grads = lora_grads(model)

    model.zero_grad()
    cu = batch["cu_seq_lens_q"].tolist()
    total, targets = 0.0, 0
    for a, b in zip(cu[:-1], cu[1:]):
        labels = batch["labels"][0, a + 1 : b]
        if (labels != -100).any():
            logits = model.base_model.model.model(input_ids=batch["input_ids"][:, a:b]).last_hidden_state
            logits = model.base_model.model.lm_head(logits)[0, :-1]
            total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            targets += int((labels != -100).sum())
    unpacked = total / targets
    unpacked.backward()
    unpacked_grads = lora_grads(model)

    assert len(cu) > 5
    assert packed.item() == pytest.approx(unpacked.item(), rel=1e-5)
    assert F.cosine_similarity(packed_grads, unpacked_grads, dim=0).item() > 0.999999
    torch.testing.assert_close(packed_grads, unpacked_grads, rtol=1e-4, atol=1e-7)


def test_packed_trainer_trains_and_resumes_lora(shards, tmp_path):
    from loaders.train.hf_trainer import PackedTrainer

    def trainer(out, max_steps):
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, gradient_accumulation_steps=2,
                                              learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_steps=2,
                                              report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
        return PackedTrainer(model=lora_llama(), args=args, train_dataset=PackedIterableDataset(shards, batch_rows=2))

    straight = trainer(tmp_path / "straight", 4)
    straight.train()
    trainer(tmp_path / "resumed", 2).train()
    assert (tmp_path / "resumed" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    resumed = trainer(tmp_path / "resumed", 4)
    resumed.train(resume_from_checkpoint=True)
    lora = {n: p for n, p in straight.model.named_parameters() if p.requires_grad}
    for name, value in resumed.model.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(value, lora[name], rtol=1e-5, atol=1e-7)
