"""Dynamic loss scaling for float16 that every pipeline rank agrees on.

float16 gradients underflow unless the loss is scaled up before the backward, and overflow when
it is scaled too far. `torch.amp.GradScaler` finds overflows on the gradients of one process and
decides alone; in a pipeline each rank holds other stages' gradients, so one stage may overflow
while the others do not. Applying the update on some stages and skipping it on others would
leave the model in a state no training step produces, and letting each rank move its own scale
would unscale the gradients by another factor than the last stage scaled the loss by. Here the
ranks all-reduce whether any of them saw an inf or NaN, and all skip the step together; the scale
then follows the same sequence on every rank, as GradScaler's rule does on one process: halve on
an overflow, double after ``growth_interval`` steps without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["AgreedLossScaler"]


class AgreedLossScaler:
    """The loss scale of a float16 pipeline, the same on every rank.

    Per step: the last stage seeds the backward with ``scale`` times the loss's gradient
    (`PipelineEngine.loss_scale`); `unscale_` divides the local gradients by it and returns
    whether any rank overflowed; the caller skips the optimizer step when it did; `update` moves
    the scale.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"`init_scale` must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} and {backoff_factor}"
            )
        if growth_interval < 1:
            raise ValueError(f"`growth_interval` must be at least 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Steps in a row without an overflow, since the scale last changed."""
        self.skipped_steps = 0
        """Optimizer steps skipped for an overflow over the whole run (for logs and tests)."""

    def unscale_(self, parameters: Iterable[torch.nn.Parameter], any_rank: Callable[[torch.Tensor], None]) -> bool:
        """Divide each local gradient by the scale; True when any rank found an inf or NaN.

        ``any_rank`` all-reduces a one-element float tensor with MAX over the pipeline's ranks, in place.
        """
        found = torch.zeros(())
        for param in parameters:
            if param.grad is None:
                continue
            param.grad.div_(self.scale)
            if found.device != param.grad.device:
                found = found.to(param.grad.device)
            found = torch.maximum(found, (~torch.isfinite(param.grad)).any().to(found.dtype))
        any_rank(found)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """GradScaler's rule, on a decision every rank shares."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, so a ``scaler.pt`` reads like Trainer's."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.good_steps = int(state["_growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
