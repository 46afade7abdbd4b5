"""What a rank keeps per micro-batch between its actions; streaming schedules carry it from one step to the next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hf_ftpipe.runtime.shapes import MicrobatchShapes
from hf_ftpipe.runtime.split_backward import DeferredWeightGradient
from hf_ftpipe.schedules.lowering import Comm

__all__ = ["MicrobatchState"]


@dataclass
class MicrobatchState:
    """Per-micro-batch tensors of one rank, keyed by micro-batch index ``m``.

    Args:
        actions_per_microbatch (`int`): forwards and backwards (and ``W``) this rank runs of each micro-batch.
    """

    actions_per_microbatch: int
    data: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The micro-batch's own inputs, read from the rank's copy of the batch."""
    shapes: dict[int, MicrobatchShapes] = field(default_factory=dict)
    """The shapes its values travel in and the sizes its stages read (`hf_ftpipe.runtime.shapes`)."""
    outputs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """Values produced here that stages here read (and, in evaluation, the model's outputs)."""
    received: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """Values received from other ranks, until every stage here that reads them ran its forward."""
    saved: dict[tuple[int, int], tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    """(stage, m) → the forward's input leaves and outputs, until its backward."""
    deferred: dict[tuple[int, int], list[DeferredWeightGradient]] = field(default_factory=dict)
    """(stage, m) → what a split backward's ``W`` needs, from its ``B`` until that ``W``."""
    grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """Gradients summed over the local readers of a value, until its producer or a SEND takes them."""
    posted: dict[Comm, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    """The RECVs posted and not yet read."""
    loss_weight: dict[int, float] = field(default_factory=dict)
    """Micro-batch → its weight in its mini-batch's loss, until every rank has read its loss."""
    loss_seed: dict[int, float] = field(default_factory=dict)
    """Micro-batch → the gradient its loss stage seeds the backward with, until that backward."""
    _actions_left: dict[int, int] = field(default_factory=dict)
    _reads: dict[tuple[str, int], int] = field(default_factory=dict)

    def value_read(self, value: str, m: int, readers: int) -> None:
        """A forward here read ``value`` of micro-batch ``m`` in training: after the last of its
        ``readers`` here, forget it. What a backward needs of it, autograd keeps (as the reader's
        saved input, or as ``W``'s x), and no longer: a GPU running several stages (a V, Mixed-Pipe)
        would otherwise hold every received activation until its micro-batch's last action there,
        which under ``zbv`` is a ``W`` at the end of the step."""
        key = (value, m)
        count = self._reads.get(key, 0) + 1
        if count < readers:
            self._reads[key] = count
            return
        self._reads.pop(key, None)
        self.received.pop(key, None)
        self.outputs.pop(key, None)

    def action_done(self, m: int) -> None:
        """Forget micro-batch ``m`` once this rank ran all its forwards and backwards of it."""
        left = self._actions_left.get(m, self.actions_per_microbatch) - 1
        if left:
            self._actions_left[m] = left
            return
        self._actions_left.pop(m, None)
        self.data.pop(m, None)
        self.shapes.pop(m, None)
        for store in (self.outputs, self.received, self.grads, self._reads):
            for key in [k for k in store if k[1] == m]:
                del store[key]
