"""A mini-batch as micro-batches, and the weights their losses take in the step's loss."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas
from hf_ftpipe.runtime.shapes import input_shapes

__all__ = [
    "batch_losses",
    "batch_rows",
    "check_loss_weights",
    "check_planned",
    "mean_loss",
    "microbatch_rows",
    "split_batch",
]

Fit = Callable[[list[dict[str, Any]], bool], list[dict[str, Any]] | None]
"""Micro-batches (and whether they train) → each padded to the shape of the graph that runs it, checked;
``None`` when the planned graph takes them as they are (`hf_ftpipe.runtime.per_shape`)."""


def split_batch(
    graph: CostGraph,
    formulas: ShapeFormulas,
    batch: Mapping[str, Any],
    num_microbatches: int,
    device: torch.device,
    derived: Collection[str] = (),
    training: bool = True,
    fit: Fit | None = None,
) -> list[dict[str, Any]]:
    """The rank's own copy of the mini-batch as micro-batches; the inputs in ``derived`` are left
    out (the runtime makes them per micro-batch).

    A mini-batch of ``B`` rows gives ``min(B, num_microbatches)`` micro-batches whose sizes differ by
    at most one row (``torch.tensor_split``: 5 rows in 4 give 2, 1, 1, 1), so a short last batch
    trains whole. Sizes that vary (`hf_ftpipe.graph.dynamic_shapes`) may be anything up to the
    planned ones (the graph's input shapes); the others must equal them. Without ``training`` a
    micro-batch may be longer than planned, if it holds no more tokens than a planned one: a forward
    without backward keeps no activations, so it needs less memory than the training micro-batch
    the plan was made for (`PipeTrainer` evaluates longer rows in fewer-row pieces). ``fit`` runs
    micro-batches of sizes the model's export fixed on graphs traced at their shape.

    Raises:
        `PipelineError`: an input is missing, a size the model fixes differs, or a micro-batch is larger
            than planned (named, with the sizes and what to change).
    """
    rows = batch_rows(graph, batch)
    count = min(rows, num_microbatches)
    microbatches: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, info in graph.inputs.items():
        if name in derived:
            continue
        if info.shape is None:
            for mb in microbatches:
                mb[name] = info.constant
            continue
        if name not in batch:
            raise PipelineError(f"the batch has no {name!r}, which the traced model reads; batch keys: {sorted(batch)}")
        tensor = torch.as_tensor(batch[name])
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise PipelineError(
                f"{name!r} has shape {tuple(tensor.shape)}, but the batch has {rows} rows: every input needs one "
                "row per sample"
            )
        for m, piece in enumerate(tensor.to(device).tensor_split(count)):
            microbatches[m][name] = piece
    fitted = fit(microbatches, training) if fit is not None else None
    if fitted is not None:
        return fitted
    for microbatch in microbatches:
        formulas.bind(dict(input_shapes(microbatch)))
        check_planned(graph, microbatch, num_microbatches, training)
    return microbatches


def microbatch_rows(rows: int, num_microbatches: int) -> list[int]:
    """The rows of each micro-batch `split_batch` makes of ``rows`` rows (the larger ones first)."""
    count = min(rows, num_microbatches)
    return [rows // count + (1 if m < rows % count else 0) for m in range(count)] if count else []


def batch_rows(graph: CostGraph, batch: Mapping[str, Any]) -> int:
    """The rows (samples) of ``batch``, read from the first input of the graph it holds."""
    for name, info in graph.inputs.items():
        value = batch.get(name)
        if info.shape is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] == 0:
                raise PipelineError(f"the batch is empty ({name!r} has shape {tuple(value.shape)})")
            return int(value.shape[0])
    missing = [name for name, info in graph.inputs.items() if info.shape is not None and name not in batch]
    raise PipelineError(
        f"the batch has none of the tensors the traced model reads ({missing}); batch keys: {sorted(batch)}"
    )


def check_planned(
    graph: CostGraph,
    microbatch: Mapping[str, Any],
    num_microbatches: int,
    training: bool,
    per_shape: Collection[tuple[str, int]] = (),
) -> None:
    """A micro-batch larger than planned would not fit the memory the plan was made for: checked in
    the sizes that vary, and in ``per_shape`` (input, dimension), which graphs traced per shape vary."""
    for name, value in microbatch.items():
        info = graph.inputs.get(name)
        if info is None or info.shape is None or not isinstance(value, torch.Tensor):
            continue
        if not training and value.numel() <= math.prod(info.shape):
            continue
        for dim in sorted({*info.varying, *(d for n, d in per_shape if n == name)}):
            size, planned = int(value.shape[dim]), info.shape[dim]
            if size <= planned:
                continue
            if dim == 0:
                largest = planned * num_microbatches
                raise PipelineError(
                    f"{name!r} gives a micro-batch of {size} rows, but the pipeline was planned for at most {planned} "
                    f"({num_microbatches} micro-batches of a mini-batch of {largest}): a larger micro-batch may not "
                    f"fit the memory the plan was made for. Give batches of at most {largest} rows, or plan for "
                    "larger ones (PipeTrainer plans for `per_device_train_batch_size`; `capture_model(..., "
                    "planned=...)` sets the shapes a pipeline is planned for)"
                )
            raise PipelineError(
                f"{name!r} has length {size} (dimension {dim}), but the pipeline was planned for at most {planned}: "
                f"a longer sequence may not fit the memory the plan was made for. Set "
                f"PipeTrainingArguments(plan_max_length={size}) or more (the longest sequence of the run), "
                f"or truncate the data to at most {planned} tokens"
            )


def check_loss_weights(loss_weights: Sequence[float] | None, num_microbatches: int) -> list[float]:
    if loss_weights is None:
        return [1.0 / num_microbatches] * num_microbatches
    weights = [float(w) for w in loss_weights]
    if len(weights) != num_microbatches or any(not w >= 0 for w in weights):
        raise PipelineError(f"`loss_weights` needs one weight >= 0 per micro-batch ({num_microbatches}), got {weights}")
    return weights


def mean_loss(
    losses: list[tuple[int, torch.Tensor]], loss_weight: dict[int, float], num_microbatches: int, device: torch.device
) -> torch.Tensor:
    """The weighted loss of a step's micro-batches, which every rank has (see `Transfer.target_ranks`).

    Exactly ``sum(w[m] * loss[m])`` when they are one whole mini-batch; otherwise the mean of
    ``w[m] * num_microbatches * loss[m]``. Losses of weight 0 (NaN: no label) are left out. The
    weights of the micro-batches given are taken out of ``loss_weight``.
    """
    weights = [loss_weight.pop(m, 1.0 / num_microbatches) for m, _ in losses]
    if not losses:
        return torch.tensor(float("nan"), device=device)
    values = torch.stack([loss.float() for _, loss in losses])
    scale = torch.tensor(weights, dtype=values.dtype, device=values.device)
    total = torch.where(scale > 0, values * scale, torch.zeros_like(values)).sum()
    if len(losses) == num_microbatches:
        return total
    return total * num_microbatches / len(losses)


def batch_losses(
    losses: list[tuple[int, torch.Tensor]], loss_weight: dict[int, float], counts: Sequence[int], device: torch.device
) -> torch.Tensor:
    """One loss per mini-batch of a flush that ran several (gradient accumulation): ``sum(w[m] * loss[m])``
    over its units (micro-batches, or their token slices), numbered in order, ``counts[b]`` of them for
    mini-batch ``b``; losses of weight 0 are left out, as in `mean_loss`."""
    ends = [sum(counts[: b + 1]) for b in range(len(counts))]
    totals = torch.zeros(len(counts), dtype=torch.float32, device=device)
    for m, loss in losses:
        weight = loss_weight.pop(m, 0.0)
        if weight > 0:
            b = next(b for b, end in enumerate(ends) if m < end)
            totals[b] += weight * loss.float().to(device)
    return totals
