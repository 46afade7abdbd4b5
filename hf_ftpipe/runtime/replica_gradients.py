"""The replicas' gradients summed over the data group, bucketed, each stage's started as soon as
they are final in the step (PipeDream-2BW §3; torch DDP's buckets).

Flushing schedules: a stage's weight gradients are final after its last backward of the step (its
last W where the backward is split, ``zb-h1``, ``zbv``). From there its buckets (about 25 MB each,
DDP's default, one per stage and dtype at least) are all-reduced asynchronously while the rest of the
backward runs; the step waits for them at its end, before the tied-weight sum (sums commute). Every
replica must issue the same collectives in the same order, although a short batch gives a replica
fewer micro-batches (or none, whose step only joins the collectives): stages start in descending
index, a stage ready early waiting for the ones above it, and a weight several of this rank's stages
read (T5's ``shared`` embedding) goes last, at the end of the step.

Each bucket carries one flag per parameter, whether that replica had a gradient: a parameter no
replica computed a gradient for keeps ``None``, as in one process (an optimizer skips it).

``2bw`` sums a stage's pending gradients once per weight version, just before that stage's update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.replicas import ReplicaGroups
from hf_ftpipe.schedules.actions import Action
from hf_ftpipe.schedules.lowering import Op
from hf_ftpipe.schedules.registry import ScheduleTraits

__all__ = ["ReplicaGradients"]

BUCKET_BYTES = 25 * 2**20
"""torch DDP's default bucket size."""


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor
    """The gradients one after another, then one flag (had a gradient) per parameter."""
    work: dist.Work | None = None


class ReplicaGradients:
    """Sums one rank's gradients with the same position's in every other replica.

    Args:
        modules (`dict[int, nn.Module]`): this rank's stages.
        group (`dist.ProcessGroup`): the data group (this position in every replica).
        messenger (`Messenger`): bounds every wait.
        split_backward (`bool`): the schedule runs weight gradients as W actions.
        bucket_bytes (`int`): the largest bucket (one parameter larger than it is a bucket alone).
    """

    @classmethod
    def of(
        cls, modules: Mapping[int, nn.Module], groups: ReplicaGroups, messenger: Messenger, traits: ScheduleTraits
    ) -> ReplicaGradients | None:
        """The engine's, ``None`` with one replica."""
        return None if groups.data is None else cls(modules, groups.data, messenger, traits.split_backward)

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        group: dist.ProcessGroup,
        messenger: Messenger,
        split_backward: bool,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.group = group
        self.messenger = messenger
        self.final = "W" if split_backward else "B"
        self.bucket_bytes = bucket_bytes
        holders: dict[nn.Parameter, list[int]] = {}
        for s in sorted(modules):
            for param in modules[s].parameters():
                if param.requires_grad:
                    holders.setdefault(param, []).append(s)
        self.order = sorted(modules, reverse=True)
        """Stages in the order their buckets start (see the module)."""
        self.stage_params = {s: [p for p, stages in holders.items() if stages == [s]] for s in self.order}
        """Each stage's parameters that no other stage of this rank reads."""
        self.params_of = {s: [p for p, stages in holders.items() if s in stages] for s in self.order}
        self.shared_params = [p for p, stages in holders.items() if len(stages) > 1]
        self._left: dict[int, int] = {}
        self._ready: set[int] = set()
        self._started = 0
        self._buckets: list[_Bucket] = []
        self._actions_run = 0
        self.started_after: dict[int, int] = {}
        """The last step's stages → how many of this rank's actions had run when their buckets started
        (of the program's `actions_in_step`): the overlap, for tests and the curious."""
        self.actions_in_step = 0

    # -- flushing schedules -----------------------------------------------------------------

    def begin_step(self, program: Sequence[Op]) -> None:
        """Count the actions after which each stage's gradients are final in ``program``."""
        self._left = dict.fromkeys(self.order, 0)
        self._actions_run, self.started_after = 0, {}
        actions = [op for op in program if isinstance(op, Action)]
        self.actions_in_step = len(actions)
        for action in actions:
            if action.computation == self.final:
                self._left[action.stage_index] += 1
        self._ready, self._started, self._buckets = set(), 0, []
        for s in self.order:
            if self._left[s] == 0:  # none of its micro-batches here: nothing will change its gradients
                self._ready.add(s)
        self._start_ready()

    def action_done(self, stage_index: int, computation: str) -> None:
        """An action of ``stage_index`` ran; after its last B (or W) its buckets start."""
        self._actions_run += 1
        if computation != self.final or stage_index not in self._left:
            return
        self._left[stage_index] -= 1
        if self._left[stage_index] == 0:
            self._ready.add(stage_index)
            self._start_ready()

    def finish(self) -> None:
        """Start what has not started, wait for every bucket, and put the sums in ``param.grad``."""
        self._ready.update(self.order)
        self._start_ready()
        self._buckets += self._start(self.shared_params)
        for bucket in self._buckets:
            assert bucket.work is not None
            self.messenger.wait(bucket.work, "summing gradients over the replicas", peers=self._peers())
            for param, grad in _sums(bucket):
                if grad is not None:
                    param.grad = grad
        self._buckets = []

    def _start_ready(self) -> None:
        while self._started < len(self.order) and self.order[self._started] in self._ready:
            stage = self.order[self._started]
            self._buckets += self._start(self.stage_params[stage])
            self.started_after[stage] = self._actions_run
            self._started += 1

    def _start(self, params: list[nn.Parameter]) -> list[_Bucket]:
        buckets = [_flatten(chunk, [p.grad for p in chunk]) for chunk in self._chunks(params)]
        for bucket in buckets:
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        return buckets

    # -- 2bw --------------------------------------------------------------------------------

    def sum_pending(self, stage_index: int, pending: dict[nn.Parameter, torch.Tensor]) -> None:
        """Sum ``stage_index``'s gradients waiting for its update (``2bw``) over the replicas, in place."""
        for chunk in self._chunks(self.params_of[stage_index]):
            bucket = _flatten(chunk, [pending.get(p) for p in chunk])
            self.messenger.all_reduce(bucket.flat, self.group, "summing gradients over the replicas")
            for param, grad in _sums(bucket):
                if grad is not None:
                    pending[param] = grad

    # -- helpers ----------------------------------------------------------------------------

    def _chunks(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """``params`` cut into buckets of one dtype and at most ``bucket_bytes`` (a larger one alone)."""
        chunks: list[list[nn.Parameter]] = []
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for same in by_dtype.values():
            chunk: list[nn.Parameter] = []
            size = 0
            for param in same:
                nbytes = param.numel() * param.element_size()
                if chunk and size + nbytes > self.bucket_bytes:
                    chunks.append(chunk)
                    chunk, size = [], 0
                chunk.append(param)
                size += nbytes
            if chunk:
                chunks.append(chunk)
        return chunks

    def _peers(self) -> tuple[int, ...]:
        return tuple(r for r in dist.get_process_group_ranks(self.group) if r != self.messenger.rank)


def _flatten(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> _Bucket:
    pieces = [
        g.detach().reshape(-1) if g is not None else torch.zeros_like(p).reshape(-1)
        for p, g in zip(params, grads, strict=True)
    ]
    flags = torch.tensor([g is not None for g in grads], dtype=params[0].dtype, device=params[0].device)
    return _Bucket(params, torch.cat([*pieces, flags]))


def _sums(bucket: _Bucket) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
    """Each parameter's summed gradient (``None`` where no replica had one)."""
    flags = bucket.flat[-len(bucket.params) :]
    out, offset = [], 0
    for param, flag in zip(bucket.params, flags.tolist(), strict=True):
        size = param.numel()
        # in the weight's strides, as autograd gives them (a fused optimizer reads a gradient's memory in order)
        grad = torch.empty_like(param).copy_(bucket.flat[offset : offset + size].view_as(param)) if flag > 0 else None
        out.append((param, grad))
        offset += size
    return out
