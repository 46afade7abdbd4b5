"""`PipeTrainer`'s training step: an accumulation window of mini-batches as one pipeline flush.

`Trainer` (transformers 5.x) fetches the ``gradient_accumulation_steps`` batches of one optimizer
step at once (`get_batch_samples`, fewer at the end of an epoch), then calls `training_step` on each
and steps the optimizer after the last. Here the first call runs the whole window through the
pipeline, its G batches' micro-batches as one flush of up to G x ``num_microbatches`` (any shapes
each: a batch padded to its own length stays as it is), so the bubble is paid once per update; each
call returns its own batch's loss, as `Trainer`'s would, for the logs.

Each micro-batch's loss weighs what it weighs in `Trainer`'s (see `hf_ftpipe.trainer.loss_weighting`):
where `Trainer` counts ``num_items_in_batch`` (the label tokens of the whole window), its token
count over that count, or over its own batch's where the model's loss ignores the count; otherwise
its share of its batch's rows, divided by the window's batches when `Trainer` divides by them
(``loss_is_scaled_for_ga``). A loss computed from the outputs (`hf_ftpipe.trainer.output_loss`) is
given the window's count and counts once per micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.trainer_pt_utils import find_batch_size

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.trainer.batch_check import check_same_batch
from hf_ftpipe.trainer.compilation import report_compilation
from hf_ftpipe.trainer.loss_weighting import label_counts, model_loss_counts_items, model_loss_shifts_labels
from hf_ftpipe.trainer.output_loss import (
    ModelOutputsOnly,
    check_called,
    computes_loss_from_outputs,
    method_name,
    overrides_compute_loss,
)

__all__ = ["PipeTrainingSteps"]


class PipeTrainingSteps:
    """`PipeTrainer`'s training step, as a mixin placed before `Trainer` (it needs the engine and
    `_ensure_engine` of `PipeTrainer`)."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window: list[Any] = list(batches)
        self._window_losses: list[torch.Tensor] | None = None
        return batches, num_items_in_batch

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        # Trainer's count is gathered over the ranks, as if they were replicas: PipeTrainer counts its own.
        window = getattr(self, "_window", None) or []
        index = next((i for i, batch in enumerate(window) if batch is inputs), None)
        if index is None:  # called outside Trainer's loop: a window of this batch alone
            window, index = [inputs], 0
        if index == 0 or self._window_losses is None:
            self._window_losses = self._train_window(window)
        return self._window_losses[index]

    def _train_window(self, window: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Forward and backward of every batch of ``window`` in one step of the pipeline; each batch's loss."""
        engine = self._ensure_engine(window[0])
        batches = [self._prepare_inputs(batch) for batch in window]
        for batch in batches:
            self.batch_digest = check_same_batch(batch, self.state.global_step + 1, self.watchdog, self.args.device)
        if self.float16 is not None:
            self.float16.start_step(engine)
        count = self._window_count(batches)
        from_outputs = computes_loss_from_outputs(self)
        weights = [w for batch in batches for w in self._loss_weights(batch, count, len(batches), from_outputs)]
        if from_outputs:
            self._outputs_loss_setup(batches, count)
        if len(batches) == 1:
            losses = [engine.train_step(batches[0], loss_weights=weights)]
        else:
            losses = list(engine.train_step(batches, loss_weights=weights))
        report_compilation(engine)
        return [loss.detach().to(self.args.device) for loss in losses]

    def _loss_weights(self, inputs: dict[str, Any], count: int | None, batches: int, from_outputs: bool) -> list[float]:
        """Each micro-batch's weight in the loss `Trainer` computes for ``inputs``, one of ``batches``
        batches of a window whose ``num_items_in_batch`` is ``count``.

        With ``count``, a model's own loss that divides by it (`model_loss_counts_items`) is the sum of
        token losses over the window's label tokens: micro-batch m weighs its own token count over
        ``count``; one that ignores it is its batch's own mean: m weighs its count over its batch's. A
        loss computed from the outputs is given ``count`` and weighs 1. Without: each micro-batch's share
        of the rows. `Trainer` then divides by the window's batches unless it takes the loss as
        normalised (its ``loss_is_scaled_for_ga``, true with ``count`` whether or not the model used it).
        """
        num_microbatches = self.engine.microbatches_per_batch  # every replica's: the global batch's
        if count is None:
            rows = find_batch_size(inputs)
            weights = [size / rows for size in microbatch_rows(rows, num_microbatches)]
        elif from_outputs:
            weights = [1.0] * len(microbatch_rows(find_batch_size(inputs), num_microbatches))
        else:
            counts = label_counts(inputs["labels"], num_microbatches, shifted=self._model_loss_shifts)
            if self._model_loss_counts(inputs["labels"]):
                weights = [n / count for n in counts]
            else:  # the model's mean over its own batch, which Trainer takes as scaled all the same
                weights = [n / sum(counts) if n else 0.0 for n in counts]
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and count is not None) or self.compute_loss_func is not None
        return weights if scaled else [w / batches for w in weights]

    def _window_count(self, batches: list[dict[str, Any]]) -> int | None:
        """``num_items_in_batch`` as `Trainer` counts it over a window's batches (``None``: it counts none)."""
        counts = [self._trainer_count(batch) for batch in batches]
        return None if any(count is None for count in counts) else sum(counts)

    def _trainer_count(self, inputs: dict[str, Any]) -> int | None:
        """The ``num_items_in_batch`` `Trainer` passes for ``inputs`` (training and evaluation alike), or
        ``None`` where it passes none."""
        labels = inputs.get("labels")
        counted = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if not counted or not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return None
        if isinstance(inputs.get("shift_labels"), torch.Tensor):
            return sum(label_counts(inputs["shift_labels"], 1, shifted=False))
        return sum(label_counts(labels, 1, shifted=getattr(self, "_loss_shifts_labels", False)))

    def _model_loss_counts(self, labels: torch.Tensor) -> bool:
        """`model_loss_counts_items` for this run's model, decided on its first labels."""
        if not hasattr(self, "_model_loss_counts_value"):
            self._model_loss_counts_value = model_loss_counts_items(self.model, labels)
        return self._model_loss_counts_value

    @property
    def _model_loss_shifts(self) -> bool:
        if not hasattr(self, "_model_loss_shifts_value"):
            self._model_loss_shifts_value = model_loss_shifts_labels(self.model)
        return self._model_loss_shifts_value

    # -- a loss computed from the outputs, on the last stage ----------------------------------

    def _outputs_loss_setup(self, batches: list[dict[str, Any]], count: int | None) -> None:
        """Give the engine the step's loss function: ``compute_loss`` on each micro-batch's outputs.

        The engine numbers the micro-batches of its own replica: replica d runs the d-th
        ``num_microbatches`` of each batch's ``D x num_microbatches`` (`hf_ftpipe.runtime.replicas`)."""
        num_microbatches = self.engine.microbatches_per_batch
        first = self.engine.replica * self.engine.num_microbatches
        mine = slice(first, first + self.engine.num_microbatches)
        microbatches, batch_counts = [], []
        for batch in batches:
            rows = find_batch_size(batch)
            pieces = min(rows, num_microbatches)
            split = [{} for _ in range(pieces)]
            for name, value in batch.items():
                parts = value.tensor_split(pieces) if _batched(value, rows) else [value] * pieces
                for piece, part in zip(split, parts, strict=True):
                    piece[name] = part
            microbatches += split[mine]
            batch_counts += [self._own_batch_count(batch)] * len(split[mine])
        items = None if count is None else torch.tensor(count, device=self.args.device)

        def loss_function(m: int, outputs: dict[str, torch.Tensor], data: Any) -> torch.Tensor:
            loss = self._loss_from_outputs(microbatches[m], outputs, items, batch_count=batch_counts[m])
            if items is not None and not getattr(self, "_loss_scaling_checked", False):
                self._check_loss_scaling(microbatches[m], outputs, items, loss, batch_counts[m])
            return loss

        self.engine.loss_function = loss_function

    def _own_batch_count(self, batch: dict[str, Any]) -> int | None:
        """The label tokens of ``batch``, where the model's own loss is a mean over them that ignores
        ``num_items_in_batch`` (else ``None``)."""
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or self._model_loss_counts(labels):
            return None
        return sum(label_counts(labels, 1, shifted=self._model_loss_shifts))

    def _check_loss_scaling(
        self,
        inputs: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        items: torch.Tensor,
        loss: torch.Tensor,
        batch_count: int | None = None,
    ) -> None:
        """Once per run: the micro-batches' losses add up to `Trainer`'s only if the loss is a sum divided
        by ``num_items_in_batch``, or, where the model's own loss ignores it (``batch_count``), in
        proportion to that loss (its batch's mean, shared out by the stand-in); a mean of its own would
        count once per micro-batch, silently."""
        self._loss_scaling_checked = True
        if self.label_smoother is not None and self.compute_loss_func is None and not overrides_compute_loss(self):
            return  # LabelSmoother divides by it
        detached = {k: v.detach() for k, v in outputs.items()}
        with torch.no_grad():
            halved = self._loss_from_outputs(inputs, detached, items * 2, batch_count=batch_count)
            doubled = (
                None
                if not batch_count
                else self._loss_from_outputs(inputs, detached, items, batch_count=batch_count / 2)
            )
        if doubled is not None and _close(halved, loss) and _close(doubled, 2 * loss):
            return  # the model's own loss, ignoring num_items_in_batch as it does under Trainer
        if not _close(2 * halved, loss):
            raise PipelineError(
                f"{method_name(self)} returned {loss.item():.6g} with num_items_in_batch={int(items)} but "
                f"{halved.item():.6g} with twice as many, not half: PipeTrainer computes it once per micro-batch, "
                "each with the whole accumulated batch's num_items_in_batch, and adds the losses up, which is "
                "Trainer's loss only for a sum over the items divided by num_items_in_batch (as transformers' "
                "losses are); divide a sum by num_items_in_batch instead of taking a mean"
            )

    def _loss_from_outputs(
        self,
        inputs: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        num_items_in_batch: Any,
        return_outputs: bool = False,
        label_count: int | None = None,
        batch_count: float | None = None,
    ) -> Any:
        """``self.compute_loss`` on the model's ``outputs`` for ``inputs`` (see `ModelOutputsOnly`)."""
        if label_count is None:
            labels = inputs.get("labels")
            label_count = (
                sum(label_counts(labels, 1, shifted=self._model_loss_shifts))
                if isinstance(labels, torch.Tensor) and labels.dim() > 0
                else 0
            )
        stand_in = ModelOutputsOnly(self.model, outputs, inputs, method_name(self), label_count, batch_count)
        if return_outputs:  # as Trainer.prediction_step calls it
            result = self.compute_loss(
                stand_in, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        else:  # as Trainer.training_step calls it
            result = self.compute_loss(stand_in, dict(inputs), num_items_in_batch=num_items_in_batch)
        check_called(stand_in)
        return result


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.detach().float(), want.detach().float(), rtol=1e-4, atol=1e-7)


def _batched(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows
