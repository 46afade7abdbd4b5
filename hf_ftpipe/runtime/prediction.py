"""Weight prediction for ``async``: run a micro-batch on the weights its gradient will meet.

Under PipeDream's schedule a micro-batch's gradient is applied k updates after its forward read
the weights (k is the number of older micro-batches still in flight at the stage, divided by the
micro-batches per update). A momentum optimizer's next updates point roughly along its current
update direction, so the forward can run on W − k·lr·d instead of W (SpecTrain, Chen et al. 2018;
PipeMare, Yang et al. 2021), which shrinks the staleness the gradient sees. The backward runs on the
same predicted weights; the gradient is applied to the real ones.

Directions: SGD with momentum, its momentum buffer (PyTorch's update is W −= lr·buf); Adam and
AdamW, the bias-corrected m / (√v + ε) (decoupled weight decay left out). Parameters with no
optimizer state yet (before the first update) are not moved.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hf_ftpipe.errors import PipelineError

__all__ = ["check_predictable", "predicted_weights", "updates_ahead"]


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers without a momentum to extrapolate, naming what would work."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    if isinstance(optimizer, torch.optim.SGD) and all(g.get("momentum", 0) > 0 for g in optimizer.param_groups):
        return
    raise PipelineError(
        f"weight prediction extrapolates a momentum, which {type(optimizer).__name__} "
        f"{'without momentum ' if isinstance(optimizer, torch.optim.SGD) else ''}does not keep; use SGD with "
        "momentum > 0, Adam or AdamW, or turn weight prediction off"
    )


def updates_ahead(backwards_done: int, older_in_flight: int, update_every: int) -> int:
    """How many updates of the stage come between now and the one applying the next micro-batch's
    gradient: that micro-batch's backward is number ``backwards_done + older_in_flight`` (from 0),
    and an update follows every ``update_every``-th backward."""
    applied_by = (backwards_done + older_in_flight) // update_every  # the update taking its gradient
    return applied_by - backwards_done // update_every


def predicted_weights(
    params: Mapping[str, nn.Parameter], optimizer: torch.optim.Optimizer, steps: int
) -> dict[str, torch.Tensor]:
    """``W − steps·lr·d`` for every parameter, as new leaf tensors (they require grad when the
    parameter does); the parameters themselves when ``steps`` is 0."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    predicted: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        direction = _direction(param, optimizer, group_of.get(id(param))) if steps else None
        with torch.no_grad():
            value = (
                param.detach().clone() if direction is None else param - steps * group_of[id(param)]["lr"] * direction
            )
        predicted[name] = value.requires_grad_(param.requires_grad)
    return predicted


def _direction(param: nn.Parameter, optimizer: torch.optim.Optimizer, group: dict | None) -> torch.Tensor | None:
    state = optimizer.state.get(param)
    if not state or group is None:
        return None
    if "momentum_buffer" in state:
        return state["momentum_buffer"]
    if "exp_avg" in state:
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        first = state["exp_avg"] / (1 - beta1**step)
        second = state["exp_avg_sq"] / (1 - beta2**step)
        return first / (second.sqrt() + group["eps"])
    return None
