"""A mini-batch as micro-batches, and the weights their losses take in the step's loss."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["check_loss_weights", "mean_loss", "split_batch"]


def split_batch(
    graph: CostGraph,
    batch: Mapping[str, Any],
    num_microbatches: int,
    device: torch.device,
    derived: Collection[str] = (),
) -> list[dict[str, Any]]:
    """The rank's own copy of the mini-batch as micro-batches of the traced shape; the inputs in
    ``derived`` are left out (the runtime makes them per micro-batch)."""
    microbatches: list[dict[str, Any]] = [{} for _ in range(num_microbatches)]
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
        expected = info.shape[0] * num_microbatches
        if tensor.shape[0] < num_microbatches:
            raise PipelineError(
                f"the batch has {tensor.shape[0]} samples, fewer than num_microbatches={num_microbatches}; "
                "raise the batch size or lower num_microbatches"
            )
        if tuple(tensor.shape) != (expected, *info.shape[1:]):
            raise PipelineError(
                f"{name!r} has shape {tuple(tensor.shape)} but the pipeline was traced for "
                f"{num_microbatches} micro-batches of {info.shape} = {(expected, *info.shape[1:])}; "
                "pad inputs to a fixed length and drop incomplete batches (dataloader_drop_last=True)"
            )
        for m, piece in enumerate(tensor.to(device).chunk(num_microbatches)):
            microbatches[m][name] = piece
    return microbatches


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
