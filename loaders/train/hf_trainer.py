"""The Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` on packed shards, without workarounds.

    from loaders.train.hf_trainer import PackedTrainer          # or PackedSFTTrainer (pip install -e '.[train]')
                                                                # or PackedDPOTrainer on preference pairs

    args = TrainingArguments(output_dir="runs/a", max_steps=1000, gradient_accumulation_steps=4, ...)
    dataset = PackedIterableDataset("shards/DIR", batch_rows=8)   # after args: it reads the ranks
    trainer = PackedTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=True)                   # or None on the first run

What the trainers add to the ones they subclass:

- The train DataLoader is built here, over the dataset's batches as they are (``batch_size=None``,
  read in the training process) and never passed to accelerate, which would slice
  ``cu_seq_lens`` as if it were a batch dimension. The dataset already splits by rank.
- It runs through the dataset's epochs one after the other, calling ``set_epoch`` at each, and
  gradient accumulation windows run across epoch ends, as in a plain loop; training is bounded
  by ``max_steps`` (or ``num_train_epochs`` times the optimizer steps of an epoch).
- ``num_items_in_batch`` is the loss tokens (or, with ``loss_reduction``/``example_weights``, the
  weight sum) of the whole global batch: every micro-batch of the window on every rank, from the
  counts the batches carry (one all-reduce, no device sync), so the loss and its gradients equal
  one big batch's.
- Every checkpoint holds each rank's loader position as JSON (``loader_state.json``,
  ``loader_state-rankN.json``, written after the trainer's files), and
  ``train(resume_from_checkpoint=...)`` restores it, so the run continues at the exact batch; the
  trainer's own data skipping is off. ``resume_from_checkpoint=True`` takes the newest checkpoint
  that holds every rank's loader state, passing over one a killed save left incomplete. Nothing
  of a checkpoint is unpickled (``loaders/train/checkpoint.py``).
- ``per_device_train_batch_size`` does not apply (a micro-batch is one batch of the dataset): a
  value other than 1 is counted as 1, with a warning that says so. The logged ``epoch`` is the
  share of the dataset's epochs read (epoch 1.2: the first epoch and a fifth of the second), not
  the trainer's step / max_steps. The final ``train_samples_per_second`` and
  ``train_tokens_per_second`` count the sequences (examples, or the pieces of split ones) and
  real tokens all ranks trained on (``train_samples``, ``train_tokens``), not 8 samples a batch.
- Logs carry ``real_tokens_per_s``: the data tokens (pad excluded) of all ranks per second; and,
  on a PackedMixture, ``PackedTrainer``'s carry ``train_NAME_loss``: each source's mean token loss
  over all ranks since the last log (``loaders.train.source_loss``; the plain mean, whatever the
  loss weights), summed on the device without a sync per step.
- ``PackedTrainer(..., speed=SpeedOptions(...))`` takes ``scripts/train.py``'s speed options
  (``loaders.train.speed``): the loss-position head, compiled layers on bucketed shapes (every
  bucket compiled on the first batch, before the first step) and the activation memory budget.
  With ``step_graph=True`` (one CUDA GPU, one process, ``gradient_accumulation_steps=1``, no fp16,
  DeepSpeed, FSDP, gradient checkpointing, LOMO or layerwise optimizers, or ``torch_compile``; others
  are refused in one line) each micro-batch's forward
  and backward is replayed as a CUDA graph per batch shape (``loaders.train.step_graph.GraphedForwardBackward``),
  and the Trainer runs clipping, the optimizer and the scheduler on the gradients it leaves, eagerly.
  The first step runs uncaptured; every shape among an epoch's worth of the batches ahead (read
  from a copy of the dataset) is captured before the second, a shape first met later when it comes.
  All graphs write one set of gradients, held for the run beside the weights. Loss weights and a
  mixture's loss per source come out of the graph too. The graphs train the parameters they
  captured: one a callback freezes, replaces or adds later is not seen by them.
- ``evaluate()`` on a PackedIterableDataset (``eval_dataset=``, e.g. with ``eval_strategy="steps"``)
  runs ``loaders.train.evaluate.evaluate_packed`` over all of its rows, the ranks sharing them:
  ``eval_loss`` is the mean token loss, with ``eval_perplexity`` and ``eval_mean_example_loss``;
  on a PackedMixture, every build of it, with each source's mean token loss as ``eval_NAME_loss``. An eval
  build packed with another tokenizer than the training build's is refused, when given and in ``evaluate()``.

transformers (and TRL for ``PackedSFTTrainer``) are imported when a trainer class is first used,
so ``loaders`` still imports without them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from loaders.collate import NUM_REAL_TOKENS, SOURCE_IDS
from loaders.dataset import PackedIterableDataset
from loaders.loss_weights import LOSS_WEIGHT_SUM, LOSS_WEIGHTS, batch_normalizer
from loaders.mixture import PackedMixture, tokenizer_difference
from loaders.train import models as training
from loaders.train.checkpoint import (
    CHECKPOINT_PREFIX,
    LOADER_STATE,
    CheckpointError,
    latest_checkpoint,
    loader_state_name,
    restore_loader_state,
    save_loader_state,
)
from loaders.train.distributed import global_loss_tokens, world_size
from loaders.train.evaluate import evaluate_sources, pooled_summary
from loaders.train.loss import weighted_causal_lm_loss
from loaders.train.loss_head import SEQUENCE_LOSSES
from loaders.train.source_loss import SourceLosses
from loaders.train.speed import SpeedOptions
from loaders.train.step_graph import GraphedForwardBackward

class EpochAfterEpoch(IterableDataset):
    """The dataset's batches, epoch after epoch, without end; ``set_epoch`` is called at each new epoch."""

    def __init__(self, dataset: PackedIterableDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | int]]:
        while True:
            yield from self.dataset
            self.dataset.set_epoch(self.dataset.epoch + 1)


if TYPE_CHECKING:  # the mixin is only ever combined with a Trainer; at run time it stands alone
    from transformers import Trainer as _TrainerBase
    from transformers.trainer_utils import TrainOutput
else:
    _TrainerBase = object


class PackedTrainerMixin(_TrainerBase):
    """What PackedTrainer and PackedSFTTrainer add to a transformers ``Trainer`` (see the module docstring)."""

    # The loss is divided by the global batch's normaliser, gradient accumulation included.
    loss_is_scaled_for_ga: bool | None = True
    packed_dataset: PackedIterableDataset
    _real_tokens: int
    _real_tokens_since: float
    # Sequences and real tokens this rank trained on in this train() call, for the final speed figures.
    _run_sequences: int
    _run_tokens: int
    # Each source's training loss, on a mixture (PackedTrainer's compute_loss adds to it).
    _source_losses: SourceLosses | None = None
    # PackedTrainer's speed options; every bucket is compiled on the first training batch.
    speed: SpeedOptions | None = None
    _prewarmed: bool = False

    def _check_packed(self, train_dataset: Any, args: Any) -> PackedIterableDataset:
        if not isinstance(train_dataset, PackedIterableDataset):
            raise TypeError(f"{type(self).__name__} trains on a PackedIterableDataset, got {type(train_dataset).__name__}")
        if train_dataset.world_size != args.world_size:
            raise ValueError(
                f"the dataset reads rank {train_dataset.rank} of {train_dataset.world_size} but training runs on "
                f"{args.world_size} processes: create the TrainingArguments (which start torch.distributed) before "
                "the PackedIterableDataset, or pass it rank= and world_size="
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"{args.n_gpu} GPUs are visible to one process, so the trainer would use nn.DataParallel, which splits "
                "a packed batch along its first dimension; launch with torchrun (one process per GPU) or make one "
                "GPU visible (CUDA_VISIBLE_DEVICES)"
            )
        if args.dataloader_num_workers:
            raise ValueError(
                f"dataloader_num_workers={args.dataloader_num_workers}: {type(self).__name__} reads batches in the "
                "training process (faster than workers, and its checkpointed position is exact); set it to 0"
            )
        if args.per_device_train_batch_size != 1:
            per_batch = (f"{train_dataset.batch_rows} packed rows" if train_dataset.batch_rows
                         else f"up to {train_dataset.tokens_per_batch} tokens")
            warnings.warn(
                f"per_device_train_batch_size={args.per_device_train_batch_size} does not apply: each micro-batch is "
                f"one batch of the PackedIterableDataset ({per_batch}); set its batch_rows or tokens_per_batch "
                "instead. The trainer counts 1.", UserWarning, stacklevel=3)
            args.per_device_train_batch_size = 1
            self._train_batch_size = 1
        args.ignore_data_skip = True  # the loader seeks to its saved position; replaying batches would skip more
        if args.max_steps <= 0:
            args.max_steps = math.ceil(args.num_train_epochs * math.ceil(len(train_dataset) / args.gradient_accumulation_steps))
        return train_dataset

    def get_train_dataloader(self) -> DataLoader:
        pin = self.args.dataloader_pin_memory and torch.cuda.is_available()
        return DataLoader(EpochAfterEpoch(self.packed_dataset), batch_size=None, num_workers=0, pin_memory=pin)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The window's batches and ``num_items_in_batch``: their loss tokens (or weights) summed over all ranks."""
        if self.state.global_step >= self.state.max_steps:  # resumed from the last step: read nothing more
            return [], None
        batches = list(itertools.islice(epoch_iterator, num_batches))
        if not batches:
            return batches, None
        local = self._window_normalizer(batches)
        if world_size() == 1:  # under torchrun, a rank's share may hold none while others' do
            training.check_trained_tokens(local, self.state.global_step + 1, self.packed_dataset.source)
            total = training.count_on_device(local, device)  # copied without waiting for the GPU to drain
        else:
            total = global_loss_tokens(local, device)
        # With average_tokens_across_devices the trainer multiplies each rank's loss by the world size, which
        # DDP's gradient average undoes; without it, divide here instead.
        return batches, total if self.args.average_tokens_across_devices else total / world_size()

    def _window_normalizer(self, batches: list[dict]) -> float:
        """What the window's summed loss is divided by, on this rank: its loss tokens (or loss weights)."""
        return sum(batch_normalizer(b) for b in batches)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.speed is not None and not self._prewarmed:
            self._prewarmed = True
            self.speed.prewarm(model, self.model_inputs(model, inputs))
        self._real_tokens += inputs[NUM_REAL_TOKENS]
        self._run_tokens += inputs[NUM_REAL_TOKENS]
        self._run_sequences += num_sequences(inputs)
        return self._forward_backward(model, inputs, num_items_in_batch)

    def _forward_backward(self, model, inputs: dict, num_items_in_batch: Any) -> torch.Tensor:
        """The micro-batch's forward and backward; returns its loss (Trainer's ``training_step``)."""
        return super().training_step(model, inputs, num_items_in_batch)

    def _epochs_read(self) -> float:
        """The epochs of the dataset read so far on this rank: the epoch, plus the share of its rows read."""
        return self.packed_dataset.epochs_read()

    def _run_rates(self, runtime: float) -> dict[str, float]:
        """This ``train()`` call's sequences (examples, or the pieces of split ones) and real tokens per second,
        over all ranks."""
        totals = torch.tensor([self._run_sequences, self._run_tokens], dtype=torch.float64, device=self.args.device)
        if world_size() > 1:
            torch.distributed.all_reduce(totals)
        sequences, tokens = totals.tolist()
        return {"train_samples_per_second": round(sequences / runtime, 3) if runtime else 0.0,
                "train_tokens_per_second": round(tokens / runtime, 3) if runtime else 0.0,
                "train_samples": int(sequences), "train_tokens": int(tokens)}

    def model_inputs(self, model, inputs: dict) -> dict:
        """``loaders.train.models.model_inputs`` for ``model``: the counts stay only for the loss-position head."""
        full_logits = not getattr(self.accelerator.unwrap_model(model), "varpack_loss_head", False)
        # The trainer has already put the inputs on args.device (_prepare_inputs): the move is a no-op.
        return training.model_inputs(inputs, self.args.device, full_logits)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # The trainer's own epoch is step / max_steps, as the train DataLoader has no length.
        self.state.epoch = self._epochs_read()
        if "train_runtime" in logs:  # the trainer's figures assume per_device_train_batch_size samples a batch
            logs = {**logs, **self._run_rates(logs["train_runtime"])}
        if "loss" in logs:  # a training log: every rank is here
            now = time.perf_counter()
            tokens = global_loss_tokens(self._real_tokens, self.args.device).item()
            logs = {**logs, "real_tokens_per_s": tokens / max(now - self._real_tokens_since, 1e-9)}
            self._real_tokens, self._real_tokens_since = 0, now
            if self._source_losses is not None:
                logs.update({f"train_{name}_loss": loss for name, loss in self._source_losses.pop(distributed=True).items()
                             if loss is not None})
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Each eval build by ``_evaluate_one``, its metrics logged and passed to the callbacks' ``on_evaluate``. A
        dict evaluates each entry, under Trainer's prefix ``eval_NAME``, once every entry has passed
        ``_checked_eval_dataset``; a name, the trainer's entry of that name. A dataset that is not a packed build
        takes Trainer's own evaluation."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):  # as Trainer.get_eval_dataloader reads one
            dataset = self.eval_dataset[dataset]
        # Each entry of a dict here, not through Trainer.evaluate, which would take the stock path.
        named = ({f"{metric_key_prefix}_{name}": each for name, each in dataset.items()} if isinstance(dataset, dict)
                 else {metric_key_prefix: dataset})
        checked = {prefix: self._checked_eval_dataset(each) for prefix, each in named.items()}  # all, before any runs
        metrics: dict[str, float] = {}
        for prefix, each in checked.items():
            if each is None:  # not a packed build
                stock = named[prefix] if isinstance(dataset, dict) else eval_dataset
                metrics.update(super().evaluate(stock, ignore_keys, prefix))
                continue
            assert self.model is not None  # Trainer.__init__ sets it (from model_init when model is None)
            evaluated = self._evaluate_one(each, prefix)
            self.model.eval()  # logged in eval mode, as after Trainer's own evaluation (training_step resets it)
            self.log(evaluated)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, evaluated)
            metrics.update(evaluated)
        return metrics

    def _checked_eval_dataset(self, dataset: Any) -> PackedIterableDataset | None:
        """``dataset`` to evaluate packed, refused in one line when it was tokenized otherwise than the training build;
        None for a dataset that is not a packed build (Trainer's own evaluation runs it)."""
        _check_eval_tokenizer(dataset, self.packed_dataset)
        return dataset if isinstance(dataset, PackedIterableDataset) else None

    def _evaluate_one(self, dataset: PackedIterableDataset, prefix: str) -> dict[str, float]:
        """``evaluate_packed`` over all the rows of ``dataset`` (exact token and example means; a mixture's loss per
        source too), named ``PREFIX_loss``, ``PREFIX_perplexity``, ``PREFIX_mean_example_loss``, ``PREFIX_runtime``."""
        assert self.model is not None  # Trainer.__init__ sets it (from model_init when model is None)
        builds = dataset.builds if isinstance(dataset, PackedMixture) else {"": dataset.source}
        with self.compute_loss_context_manager():
            results = evaluate_sources(self.model, builds, batch_rows=dataset.batch_rows or 1, distributed=True)
        summary = pooled_summary(results)
        metrics = {f"{prefix}_loss": summary["mean_token_loss"], f"{prefix}_perplexity": summary["token_perplexity"],
                   f"{prefix}_mean_example_loss": summary["mean_example_loss"], f"{prefix}_runtime": summary["seconds"]}
        if isinstance(dataset, PackedMixture):
            metrics.update({f"{prefix}_{name}_loss": result.summary["mean_token_loss"] for name, result in results.items()})
        return metrics

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``, restoring this rank's loader position from the checkpoint first."""
        from safetensors import SafetensorError  # comes with transformers, which reads a checkpoint's weights with it

        if resume_from_checkpoint is True:  # the newest complete checkpoint; True: the trainer's error
            latest = latest_checkpoint(self.args.output_dir or ".", world_size())
            resume_from_checkpoint = str(latest) if latest is not None else True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_trainer_state(Path(resume_from_checkpoint))
            restore_loader_state(self.packed_dataset, resume_from_checkpoint)
        self._real_tokens, self._real_tokens_since = 0, time.perf_counter()
        self._run_tokens, self._run_sequences = 0, 0
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except pickle.UnpicklingError:  # transformers reads a checkpoint's pickled files with weights_only=True
            if not isinstance(resume_from_checkpoint, (str, os.PathLike)):
                raise
            raise CheckpointError(f"{refused_pickle(resume_from_checkpoint)}: refused: it holds objects other than "
                                  "tensors and plain values, and loading it would run their code") from None
        except SafetensorError as err:  # a checkpoint's truncated or damaged weights
            if not isinstance(resume_from_checkpoint, (str, os.PathLike)):
                raise
            raise training.unreadable_weights(resume_from_checkpoint, err) from None

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        self.state.epoch = self._epochs_read()  # as trainer_state.json records it
        # The trainer removes checkpoints beyond save_total_limit at the end of its save; here that waits until
        # this one is complete, so that a kill mid-save never leaves no complete checkpoint.
        run_dir = self._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.islink(path):  # the trainer writes in place: never through a link
            os.unlink(path)
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        os.makedirs(path, exist_ok=True)
        # Written last: a checkpoint that holds every rank's loader state is complete (loaders.train.checkpoint).
        save_loader_state(path, self.packed_dataset.rank, self.packed_dataset.state_dict())
        if world_size() > 1:
            torch.distributed.barrier()  # a checkpoint is complete once every rank has written its part
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)


@functools.cache
def _packed_trainer() -> type:
    from transformers import Trainer

    class PackedTrainer(PackedTrainerMixin, Trainer):
        """``transformers.Trainer`` on a PackedIterableDataset: see ``loaders/train/hf_trainer.py``.

        The loss is the model's (``use_loss_position_head`` works as it is); batches with
        ``loss_weights`` are reduced by ``loaders.loss_weights`` on the model's logits, or by the head.

        The Trainer's ``logging_nan_inf_filter`` (on by default) reads every step's loss on the host
        to drop a NaN or inf from the logged mean: a sync per step that leaves the GPU idle while the
        Trainer's Python runs, which costs most where the step is short (a small model, or the step
        graph). ``logging_nan_inf_filter=False`` (``scripts/train.py --trainer hf`` sets it) avoids it;
        a NaN loss then shows in the log instead of being hidden.
        """

        def __init__(self, model: Any = None, args: Any = None, *, train_dataset: PackedIterableDataset,
                     speed: SpeedOptions | None = None, **kwargs: Any) -> None:
            if speed is not None:
                if speed.step_graph:
                    _check_step_graph_args(args, model)
                speed.check_dataset(train_dataset, "PackedTrainer")
                if model is None:
                    raise ValueError("PackedTrainer: speed= applies to a model; pass model= (not model_init=)")
                speed.apply(model)
            from loaders.train.preference import NOT_SFT, is_preference_build

            if isinstance(train_dataset, PackedIterableDataset) and is_preference_build(train_dataset):
                raise ValueError(f"PackedTrainer: the dataset {NOT_SFT}; train it with PackedDPOTrainer")
            for dataset in _eval_datasets(kwargs.get("eval_dataset")):
                _check_eval_tokenizer(dataset, train_dataset)
            self.speed = speed
            super().__init__(model, args, train_dataset=train_dataset, **kwargs)
            self.packed_dataset = self._check_packed(train_dataset, self.args)
            if isinstance(train_dataset, PackedMixture):
                self._source_losses = SourceLosses(train_dataset.names, self.args.device)
            self.graphed: GraphedForwardBackward | None = None

        def _forward_backward(self, model, inputs: dict, num_items_in_batch: Any) -> torch.Tensor:
            """With ``speed.step_graph``, every micro-batch but a run's first as a CUDA graph replay
            (``GraphedForwardBackward``); the first compiles, then the shapes of an epoch's worth of batches ahead
            are captured."""
            if self.speed is None or not self.speed.step_graph:
                return super()._forward_backward(model, inputs, num_items_in_batch)
            # A mixture's training batch asks the graph for each sequence's loss, for the loss per source.
            per_sequence = {SEQUENCE_LOSSES: True} if self._source_losses is not None and SOURCE_IDS in inputs else {}
            if self.graphed is None:
                loss = super()._forward_backward(model, inputs, num_items_in_batch)
                # An epoch's worth of the batches ahead (into the next epoch after a resume), read from a copy of the
                # dataset, which leaves the trainer's position where it is.
                steps_left = self.state.max_steps - self.state.global_step
                ahead = itertools.islice(EpochAfterEpoch(copy.deepcopy(self.packed_dataset)),
                                         min(steps_left, len(self.packed_dataset)))
                self.graphed = GraphedForwardBackward(model, shapes=({**_graph_inputs(b), **per_sequence} for b in ahead))
                return loss
            # What Trainer.training_step does around the forward and backward, which the replay replaces.
            model.train()
            train_mode = getattr(self.optimizer, "train", None)
            if callable(train_mode):  # a schedule-free optimizer's training mode
                train_mode()
            # The batch's tensors are copied into the graph's inputs as they are (pinned, without a host sync).
            loss = self.graphed({**_graph_inputs(inputs), **per_sequence}, num_items_in_batch)
            steps = self.args.torch_empty_cache_steps
            if steps is not None and self.state.global_step % steps == 0:
                torch.cuda.empty_cache()
            if per_sequence:
                assert self._source_losses is not None and self.graphed.sequence_losses is not None
                self._source_losses.add(self.graphed.sequence_losses, inputs[SOURCE_IDS])
            return loss

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            batch, inputs = inputs, self.model_inputs(model, inputs)
            head = getattr(self.accelerator.unwrap_model(model), "varpack_loss_head", False)
            # A training batch of a mixture: its loss per source is counted too.
            source_losses = self._source_losses if model.training and SOURCE_IDS in batch else None
            if LOSS_WEIGHTS in inputs and not head:
                outputs = model(**{k: v for k, v in inputs.items() if k not in ("labels", LOSS_WEIGHTS, LOSS_WEIGHT_SUM)})
                loss = weighted_causal_lm_loss(outputs.logits, inputs["labels"], inputs[LOSS_WEIGHTS], num_items_in_batch)
            else:
                per_sequence = {SEQUENCE_LOSSES: True} if head and source_losses is not None else {}
                outputs = model(**inputs, num_items_in_batch=num_items_in_batch, **per_sequence)
                loss = outputs.loss
            if source_losses is not None:
                source_losses.add_outputs(outputs, batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * world_size()
            return (loss, outputs) if return_outputs else loss

    return PackedTrainer


@functools.cache
def _packed_sft_trainer() -> type:
    from trl import SFTTrainer

    # TRL's base class leaves loss_is_scaled_for_ga unannotated (= None), which mypy reads as type None.
    class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):  # type: ignore[misc]
        """TRL's ``SFTTrainer`` on a PackedIterableDataset: see ``loaders/train/hf_trainer.py``.

        The shards are the prepared dataset, so TRL's preparation and collator are skipped
        (``dataset_kwargs={"skip_prepare_dataset": True}``); ``processing_class`` is the
        tokenizer the shards were built with. The loss and metrics are TRL's (its fused LM head);
        batches with ``loss_weights`` are weighted on its per-token log-probabilities.
        """

        def __init__(self, model: Any, args: Any = None, *, train_dataset: PackedIterableDataset, **kwargs: Any) -> None:
            from trl import SFTConfig

            if args is None:
                args = SFTConfig(output_dir="trainer_output")
            if not isinstance(args, SFTConfig):
                raise TypeError(f"{type(self).__name__} takes an SFTConfig as args, got {type(args).__name__}")
            assert not isinstance(args.dataset_kwargs, str)  # SFTConfig parses a JSON string into a dict
            args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
            # Without a collator SFTTrainer builds its padding one; the train loader here needs none.
            kwargs.setdefault("data_collator", _already_collated)
            for dataset in _eval_datasets(kwargs.get("eval_dataset")):
                _check_eval_tokenizer(dataset, train_dataset)
            # SFTTrainer takes only a `datasets` dataset, and reads a row to tell the kind of data (text, not
            # images or prompt-completion pairs): a one-row stand-in, replaced by the shards right after.
            import datasets

            super().__init__(model, args, train_dataset=datasets.Dataset.from_dict({"input_ids": [[0]]}), **kwargs)
            self.train_dataset = train_dataset
            self.packed_dataset = self._check_packed(train_dataset, self.args)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = self.model_inputs(model, inputs)
            if LOSS_WEIGHTS not in inputs:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            weights = inputs.pop(LOSS_WEIGHTS)[:, 1:]
            inputs.pop(LOSS_WEIGHT_SUM, None)
            outputs = model(**inputs, use_cache=False, fused_lm_head=True)
            normalizer = weights.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -(outputs.log_probs * weights.to(outputs.log_probs.device)).sum() / normalizer
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * world_size()
            return (loss, outputs) if return_outputs else loss

    return PackedSFTTrainer


@functools.cache
def _packed_dpo_trainer() -> type:
    from transformers import Trainer

    from loaders.train import preference

    class PackedDPOTrainer(PackedTrainerMixin, Trainer):
        """DPO, IPO, SimPO or ORPO on a preference build's PackedIterableDataset, with what PackedTrainer adds.

        Takes what TRL's ``DPOTrainer`` takes: ``model``, ``ref_model`` (default: a frozen copy of ``model``,
        or, for a PEFT model, the model with its adapter turned off), ``args`` (a ``TrainingArguments``, or TRL's
        ``DPOConfig``, whose ``beta`` and ``loss_type`` "sigmoid", "ipo" or "robust" are read) and logs what it logs:
        ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` and ``rewards/margins`` beside
        ``loss``. ``preference`` (a ``loaders.train.preference.PreferenceConfig``) sets the objective instead;
        ``reference_log_probs`` reads the reference's log-probs from a file computed once
        (``write_reference_log_probs``) by the reference (``ref_model``, else ``model`` as given) instead of
        running it. ``label_smoothing`` is run with ``loss_type="robust"`` and refused with the others (whose TRL
        loss leaves it unused); any other DPOConfig setting that changes TRL's loss (``DPO_SETTINGS_NOT_RUN``) is
        refused unless left at its default. The loss of a step is the mean
        over all its pairs (every micro-batch of every rank). The model gets the loss-position head.

        ``evaluate()`` (``eval_dataset=``, e.g. with ``eval_strategy="steps"``) on a preference build runs
        ``loaders.train.preference_eval.evaluate_preference`` over all of its pairs, the ranks sharing them, with
        the training objective and reference: ``eval_loss`` is the mean loss per pair, beside ``eval_rewards/chosen``,
        ``eval_rewards/rejected``, ``eval_rewards/accuracies`` and ``eval_rewards/margins``. Stored reference
        log-probs are of the training build; another eval build takes its own file, ``eval_reference_log_probs``
        (computed by the same reference). An eval dataset that is not one preference build, or that was packed with another
        tokenizer than the training build's, is refused.
        """

        def __init__(self, model: Any = None, ref_model: Any = None, args: Any = None, *,
                     train_dataset: PackedIterableDataset, preference_config: Any = None,
                     reference_log_probs: str | os.PathLike[str] | None = None,
                     eval_reference_log_probs: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
            from loaders.train.loss_head import use_loss_position_head

            if model is not None and not getattr(model, "varpack_loss_head", False):
                use_loss_position_head(model)
            _check_dpo_settings(args)
            from_args = _preference_from_args(args)  # its settings are checked even when preference_config is given
            self.preference = preference_config or from_args
            # A stored reference, and the eval datasets, are checked before the Trainer makes its output directory.
            stored = self._stored_reference(model, ref_model, train_dataset, reference_log_probs)
            if eval_reference_log_probs is not None and stored is None:
                raise ValueError("eval_reference_log_probs: give reference_log_probs too (the training build's file, "
                                 "computed by the same reference)")
            self._eval_reference_log_probs = eval_reference_log_probs
            self._eval_references: dict[str, Any] = {}
            for dataset in _eval_datasets(kwargs.get("eval_dataset")):
                self._eval_reference(_preference_eval_dataset(dataset, self.preference.objective, train_dataset), stored,
                                     train_dataset)
            super().__init__(model, args, train_dataset=train_dataset, **kwargs)
            self.packed_dataset = self._check_packed(train_dataset, self.args)
            self.reference = None
            if self.preference.objective in preference.NEEDS_REFERENCE:
                self.reference = stored or self._make_reference(ref_model)
            self._reward_metrics = preference.RewardMetrics(self.args.device)
            self._pair_loss = preference.PairLoss(self.preference, self.reference, self._reward_metrics)

        def _stored_reference(self, model: Any, ref_model: Any, dataset: Any,
                              path: str | os.PathLike[str] | None) -> Any:
            """The reference log-probs of ``path``, refused unless computed on this build by the reference
            (``ref_model``, else ``model`` as given); None without a path."""
            if path is None:
                return None
            if self.preference.objective not in preference.NEEDS_REFERENCE:
                raise ValueError(f"reference_log_probs: the {self.preference.objective} objective uses no reference model")
            if not isinstance(dataset, PackedIterableDataset):
                raise TypeError(f"{type(self).__name__} trains on a PackedIterableDataset, got {type(dataset).__name__}")
            reference = ref_model if ref_model is not None else model
            if reference is None:
                raise ValueError("reference_log_probs: pass model= (or ref_model=), whose identity the file must carry")
            identity = preference.reference_identity(reference)
            return preference.Reference(stored=preference.ReferenceLogProbs(path, dataset.manifest, identity))

        def _make_reference(self, ref_model: Any) -> Any:
            from loaders.train.loss_head import frozen_copy, use_loss_position_head

            if ref_model is None and hasattr(self.model, "disable_adapter"):  # PEFT: the base model is the reference
                return preference.Reference(adapter_off=True)
            if ref_model is None:  # TRL's default: the model as it starts, frozen
                return preference.Reference(frozen_copy(self.accelerator.unwrap_model(self.model)))
            if not getattr(ref_model, "varpack_loss_head", False):
                use_loss_position_head(ref_model)
            return preference.Reference(ref_model.requires_grad_(False).eval().to(self.args.device))

        def _eval_reference(self, dataset: PackedIterableDataset, stored: Any, train_dataset: PackedIterableDataset) -> Any:
            """The stored reference log-probs of an evaluation on ``dataset`` (None: the training reference serves):
            the training build's file on that build, else ``eval_reference_log_probs``."""
            fingerprint = dataset.manifest.fingerprint
            if stored is None or fingerprint == train_dataset.manifest.fingerprint:
                return None
            if fingerprint not in self._eval_references:
                if self._eval_reference_log_probs is None:
                    raise ValueError(f"reference_log_probs holds the training build's reference log-probs, not those of the "
                                     f"eval build {dataset.source}: pass eval_reference_log_probs= the file "
                                     "write_reference_log_probs(reference, EVAL_BUILD) writes")
                self._eval_references[fingerprint] = preference.Reference(stored=preference.ReferenceLogProbs(
                    self._eval_reference_log_probs, dataset.manifest, stored.stored.identity))
            return self._eval_references[fingerprint]

        def _checked_eval_dataset(self, dataset: Any) -> PackedIterableDataset:
            """``dataset``, refused in one line unless it is one preference build tokenized as the training build
            whose stored reference log-probs, if the reference is stored, are at hand."""
            dataset = _preference_eval_dataset(dataset, self.preference.objective, self.packed_dataset)
            self._evaluation_reference(dataset)
            return dataset

        def _evaluation_reference(self, dataset: PackedIterableDataset) -> Any:
            """The reference of an evaluation on ``dataset``: the stored log-probs of that build, else the training one."""
            stored = self.reference if self.reference is not None and self.reference.stored is not None else None
            return self._eval_reference(dataset, stored, self.packed_dataset) or self.reference

        def _evaluate_one(self, dataset: PackedIterableDataset, prefix: str) -> dict[str, float]:
            """``evaluate_preference`` over every pair of ``dataset``: the mean loss per pair and TRL's reward metrics,
            named under ``prefix``."""
            from loaders.train.preference_eval import evaluate_preference

            assert self.model is not None  # Trainer.__init__ sets it
            with self.compute_loss_context_manager():
                result = evaluate_preference(self.model, dataset.source, self.preference, self._evaluation_reference(dataset),
                                             batch_rows=dataset.batch_rows or 1, distributed=True)
            return {**{f"{prefix}_{name}": value for name, value in result.metrics.items()}, f"{prefix}_runtime": result.seconds}

        def _window_normalizer(self, batches: list[dict]) -> float:
            return float(preference.pairs_in(batches))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, terms = self._pair_loss.loss_and_terms(model, inputs, self.model_inputs(model, inputs), num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * world_size()
            return (loss, terms) if return_outputs else loss

        def log(self, logs: dict[str, float], *args, **kwargs) -> None:
            if "loss" in logs:  # a training log: every rank is here
                logs = {**logs, **self._reward_metrics.pop(distributed=True)}
            super().log(logs, *args, **kwargs)

    return PackedDPOTrainer


# TRL DPOConfig settings that change its loss or reference and that PackedDPOTrainer does not run: refused unless
# left at their defaults (beta, loss_type and label_smoothing choose the objective).
DPO_SETTINGS_NOT_RUN = ("f_divergence_type", "use_weighting", "ld_alpha", "loss_weights", "sync_ref_model", "rpo_alpha",
                        "reference_free", "router_aux_loss_coef")


def _check_dpo_settings(args: Any) -> None:
    """Refuse, in one line naming them, the settings of a TRL ``DPOConfig`` that change the loss and are not run."""
    if not dataclasses.is_dataclass(args) or type(args).__name__ != "DPOConfig":
        return
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    changed = [f"{name}={getattr(args, name)!r}" for name in DPO_SETTINGS_NOT_RUN
               if name in defaults and getattr(args, name) != defaults[name]]
    if changed:
        raise ValueError(f"PackedDPOTrainer does not run DPOConfig's {', '.join(changed)}: they change TRL's loss; "
                         "leave them at their defaults")


def _check_step_graph_args(args: Any, model: Any) -> None:
    """Refuse, in one line, TrainingArguments or a model under which PackedTrainer cannot replay a micro-batch's
    forward and backward as a CUDA graph (``SpeedOptions(step_graph=True)``)."""
    if getattr(model, "is_gradient_checkpointing", False):
        # Turned on on the model itself (gradient_checkpointing_enable(), as PEFT's prepare_model_for_kbit_training
        # does): its recomputation reads the RNG state on the host, and a reentrant checkpoint hides the layers'
        # parameters from the graph's record of which ones get a gradient.
        raise ValueError("PackedTrainer: step_graph cannot capture the model's gradient checkpointing; call "
                         "model.gradient_checkpointing_disable() (SpeedOptions' activation_memory_budget recomputes "
                         "inside the compiled layers instead) or leave step_graph off")
    if args is None:
        cuda = torch.cuda.is_available()
    else:
        cuda = args.device.type == "cuda"
        if args.gradient_accumulation_steps > 1:
            raise ValueError(f"PackedTrainer: step_graph needs gradient_accumulation_steps=1, not "
                             f"{args.gradient_accumulation_steps}: a graph holds one micro-batch's gradients")
        if args.world_size > 1:
            raise ValueError(f"PackedTrainer: step_graph runs on one process, not {args.world_size}: DDP's gradient "
                             "all-reduce runs outside a graph; leave step_graph off under torchrun")
        if args.fp16:
            raise ValueError("PackedTrainer: step_graph does not scale the loss for fp16's gradient scaler, which runs "
                             "outside the graph; train in bf16 (bf16=True) or leave step_graph off")
        if args.deepspeed or args.fsdp:
            raise ValueError("PackedTrainer: step_graph captures the model's own forward and backward, which DeepSpeed "
                             "and FSDP replace with their sharded ones; leave step_graph off with them")
        if args.gradient_checkpointing:
            raise ValueError("PackedTrainer: step_graph cannot capture gradient checkpointing, which reads the RNG state "
                             "on the host to recompute; set gradient_checkpointing=False (SpeedOptions' "
                             "activation_memory_budget recomputes inside the compiled layers instead)")
        optim = str(getattr(args.optim, "value", args.optim))
        if "lomo" in optim or "layerwise" in optim:
            raise ValueError(f"PackedTrainer: step_graph cannot run optim={optim!r}, which updates the weights inside the "
                             "backward; choose another optimizer or leave step_graph off")
        if args.torch_compile:
            raise ValueError("PackedTrainer: step_graph captures the compiled layers of SpeedOptions(compile=True); "
                             "set torch_compile=False in TrainingArguments")
    if not cuda:
        raise ValueError("PackedTrainer: step_graph replays CUDA graphs and needs a CUDA GPU; leave it off here")


def _graph_inputs(batch: dict) -> dict:
    """A loader batch as ``GraphedForwardBackward`` takes it: what the loss-position head reads, where it is."""
    return {k: v for k, v in batch.items() if k != SOURCE_IDS}


def _eval_datasets(eval_dataset: Any) -> list[Any]:
    """The datasets of a Trainer's ``eval_dataset``: none, one, or each of a dict's."""
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def _preference_eval_dataset(dataset: Any, objective: str, train_dataset: Any) -> PackedIterableDataset:
    """``dataset``, refused in one line unless it is a PackedIterableDataset of one preference build tokenized as
    ``train_dataset``."""
    if dataset is None:
        raise ValueError("PackedDPOTrainer.evaluate: no eval dataset; pass eval_dataset= here or to the trainer")
    if not isinstance(dataset, PackedIterableDataset):
        raise TypeError(f"PackedDPOTrainer evaluates a PackedIterableDataset of a preference build, got {type(dataset).__name__}")
    if isinstance(dataset, PackedMixture):
        raise ValueError("PackedDPOTrainer evaluates one preference build, not a mixture: pass "
                         "eval_dataset={name: PackedIterableDataset(build)} to evaluate each build")
    if dataset.manifest.preference_layout is None:
        raise ValueError(f"PackedDPOTrainer: the eval dataset {dataset.source} is not a build of preference pairs: its "
                         f"eval_loss would be token cross-entropy, not the {objective} loss; evaluate it with "
                         "PackedTrainer or loaders.train.evaluate.evaluate_packed")
    _check_eval_tokenizer(dataset, train_dataset)
    return dataset


def _check_eval_tokenizer(dataset: Any, train_dataset: Any) -> None:
    """ValueError in one line when the eval build ``dataset`` was tokenized by another tokenizer than the training
    build (``loaders.mixture.tokenizer_difference``): its loss would be of ids the model was not trained to read."""
    if not isinstance(dataset, PackedIterableDataset) or not isinstance(train_dataset, PackedIterableDataset):
        return
    difference = tokenizer_difference(train_dataset.manifest, dataset.manifest)
    if difference is not None:
        raise ValueError(f"the eval build {dataset.source} and the training build {train_dataset.source} were tokenized "
                         f"differently ({difference}): evaluate a build packed with the training build's tokenizer")


def _preference_from_args(args: Any) -> Any:
    """The preference objective of TrainingArguments (DPO, beta 0.1) or of TRL's DPOConfig (its beta; loss_type
    "sigmoid", "ipo", or "robust" with its label_smoothing)."""
    from loaders.train.preference import PreferenceConfig

    loss_types = getattr(args, "loss_type", ["sigmoid"])
    loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    objectives = {"sigmoid": "dpo", "robust": "dpo", "ipo": "ipo"}
    if len(loss_types) != 1 or loss_types[0] not in objectives:
        raise ValueError(f"loss_type {loss_types}: PackedDPOTrainer runs 'sigmoid' (DPO), 'robust' or 'ipo'; for SimPO or "
                         "ORPO pass preference_config=PreferenceConfig('simpo' or 'orpo', beta=...)")
    smoothing = getattr(args, "label_smoothing", 0.0)
    if smoothing and loss_types[0] != "robust":
        raise ValueError(f"label_smoothing={smoothing}: TRL's {loss_types[0]!r} loss leaves it unused; "
                         "loss_type='robust' runs it (robust DPO), else leave it at 0.0")
    return PreferenceConfig(objectives[loss_types[0]], beta=getattr(args, "beta", 0.1), label_smoothing=smoothing)


def check_trainer_state(checkpoint: Path) -> None:
    """CheckpointError unless ``trainer_state.json`` holds the checkpoint's step (a non-negative integer, its
    ``checkpoint-STEP`` name's); a file missing or unreadable is left for the trainer to report."""
    path = checkpoint / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return
    step = state.get("global_step") if isinstance(state, dict) else None
    named = checkpoint.name.removeprefix(f"{CHECKPOINT_PREFIX}")
    if type(step) is not int or step < 0 or (named.isdigit() and step != int(named)):
        raise CheckpointError(f"{path}: global_step {step!r} is not the checkpoint's step"
                              f"{f' ({named})' if named.isdigit() else ''}; the file is corrupt or was edited")


def refused_pickle(checkpoint: str | os.PathLike[str]) -> Path:
    """The file of ``checkpoint`` that ``torch.load(weights_only=True)`` refuses (the checkpoint itself if none)."""
    for path in sorted(Path(checkpoint).iterdir()):
        if path.suffix in (".pt", ".pth", ".bin") and path.is_file():
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                return path
            except (RuntimeError, EOFError, OSError):
                continue
    return Path(checkpoint)


def num_sequences(batch: dict) -> int:
    """The data sequences of a batch (examples, or pieces of split ones), pad sequences and empty entries excluded."""
    cu = batch["cu_seq_lens_q"]
    return int(torch.count_nonzero(torch.diff(cu[cu <= batch[NUM_REAL_TOKENS]])))


def _already_collated(features: Any) -> Any:
    """A collator for batches that are already whole (the loader's)."""
    return features[0] if isinstance(features, list) else features


def __getattr__(name: str) -> type:
    # The classes subclass transformers' and TRL's trainers, so they are built on first use.
    if name == "PackedTrainer":
        return _packed_trainer()
    if name == "PackedSFTTrainer":
        return _packed_sft_trainer()
    if name == "PackedDPOTrainer":
        return _packed_dpo_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# PackedTrainer, PackedSFTTrainer and PackedDPOTrainer come from __getattr__, which imports transformers or TRL on first use.
__all__ = ["EpochAfterEpoch", "LOADER_STATE", "PackedDPOTrainer", "PackedSFTTrainer", "PackedTrainer", "PackedTrainerMixin",  # noqa: F822
           "loader_state_name"]
