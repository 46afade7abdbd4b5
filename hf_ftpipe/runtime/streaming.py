"""The weights each micro-batch runs on under a streaming schedule, and the updates inside the pipeline.

The schedule's traits decide the version (`hf_ftpipe.schedules.registry`): with weight stashing
(``async``) a forward runs on the newest weights and its backward on the same ones; double
buffered (``2bw``) mini-batch b runs on the weights from before the previous update. Weight
prediction (``async`` with a momentum optimizer) runs it on weights extrapolated to the update
that will apply its gradient (`hf_ftpipe.runtime.prediction`).

A weight read by several stages of this rank (T5's ``shared`` embedding) is one tensor, versioned
with its owner, the first of those stages: every other reader runs micro-batch m, forward and
backward, on the version the owner ran m on (it reads the owner's stashed tensor), and the owner's
k-th update applies every reader's gradients for update k at once (the owner is the last to
finish each micro-batch's backward). A reader taking the tensor as it stands at its own forward
would get whatever updates the owner made in between, a version that depends on the order of
the rank's actions (docs/schedules.md states the rule).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from hf_ftpipe.runtime.prediction import predicted_weights, updates_ahead
from hf_ftpipe.runtime.versions import PendingGradients, StageVersions, move_gradients
from hf_ftpipe.schedules.registry import ScheduleTraits

__all__ = ["StreamingWeights"]


class StreamingWeights:
    """The weight versions of one rank's stages, the gradients waiting for their update, and the
    log of which version every forward used.

    Args:
        modules (`dict[int, fx.GraphModule]`): this rank's stages.
        traits (`ScheduleTraits`): the (streaming) schedule's.
        gradient_accumulation_steps (`int`): backwards per update when the schedule updates per group.
        weight_prediction (`bool`): run forwards on predicted weights.
        log (`list`): where to append ``(stage, micro-batch, version)`` of every forward (with weight
            prediction also the number of updates predicted ahead).
    """

    def __init__(
        self,
        modules: dict[int, fx.GraphModule],
        traits: ScheduleTraits,
        num_microbatches: int,
        gradient_accumulation_steps: int,
        weight_prediction: bool,
        log: list[tuple[int, ...]],
    ) -> None:
        self.modules = modules
        self.traits = traits
        self.num_microbatches = num_microbatches
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.weight_prediction = weight_prediction
        self.log = log
        self.backward_log: list[tuple[int, int, int]] = []
        """``(stage, micro-batch, weights version)`` of every backward run here: the version its
        gradient was taken at, which weight stashing makes its forward's."""
        self.pending_grads: dict[int, PendingGradients] = {s: {} for s in modules}
        """Each stage's gradients waiting for its next update (see `update`)."""
        holders: dict[nn.Parameter, list[int]] = {}
        for s in sorted(modules):
            for param in modules[s].parameters():
                holders.setdefault(param, []).append(s)
        self._shared = {param: stages for param, stages in holders.items() if len(stages) > 1}
        """Weights several of this rank's stages read, with those stages; the first one updates them."""
        self._shared_grads: dict[nn.Parameter, dict[int, torch.Tensor]] = {p: {} for p in self._shared}
        """Update number → the gradients for it a shared weight's stages have given so far."""
        self._names = {s: dict(m.named_parameters()) for s, m in modules.items()}
        self._owners = {
            s: {n: self._shared[p][0] for n, p in names.items() if self._shared.get(p, [s])[0] != s}
            for s, names in self._names.items()
        }
        """Stage → its shared weights that another (the owner) versions: name → owner."""
        self._borrowed: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        """(stage, micro-batch) → the owner's tensors of shared weights that forward ran on."""
        keep_previous = traits.weights == "double-buffered"
        self.versions = {
            s: StageVersions(m, keep_previous=keep_previous, borrowed=frozenset(self._owners[s]))
            for s, m in modules.items()
        }
        self.reset()

    def reset(self) -> None:
        """The pipeline is empty: count versions and backwards from here."""
        self._used_version: dict[tuple[int, int], int] = {}
        self._predicted: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._backwards = dict.fromkeys(self.modules, 0)  # since the pipeline was last empty
        self._version_base = {s: v.updates for s, v in self.versions.items()}

    def forward_weights(
        self, stage: int, m: int, older_in_flight: int, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, torch.Tensor]:
        """The tensors micro-batch ``m``'s forward of ``stage`` runs on (``older_in_flight``: the
        stage's micro-batches between forward and backward)."""
        version = self._version_for(stage, m)
        self._used_version[(stage, m)] = version
        if self.weight_prediction:
            assert optimizer is not None
            ahead = updates_ahead(self._backwards[stage], older_in_flight, self.gradient_accumulation_steps)
            weights = predicted_weights(dict(self.modules[stage].named_parameters()), optimizer, ahead)
            self._predicted[(stage, m)] = weights
            self.log.append((stage, m, version, ahead))
        else:
            weights = self._with_owners_versions(stage, m, self.versions[stage].acquire(version))
            self.log.append((stage, m, version))
        return weights

    def _with_owners_versions(self, stage: int, m: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` with each weight ``stage`` shares but does not own replaced by the tensor its
        owner ran micro-batch ``m`` on (a leaf of its own on the same storage, so the gradient stays
        apart: `backward_done` hands it to ``stage``'s pending gradients)."""
        borrowed: dict[str, torch.Tensor] = {}
        for name, owner in self._owners[stage].items():
            owners = self.versions[owner].acquired(self._used_version[(owner, m)])
            borrowed[name] = owners[name].detach().requires_grad_(owners[name].requires_grad)
        if not borrowed:
            return weights
        self._borrowed[(stage, m)] = borrowed
        return {**weights, **borrowed}

    def _version_for(self, stage: int, m: int) -> int:
        """Stashing: the newest; double buffering: those from before the previous update
        (mini-batch b runs on W(b - 1); the first two on the initial weights)."""
        versions = self.versions[stage]
        if self.traits.weights == "stashed":
            return versions.updates
        return self._version_base[stage] + max(m // self.num_microbatches - 1, 0)

    def backward_done(self, stage: int, m: int) -> None:
        """Micro-batch ``m``'s backward of ``stage`` ran: its gradients wait for the update."""
        version = self._used_version.pop((stage, m))
        self.backward_log.append((stage, m, version))
        if self.weight_prediction:
            params = dict(self.modules[stage].named_parameters())
            move_gradients(self._predicted.pop((stage, m)), params, self.pending_grads[stage])
            self._backwards[stage] += 1
        else:
            self.versions[stage].backward_done(version, self.pending_grads[stage])
            move_gradients(self._borrowed.pop((stage, m), {}), self._names[stage], self.pending_grads[stage])

    def update(
        self, stage: int, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, norms: list[torch.Tensor]
    ) -> None:
        """Step the optimizer on ``stage``'s parameters only, keeping stashed versions intact.

        Only this stage's pending gradients are put in ``param.grad`` for the step and taken out
        after it, so every other parameter has none and the optimizer leaves it alone. A weight
        shared with other stages of this rank is stepped by the first of them only, with all of
        their gradients for this update.
        """
        number = self.versions[stage].updates + 1
        params = []
        for param in self.modules[stage].parameters():
            grad = self.pending_grads[stage].pop(param, None)
            if param in self._shared:
                grad = self._shared_gradient(param, stage, number, grad)
                if self._shared[param][0] != stage:
                    continue
            param.grad = grad
            params.append(param)
        stepped = [p for p in params if p.grad is not None]
        if stepped:  # the norm is logged; clipping would multiply every gradient even by 1
            if max_grad_norm is None:
                norm = torch.nn.utils.get_total_norm([p.grad for p in stepped])
            else:
                norm = torch.nn.utils.clip_grad_norm_(stepped, max_grad_norm)
            norms.append(norm.detach().float())
        self.versions[stage].before_update(
            lambda: [t for v in self.versions.values() for t in v.live_tensors()], updated=set(params)
        )
        optimizer.step()
        for param in params:
            param.grad = None
        self.versions[stage].after_update()

    def _shared_gradient(
        self, param: nn.Parameter, stage: int, number: int, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Give ``stage``'s gradient of a shared weight to update ``number``; for its first stage,
        which updates it, return what all its stages gave (each stage finishes a micro-batch's
        backward, and so its update, before every stage in front of it)."""
        given = self._shared_grads[param]
        if grad is not None:
            given[number] = grad if number not in given else given[number] + grad
        stages = self._shared[param]
        if stages[0] != stage:
            return None
        behind = [s for s in stages if self.versions[s].updates + (s == stage) < number]
        if behind:
            raise RuntimeError(
                f"stage {stage} updates a weight it shares with stages {behind} before they gave their "
                f"gradients for update {number}; this is a bug in hf_ftpipe's schedule, please report it"
            )
        return given.pop(number, None)

    def settle(self) -> None:
        for versions in self.versions.values():
            versions.settle()
