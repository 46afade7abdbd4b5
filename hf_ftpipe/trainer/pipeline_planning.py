"""Planning a PipeTrainer's pipeline: the model traced at the planned micro-batch, the plan made or
loaded on rank 0 and shared (`hf_ftpipe.trainer.plan_sharing`); under ``auto_find_batch_size``, for
the largest batch a plan fits.

`Trainer`'s ``auto_find_batch_size`` runs the training loop and, at an out-of-memory error, runs it
again with 90% of the batch. A pipeline knows before it runs whether a batch fits: its plan is made
against each GPU's memory, and no plan fitting is an error of its own (`PlanDoesNotFitError`, raised
on every rank). So PipeTrainer searches while planning. ``num_microbatches`` stays and the rows of a
micro-batch are searched: the batch as given is planned first (a batch that fits costs nothing
more), then, since a plan that fits r rows fits fewer, a binary search finds the most rows that fit
in ⌈log2 r⌉ plans or fewer. Training runs at that batch, which ``args.per_device_train_batch_size``
then holds, with a warning naming both; a resumed run starts from the batch its checkpoint records,
as `Trainer` trains at it. An out-of-memory error while training (the memory model
is an estimate) stops every rank with an error naming the batch: `Trainer`'s retry at a smaller
batch would run on the rank that ran out alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from datasets import Dataset
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerState

from hf_ftpipe.errors import PipelineError, PlanDoesNotFitError
from hf_ftpipe.graph.token_slices import SlicedModel
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.trainer.plan_sharing import SharedPlan, share_partition
from hf_ftpipe.trainer.planned_shapes import longest_rows, planned_microbatch
from hf_ftpipe.trainer.replicas import global_batch_size
from hf_ftpipe.trainer.run_log import get_logger
from hf_ftpipe.trainer.token_slicing import capture_for_pipeline

__all__ = ["PipePlanning"]

logger = get_logger(__name__)


class PipePlanning:
    """The `PipeTrainer` mixin that traces and plans the pipeline (`_plan_pipeline`).

    Reads ``args``, ``model``, ``watchdog``, the datasets, ``data_collator``, ``data_randomness`` and the
    checkpoint resumed from; under ``auto_find_batch_size`` sets ``args.per_device_train_batch_size`` and
    ``_train_batch_size``.
    """

    def _plan_pipeline(self, inputs: dict[str, Any]) -> tuple[Any, SharedPlan]:
        """The traced model and the shared plan for ``per_device_train_batch_size`` (``inputs``: a training
        batch, of at least that many rows), or under ``auto_find_batch_size`` for the largest batch that fits."""
        if not self.args.auto_find_batch_size:
            return self._plan_batch(inputs)
        resumed = self._resumed_batch_size()
        if resumed is not None:  # `Trainer` restores it too, and trains at it
            self._set_batch_size(resumed)
        given, microbatches = self.args.per_device_train_batch_size, self.args.num_microbatches
        try:
            return self._plan_batch(inputs)
        except PlanDoesNotFitError as error:
            failure = error
        fits, fails, planned = 0, given // microbatches, None  # rows per micro-batch that fit / do not
        while fails - fits > 1:
            rows = (fits + fails) // 2
            self._set_batch_size(rows * microbatches)
            try:
                planned, fits = self._plan_batch(inputs), rows
            except PlanDoesNotFitError as error:
                failure, fails = error, rows
        self._set_batch_size(given if planned is None else fits * microbatches)
        if planned is None:
            raise PlanDoesNotFitError(
                f"auto_find_batch_size: no batch of num_microbatches={microbatches} micro-batches fits the GPUs' "
                f"memory, down to one row each: {failure.reason}",
                failure.advice,
                "trainer",
            ) from failure
        logger.warning(
            "auto_find_batch_size: per_device_train_batch_size=%d does not fit the GPUs' memory; training with %d "
            "(%d micro-batches of %d rows), the largest that fits",
            given,
            fits * microbatches,
            microbatches,
            fits,
        )
        return planned

    def _resumed_batch_size(self) -> int | None:
        """The per-device batch a resumed run trained at, as its checkpoint's state records it (None: none)."""
        if self._resume_from is None:
            return None
        state = TrainerState.load_from_json(os.path.join(self._resume_from, TRAINER_STATE_NAME))
        if state.train_batch_size is None:
            return None
        return state.train_batch_size // global_batch_size(1, self.args)  # the state holds the global batch

    def _set_batch_size(self, size: int) -> None:
        self.args.per_device_train_batch_size = size
        self._train_batch_size = global_batch_size(self.args.train_batch_size, self.args)

    def _update_auto_batch_size(self, batch_size: int) -> None:
        """`Trainer` calls it as each run of its training loop starts under ``auto_find_batch_size``; a batch
        other than the planned one is accelerate retrying after an out-of-memory error, on this rank alone."""
        if batch_size != self._train_batch_size:
            raise PipelineError(
                f"out of memory at per_device_train_batch_size={self.args.per_device_train_batch_size} although "
                "the plan fits the GPUs' memory by the memory model's estimate; PipeTrainer does not retry at a "
                "smaller batch (the other ranks run the plan made for this one): raise partition_memory_headroom, "
                "or lower per_device_train_batch_size"
            )
        super()._update_auto_batch_size(batch_size)

    def _plan_batch(self, inputs: dict[str, Any]) -> tuple[Any, SharedPlan]:
        rows = microbatch_rows(self.args.per_device_train_batch_size, self.args.num_microbatches)[0]  # the largest
        # Any batch serves to trace (only its shapes matter); the plan is for the largest micro-batch.
        microbatch = {n: value[:rows] if isinstance(value, torch.Tensor) else value for n, value in inputs.items()}
        planned = self._planned_shapes(inputs, rows)
        if any(p.is_meta for p in self.model.parameters()) and hasattr(self.model, "tie_weights"):
            # accelerate.init_empty_weights registers a new tensor per name, untying shared weights.
            self.model.tie_weights()
        traced = capture_for_pipeline(self.args, self.model, microbatch, self.watchdog, planned=planned)
        # A sliced model is planned on its whole-sequence graph, the computation its slices add up to.
        whole = traced.full if isinstance(traced, SlicedModel) else traced
        slices = traced.slice_lengths if isinstance(traced, SlicedModel) else None
        return traced, share_partition(self.args, whole, self._planned_batch(whole), self.watchdog, token_slices=slices)

    def _planned_shapes(self, batch: dict[str, Any], rows: int) -> dict[str, tuple[int, ...]]:
        """The largest micro-batch the run will see (`hf_ftpipe.trainer.planned_shapes`)."""
        columns = [name for name, value in batch.items() if isinstance(value, torch.Tensor) and value.dim() > 1]
        datasets = [self.train_dataset]
        evaluation = self.eval_dataset
        datasets += list(evaluation.values()) if isinstance(evaluation, dict) else [evaluation]
        usable = [self._remove_unused_columns(d, "planning") for d in datasets if isinstance(d, Dataset)]
        longest = None
        if usable and self.args.plan_max_length is None and columns:
            # A random collator must not draw from the run's generators, nor advance its own.
            with self.data_randomness.forked(self.data_collator):
                longest = longest_rows(usable, self.data_collator, columns)
        return planned_microbatch(batch, rows, longest, self.args.plan_max_length)

    @staticmethod
    def _planned_batch(traced: Any) -> dict[str, Any]:
        """The planned micro-batch as meta tensors: what the planner reads its size from."""
        return {
            name: torch.empty(info.shape, device="meta")
            for name, info in traced.cost_graph.inputs.items()
            if info.shape is not None
        }
