"""`PipeTrainer`'s data loading: every rank gets the same whole batches, in the same order.

Ranks are stages of one model: accelerate's sharding is undone, data loader workers are seeded
alike on every rank, and the batch size is not multiplied by the ranks. With ``data_parallel_size``
replicas the loader's batch is the global one, every replica's mini-batch (`PipeTrainer` sets
``_train_batch_size``; evaluation's likewise), which the engine splits among the replicas
(`hf_ftpipe.trainer.replicas`).
Batches may have any shape, a short last one included, as with `Trainer`; only the streaming
schedules (``async``, ``2bw``), which carry whole mini-batches from step to step, drop an
incomplete last batch, and refuse a training set smaller than one with the sizes that would fit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.trainer_utils import seed_worker

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.trainer.replicas import global_batch_size

__all__ = ["PipeDataLoading"]


class PipeDataLoading:
    """`PipeTrainer`'s data loading, as a mixin placed before `Trainer` (it needs `PipeTrainer`'s
    ``engine``, ``data_randomness`` and ``watchdog``)."""

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        is_training = kwargs.get("is_training", len(args) > 1 and args[1])
        drop_last = self.args.dataloader_drop_last
        # Streaming schedules carry whole mini-batches from step to step (see the module docstring).
        self.args.dataloader_drop_last = (bool(is_training) and self._streams_whole_batches()) or drop_last
        if not is_training:  # training's is the global batch already (`PipeTrainer._train_batch_size`)
            batch_size = global_batch_size(batch_size, self.args)  # the engine splits it among the replicas
        try:
            dataloader = super()._get_dataloader(dataset, description, batch_size, *args, **kwargs)
        finally:
            self.args.dataloader_drop_last = drop_last
        _unshard(dataloader)
        # Trainer seeds workers apart by rank, as replicas want; stages need the same batches.
        for loader in {id(x): x for x in (dataloader, getattr(dataloader, "base_dataloader", None))}.values():
            if getattr(loader, "worker_init_fn", None) is not None:
                loader.worker_init_fn = partial(seed_worker, num_workers=self.args.dataloader_num_workers, rank=0)
        if is_training:  # a checkpoint saves where the collations of batches loaded ahead started
            self.data_randomness.new_loader()
            loader = getattr(dataloader, "base_dataloader", dataloader)  # the loader accelerate's wraps
            loader.collate_fn = self.data_randomness.collating(loader.collate_fn)
        return dataloader

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, BatchRebalanceSampler) and sampler.dp_size > 1:
            # ``train_sampling_strategy="batch_rebalance"`` deals each rank its share of a batch of
            # ``world_size`` mini-batches; stages need the whole of one, as a single process draws it.
            sampler = BatchRebalanceSampler(
                lengths=sampler.lengths,
                effective_batch_size=sampler.effective_batch_size // sampler.dp_size,
                dp_size=1,
                grad_accum=sampler.grad_accum,
                shuffle=sampler.shuffle,
                seed=sampler.seed,
                rank=0,
                drop_last=sampler.drop_last,
            )
        return sampler

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        # The loader's first batch of an epoch also starts its iterator: accelerate broadcasts the
        # sampler's generator there, so the wait is bounded like any other collective.
        what = "loading the next training batch"
        with self.data_randomness.active(), self.watchdog.waiting(what, collective=True, runs_user_code=True):
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.data_randomness.trained(len(batches))
        return batches, count

    def get_total_train_batch_size(self, args: Any) -> int:
        # `_train_batch_size` is the global batch already (every replica's mini-batch): no rank is counted again.
        return self._train_batch_size * args.gradient_accumulation_steps

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> None:
        return None  # the pipeline weighs the micro-batch losses itself (see `_loss_weights`)

    def _first_batch(self, dataloader: Any) -> dict[str, Any]:
        """The batch the pipeline is traced on (only its shapes matter): looked at, not consumed, so
        neither the data's random state nor a collator's own generator advances (`Trainer` collates no
        such batch: its first batch must be masked with the same draws)."""
        if self.engine is not None:
            return {}
        with self.data_randomness.forked(self.data_collator, getattr(dataloader, "collate_fn", None)):
            batch = next(iter(dataloader), None)
        if batch is None:
            raise PipelineError(f"{_samples_of(dataloader)}, so there is no batch to trace the pipeline on")
        return batch

    def _streams_whole_batches(self) -> bool:
        """Streaming schedules train whole mini-batches only."""
        return not self.args.schedule_traits.flushes

    def _check_enough_training_data(self) -> None:
        """A streaming schedule trains on whole mini-batches only: a training set smaller than one
        gets a clear error instead of an empty epoch."""
        dataset = self.train_dataset
        if dataset is None or not hasattr(dataset, "__len__") or not self._streams_whole_batches():
            return
        # Under "auto" the loader's batch is one pipeline's whatever D is chosen: no replica multiplies it.
        replicas = 1 if self.args.data_parallel_size == "auto" else self.args.data_parallel_size
        samples, batch = len(dataset), self._train_batch_size
        if samples >= batch:
            return
        microbatches = self.args.num_microbatches
        per_replica = samples // replicas
        if per_replica >= microbatches:
            usable = per_replica - per_replica % microbatches
            fits = f"per_device_train_batch_size={usable} (a multiple of num_microbatches={microbatches})"
        else:
            fits = f"per_device_train_batch_size={max(per_replica, 1)} with num_microbatches={max(per_replica, 1)}"
        replicated = f" x data_parallel_size={replicas}" if replicas > 1 else ""
        raise PipelineError(
            f"the training set has {samples} samples, fewer than one mini-batch of per_device_train_batch_size="
            f"{self.args.per_device_train_batch_size}{replicated}; pipeline_schedule={self.args.pipeline_schedule!r} "
            f"trains on whole mini-batches only (an incomplete last batch is dropped). Use {fits}, or more data"
        )


def _samples_of(dataloader: Any) -> str:
    dataset = getattr(dataloader, "dataset", None)
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else "unknown number of"
    batch = getattr(dataloader, "total_batch_size", None) or getattr(dataloader, "batch_size", None)
    return f"the data loader yields no batch from its {size} samples (batch size {batch})"


def _unshard(dataloader: Any) -> None:
    """Make accelerate's sharded loader yield every batch on every rank (ranks are stages, not replicas)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is not None and hasattr(batch_sampler, "num_processes"):
        batch_sampler.num_processes, batch_sampler.process_index = 1, 0
        if hasattr(batch_sampler, "even_batches"):
            batch_sampler.even_batches = False
    dataset = getattr(dataloader, "dataset", None)
    if dataset is not None and hasattr(dataset, "num_processes") and hasattr(dataset, "process_index"):
        dataset.num_processes, dataset.process_index = 1, 0
