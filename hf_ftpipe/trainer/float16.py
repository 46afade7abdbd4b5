"""``fp16=True`` in PipeTrainer: float16 autocast with a loss scale every rank agrees on.

`Trainer` leaves float16 loss scaling to accelerate's `GradScaler`, which scales the loss of a
whole model and checks the gradients of one process. In a pipeline the loss lives on the last
stage and the gradients on every rank, so PipeTrainer switches accelerate's scaler off and runs
`AgreedLossScaler` instead: the last stage scales the loss's gradient, each rank unscales its own
gradients before the norm is taken, and a step in which any rank overflowed is skipped on every
rank, the learning-rate schedule included, as Trainer does on one GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers.trainer import SCALER_NAME

from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.trainer.loss_scale import AgreedLossScaler
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["Float16Training"]

logger = get_logger(__name__)


class Float16Training:
    """The per-step float16 bookkeeping of one PipeTrainer (``fp16=True``, gpipe or 1f1b)."""

    def __init__(self, scaler: AgreedLossScaler | None = None) -> None:
        self.scaler = scaler or AgreedLossScaler()
        self.skip_step = False
        """Whether this step's optimizer update is skipped: some rank's gradients overflowed."""
        self._unscaled = True

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` do nothing on a step that overflowed (Trainer calls it regardless).

        Called before the learning-rate scheduler is made, so the scheduler's own wrapper of
        ``step`` (which counts the calls) wraps this one.
        """
        step: Callable[..., Any] = optimizer.step

        def step_unless_overflowed(*args: Any, **kwargs: Any) -> Any:
            return None if self.skip_step else step(*args, **kwargs)

        optimizer.step = step_unless_overflowed  # type: ignore[method-assign]

    def start_step(self, engine: PipelineEngine) -> None:
        """Before the step's forward and backward: scale the loss's gradient."""
        engine.loss_scale = self.scaler.scale
        self._unscaled = False

    def unscale(self, engine: PipelineEngine, optimizer: Any) -> None:
        """After the backward, before the gradient norm: once per step, on every rank."""
        if self._unscaled:
            return
        self._unscaled = True
        scale = self.scaler.scale

        def any_rank(found: torch.Tensor) -> None:
            engine.messenger.all_reduce(found, dist.group.WORLD, "float16 overflow flags", op=dist.ReduceOp.MAX)

        self.skip_step = self.scaler.unscale_(engine.parameters(), any_rank)
        self.scaler.update(self.skip_step)
        # accelerate's flag for a step its GradScaler skipped: Trainer then keeps the learning rate.
        if hasattr(optimizer, "_is_overflow"):
            optimizer._is_overflow = self.skip_step
        if self.skip_step:
            logger.warning(
                "float16 gradients overflowed at loss scale %g: step skipped on every rank, scale now %g",
                scale,
                self.scaler.scale,
            )

    def save(self, output_dir: str, should_save: bool) -> None:
        if should_save:  # every rank holds the same scaler
            torch.save(self.scaler.state_dict(), os.path.join(output_dir, SCALER_NAME))

    def load(self, checkpoint_dir: str | None) -> None:
        path = os.path.join(checkpoint_dir, SCALER_NAME) if checkpoint_dir else None
        if path and os.path.isfile(path):
            self.scaler.load_state_dict(torch.load(path, weights_only=True))
