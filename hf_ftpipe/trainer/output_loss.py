"""Losses computed from the model's outputs, outside its forward: `Trainer`'s ``label_smoothing_factor``,
``compute_loss_func`` and a subclass's ``compute_loss`` override, run on the pipeline's last stage.

`Trainer.compute_loss` calls ``model(**inputs)`` and post-processes the outputs (label smoothing, a
user's loss function). In a pipeline no rank holds the model, but the rank of the loss stage holds
its outputs (the logits) for each micro-batch. There `PipeTrainer` calls the trainer's own
``compute_loss`` with a stand-in for the model, `ModelOutputsOnly`, which answers the one forward
call with the outputs the pipeline computed. What tells a post-processing ``compute_loss`` from one
that needs the whole model is what it asks of the stand-in: a second call, inputs other than the
micro-batch's (changed, added, missing), or any part of the model (``model.transformer``,
``model.parameters()``) is an error naming the method; ``model.config`` is there to read.

The losses of a step's micro-batches are added up (`hf_ftpipe.trainer.training_steps` weighs them):
given ``num_items_in_batch`` (the label tokens of the whole accumulated batch), each micro-batch's
loss counts once, so a loss that sums over tokens and divides by it (as transformers' losses,
`LabelSmoother` and the losses `compute_loss_func` is documented for do) adds up to `Trainer`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import ModelOutput

from hf_ftpipe.errors import PipelineError

__all__ = [
    "ModelOutputsOnly",
    "check_called",
    "computes_loss_from_outputs",
    "method_name",
    "outputs_read",
    "overrides_compute_loss",
]

_ALLOWED_KEYWORDS = ("num_items_in_batch", "return_dict")
"""What `Trainer.compute_loss` adds to the inputs when it calls the model; they change no output."""


def overrides_compute_loss(trainer: Trainer) -> bool:
    """Whether ``trainer``'s class has a ``compute_loss`` of its own (not `Trainer`'s)."""
    return type(trainer).compute_loss is not Trainer.compute_loss


def computes_loss_from_outputs(trainer: Trainer) -> bool:
    """Whether ``trainer``'s loss is not the model's own: label smoothing, ``compute_loss_func`` or an
    overridden ``compute_loss``."""
    return (
        trainer.label_smoother is not None or trainer.compute_loss_func is not None or overrides_compute_loss(trainer)
    )


def outputs_read(trainer: Trainer, output_names: Sequence[str]) -> tuple[str, ...]:
    """The model outputs of ``output_names`` that ``trainer``'s loss reads on the loss stage, where the
    pipeline sends them from the stage that computes them (`hf_ftpipe.runtime.stage.plan_stages`).

    Label smoothing reads ``logits`` only (`LabelSmoother` takes ``outputs["logits"]``); a
    ``compute_loss_func`` or ``compute_loss`` is given every output. None when the loss is the model's.
    """
    if not computes_loss_from_outputs(trainer):
        return ()
    if trainer.compute_loss_func is None and not overrides_compute_loss(trainer):
        return tuple(name for name in output_names if name == "logits")
    return tuple(name for name in output_names if name != "loss")


def method_name(trainer: Trainer) -> str:
    """What the errors call the method that computes the loss."""
    if overrides_compute_loss(trainer):
        return f"{type(trainer).__name__}.compute_loss"
    return "compute_loss_func" if trainer.compute_loss_func is not None else "Trainer.compute_loss (label smoothing)"


class ModelOutputsOnly(nn.Module):
    """Stands in for the model in ``compute_loss``: one call with the micro-batch's inputs returns the
    model's outputs the pipeline computed for it, as a `ModelOutput`.

    Args:
        model (`nn.Module`): the user's model (its class name and ``config`` are read from it).
        outputs (`dict[str, torch.Tensor]`): the model's outputs by name, in its output order; ``loss``,
            if there, is the model's own mean over ``label_count`` label tokens.
        inputs (`Mapping[str, Any]`): the inputs the outputs were computed from.
        method (`str`): the method being run, for the errors.
        label_count (`int`): the label tokens the model's own loss is a mean over.
        batch_count (`float`, *optional*): where the model's loss ignores ``num_items_in_batch``
            (`hf_ftpipe.trainer.loss_weighting.model_loss_counts_items`), the label tokens of the
            micro-batch's whole batch: `Trainer`'s model returns the mean over them, whatever the count.
    """

    def __init__(
        self,
        model: nn.Module,
        outputs: dict[str, torch.Tensor],
        inputs: Mapping[str, Any],
        method: str,
        label_count: int,
        batch_count: float | None = None,
    ) -> None:
        super().__init__()
        self.config = getattr(model, "config", None)
        self._name = type(model).__name__
        self._outputs, self._inputs, self._method = outputs, inputs, method
        self._label_count, self._batch_count = label_count, batch_count
        self.calls = 0

    def _get_name(self) -> str:  # Trainer picks label smoothing's shift by the model's class name
        return self._name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        raise AttributeError(
            f"{self._method} read `model.{name}`, but PipeTrainer runs it on the pipeline's last stage with the "
            f"model's outputs only (the model's parts live on other ranks): a loss computed from `model(**inputs)`'s "
            f"outputs works; compute anything that needs the model inside its forward instead"
        )

    def forward(self, *args: Any, **kwargs: Any) -> ModelOutput:
        self.calls += 1
        if self.calls > 1 or args:
            raise PipelineError(
                f"{self._method} called the model {'again' if self.calls > 1 else 'with positional arguments'}; "
                "PipeTrainer runs it on the pipeline's last stage with the outputs of one forward of the "
                "micro-batch, so it may call `model(**inputs)` once; compute anything else inside the model's forward"
            )
        changed = sorted(set(_changed(kwargs, self._inputs)))
        if changed:
            raise PipelineError(
                f"{self._method} called the model with other inputs than the batch's ({changed}); PipeTrainer runs it "
                "on the pipeline's last stage with the outputs the pipeline computed from the batch as it is, so it "
                "may only post-process them; change the inputs in the data collator, or inside the model's forward"
            )
        outputs = dict(self._outputs)
        loss = outputs.pop("loss", None)
        if ("labels" in kwargs or "labels" not in self._inputs) and loss is not None:  # as the model returns it
            items = kwargs.get("num_items_in_batch")
            if items is not None:  # a sum over label tokens, divided by the accumulated batch's count
                count = items if self._batch_count is None else self._batch_count  # or its own batch's mean
                loss = loss * self._label_count / count if self._label_count else loss.new_zeros(())
            return ModelOutput(loss=loss, **outputs)
        return ModelOutput(**outputs)


def _changed(kwargs: Mapping[str, Any], inputs: Mapping[str, Any]) -> Iterator[str]:
    """The names whose values differ between the call and the batch (``labels`` may be left out)."""
    for name in set(kwargs) | set(inputs):
        if name in _ALLOWED_KEYWORDS and name not in inputs:
            continue
        if name not in kwargs:
            if name != "labels":
                yield name
            continue
        if name not in inputs:
            if kwargs[name] is not None:
                yield name
            continue
        given, own = kwargs[name], inputs[name]
        if given is own:
            continue
        if isinstance(own, torch.Tensor):
            if not (isinstance(given, torch.Tensor) and given.shape == own.shape and torch.equal(given, own)):
                yield name
        elif given != own:
            yield name


def check_called(stand_in: ModelOutputsOnly) -> None:
    if stand_in.calls == 0:
        raise PipelineError(
            f"{stand_in._method} never called the model; PipeTrainer runs it on the pipeline's last stage with the "
            "outputs of the model's forward, so it must compute the loss from `model(**inputs)`"
        )
