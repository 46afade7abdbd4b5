"""What test_any_batch.py's cases plug into a Trainer: losses and metrics as scripts write them, a
hand-made plan whose loss stage is not where the logits are computed, and a schedule file."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import partition_seq_greedy, register_partitioner

from placements import logits_apart_placement

LOGITS_APART = "logits-apart"
"""The partitioner of the cases whose loss stage is not where the logits are computed (`logits_apart`)."""

named_partitioner: list[str | None] = [None]
"""The partitioner the case being run names (`run` sets it)."""


def logits_apart(graph: Any, *args: Any, **kwargs: Any) -> Any:
    """Three stages on ranks 0, 1, 0: the logits computed on rank 1, the loss (reading a view of them) on
    rank 0, as the default planner's Mixed-Pipe plan for run_clm.py's GPT-2 put them."""
    if named_partitioner[0] != LOGITS_APART:  # `auto` runs every registered one: other cases keep their plans
        raise PartitionError(f"{LOGITS_APART!r} plans only the cases that name it")
    plan = partition_seq_greedy(graph, *args, **kwargs)
    stage_device = [0, 1, 0]
    node_stage = logits_apart_placement(graph, stage_device)
    return replace(plan, node_stage=node_stage, stage_device=stage_device, partitioner=LOGITS_APART, predicted=None)


def token_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A ``compute_loss_func``: next-token cross-entropy at temperature 2 (not the model's own loss),
    summed and divided by ``num_items_in_batch``."""
    logits = outputs["logits"][:, :-1].float() / 2
    targets = labels[:, 1:]
    total = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def class_weighted_loss(
    self: Any, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
) -> Any:
    """A ``compute_loss`` override as transformers' docs show one: class-weighted cross-entropy on the
    logits (summed over rows, divided by the batch's count)."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    weight = torch.tensor([1.0, 3.0], device=labels.device)
    total = torch.nn.functional.cross_entropy(outputs.logits.float(), labels, weight=weight, reduction="sum")
    loss = total / (num_items_in_batch if num_items_in_batch is not None else len(labels))
    return (loss, outputs) if return_outputs else loss


def input_metrics(prediction: Any) -> dict[str, float]:
    """A ``compute_metrics`` reading ``include_for_metrics``' inputs (padded across batches with -100) and
    losses (one per row), beside accuracy."""
    inputs, losses = prediction.inputs, prediction.losses
    return {
        "input_token_sum": float(inputs[inputs != -100].sum()),
        "input_rows": float(inputs.shape[0]),
        "loss_mean": float(losses.mean()),
        "loss_rows": float(losses.size),
        "accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean()),
    }


def generated_metrics(prediction: Any) -> dict[str, float]:
    """Metrics of generated tokens, as a summarization script's compute_metrics reads them: the tokens
    generated (not padding, after the decoder start) and those equal to the label at their position."""
    tokens = torch.as_tensor(prediction.predictions)[:, 1:]
    labels = torch.as_tensor(prediction.label_ids)
    width = min(tokens.shape[1], labels.shape[1])
    real = (labels[:, :width] > 0) & (tokens[:, :width] > 0)  # neither pad (0) nor -100
    return {
        "generated_tokens": float((tokens > 0).sum()),
        "matching_tokens": float((real & (tokens[:, :width] == labels[:, :width])).sum()),
        "rows": float(tokens.shape[0]),
    }


def register_logits_apart() -> None:
    """Make `logits_apart` a partitioner, in the pipeline job's processes only: registered in the test
    process, it would be listed by the `hf-ftpipe compare` runs of other tests."""
    register_partitioner(LOGITS_APART)(logits_apart)


def write_schedule_file(schedule: str, num_microbatches: int, output_dir: str) -> str:
    """``OUTPUT_DIR/order.txt``: what ``hf-ftpipe schedule`` prints for ``schedule`` on stages [0, 1]
    for ``num_microbatches``. Every rank writes the same text, each through a file of its own
    renamed into place, so no rank reads another's half-written file."""
    from hf_ftpipe.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["schedule", "--placement", "0,1", "--schedule", schedule, "--num-microbatches", str(num_microbatches)])
    path = Path(output_dir) / "order.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    own = path.with_suffix(f".{os.getpid()}")
    own.write_text(printed.getvalue(), encoding="utf-8")
    os.replace(own, path)
    return str(path)


class StepSlices(TrainerCallback):
    """The token slices the pipeline cut each training step's sequences into (none without slicing)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.seen = trainer, []

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        slicing = getattr(getattr(self.trainer, "engine", None), "token_slicing", None)
        if slicing is not None:
            self.seen.append(list(slicing.slice_lengths))
