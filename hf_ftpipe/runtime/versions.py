"""Weight versions for the schedules that update while micro-batches are in flight.

Under ``async`` (PipeDream's weight stashing) a micro-batch's backward must use the weights its
forward used, although the stage may have updated since; under ``2bw`` mini-batch b runs on the
weights from before the previous update. A stage therefore runs its forward through a *view* of
its parameters (``torch.func.functional_call``), and autograd keeps that view for the backward.

A view is ``param.data``: it shares the parameter's storage but has its own version counter, so
it costs no memory while the weights do not change. When an update is about to change a
parameter whose storage a live view still shares, the parameter first moves to a fresh copy
(copy-on-write) and the view keeps the old storage: a stashed version exists exactly while some
micro-batch (or, for 2BW, the next mini-batch) still needs it, and is freed with its last user.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn

__all__ = ["PendingGradients", "StageVersions", "move_gradients"]


PendingGradients = dict[nn.Parameter, torch.Tensor]
"""Gradients accumulated for a parameter's next update, kept apart from ``param.grad``: between
steps the caller (`Trainer`) runs ``optimizer.step()`` and ``zero_grad()``, which must neither
apply nor drop gradients whose update is still to come in the pipeline."""


def move_gradients(
    tensors: Mapping[str, torch.Tensor], params: Mapping[str, nn.Parameter], pending: PendingGradients
) -> None:
    """Add the gradients a forward's weight tensors received to ``pending``, under the parameters
    they stand for."""
    for name, tensor in tensors.items():
        if tensor.grad is None:
            continue
        param = params[name]
        pending[param] = tensor.grad if param not in pending else pending[param] + tensor.grad
        tensor.grad = None


@dataclass
class _View:
    tensors: dict[str, torch.Tensor]
    users: int = 0
    pinned: bool = False
    """2BW: kept for the next mini-batch although no micro-batch uses it yet."""


@dataclass
class StageVersions:
    """The weight versions of one stage on this rank.

    Args:
        module (`fx.GraphModule`): the stage; its parameters are the current weights.
        keep_previous (`bool`): 2BW: each update keeps the weights it replaces for the next mini-batch.
        borrowed (`frozenset[str]`): weights this stage runs on its owner's versions of (`StreamingWeights`).
    """

    module: fx.GraphModule
    keep_previous: bool = False
    borrowed: frozenset[str] = frozenset()
    """Weights another stage versions (a shared weight's owner): no view of this stage holds them."""
    updates: int = 0
    """Updates applied so far: the current version's number."""
    _views: dict[int, _View] = field(default_factory=dict)
    _params: dict[str, nn.Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self._params = {name: p for name, p in self.module.named_parameters() if name not in self.borrowed}

    def acquire(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of weights ``version`` (the current one or a kept one) for one micro-batch's
        forward (run it with ``functional_call(module, tensors, args)``); counts the user."""
        view = self._view(version)
        view.users += 1
        return view.tensors

    def acquired(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors of weights ``version``, which a micro-batch in flight holds (no user counted)."""
        return self._views[version].tensors

    def backward_done(self, version: int, pending: PendingGradients) -> None:
        """A micro-batch that ran on ``version`` finished its backward: move its gradients to
        ``pending`` and free the version once nobody needs it."""
        view = self._views[version]
        move_gradients(view.tensors, self._params, pending)
        view.users -= 1
        self._release()

    def before_update(
        self, live: Callable[[], Iterable[torch.Tensor]], updated: Collection[nn.Parameter] | None = None
    ) -> None:
        """Prepare for an in-place update of this stage's parameters: 2BW keeps the current weights
        for the next mini-batch, and every parameter a live view still shares moves to its own copy.

        Args:
            live: every view of this rank still alive (other stages may share a tied weight).
            updated: the parameters the update may change (default: all); a weight another stage
                updates keeps its storage.
        """
        if self.keep_previous:
            self._view(self.updates).pinned = True
        else:  # a current view no micro-batch uses needs no copy
            view = self._views.get(self.updates)
            if view is not None and view.users == 0:
                del self._views[self.updates]
        shared = {tensor.untyped_storage().data_ptr() for tensor in live()}
        for param in self._params.values():
            if (updated is None or param in updated) and param.untyped_storage().data_ptr() in shared:
                param.data = param.data.clone()

    def after_update(self) -> None:
        self.updates += 1
        if self.keep_previous:  # the version before the previous one has served its mini-batch
            for number, view in self._views.items():
                if number < self.updates - 1:
                    view.pinned = False
        self._release()

    def settle(self) -> None:
        """The pipeline is empty: keep only the current weights."""
        for view in self._views.values():
            view.pinned = False
        self._release()
        self._views.pop(self.updates, None)

    def live_tensors(self) -> list[torch.Tensor]:
        return [tensor for view in self._views.values() for tensor in view.tensors.values()]

    @property
    def stashed(self) -> int:
        """Versions kept besides the current weights (what weight stashing costs right now)."""
        return sum(1 for number in self._views if number != self.updates)

    def _view(self, version: int) -> _View:
        if version not in self._views:
            if version != self.updates:
                raise RuntimeError(
                    f"weights version {version} of stage {self.module.__class__.__name__} is gone "
                    f"(current: {self.updates}); this is a bug in hf_ftpipe's schedule, please report it"
                )
            tensors = {name: param.data.requires_grad_(param.requires_grad) for name, param in self._params.items()}
            self._views[version] = _View(tensors)
        return self._views[version]

    def _release(self) -> None:
        for number in [n for n, v in self._views.items() if v.users == 0 and not v.pinned and n != self.updates]:
            del self._views[number]
