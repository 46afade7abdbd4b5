"""Weights that span ranks: tied copies summed, the global gradient norm, the whole model gathered.

A weight read by stages on several ranks (T5's ``shared`` embedding, GPT-2's ``wte`` and
``lm_head``) has one copy per rank. Summing their gradients before the step gives each copy the
single-process gradient, so the copies stay identical without ever being sent. The lowest rank
holding a weight is its owner: it alone counts it in the gradient norm and sends it when the
model is gathered.

With replicas of the pipeline (`hf_ftpipe.runtime.replicas`) each replica sums its own copies; the
norm is over this rank's pipeline (every replica holds the same gradients by then), and the model is
gathered from the replica of the rank that receives it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.runtime.stage import StageSpec

__all__ = ["WeightSync"]


class WeightSync:
    """Cross-rank operations on one rank's weights.

    Constructing it creates one process group per set of ranks sharing weights in every replica:
    every rank must construct it, in the same order as the others. ``stage_rank`` names positions in
    a pipeline of ``layout``; `owner` answers in global ranks, of this rank's replica.
    """

    def __init__(
        self,
        graph: CostGraph,
        specs: Sequence[StageSpec],
        stage_rank: Sequence[int],
        messenger: Messenger,
        device: torch.device,
        layout: ReplicaLayout | None = None,
    ) -> None:
        self.graph = graph
        self.rank = messenger.rank
        self.layout = layout or ReplicaLayout(max(stage_rank) + 1, 1)
        self.replica = self.layout.replica_of(self.rank)
        self.messenger = messenger
        self.device = device
        self._reference: dict[str, torch.Tensor] | None = None
        """Shared weights' values at the last reconciliation (streaming schedules, `remember_tied`)."""
        holders: dict[str, set[int]] = defaultdict(set)
        for spec in specs:
            for name in graph.params_of(spec.nodes):
                holders[name].add(self.layout.global_rank(self.replica, stage_rank[spec.stage_index]))
        self.holders = {name: tuple(sorted(ranks)) for name, ranks in sorted(holders.items())}
        self._groups: list[tuple[list[str], dist.ProcessGroup]] = []
        by_ranks: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for name, ranks in self.holders.items():
            info = graph.params[name]
            if len(ranks) > 1 and info.requires_grad and not info.is_buffer:
                by_ranks[ranks].append(name)
        for ranks, names in sorted(by_ranks.items()):  # positions, alike in every replica
            positions = [self.layout.position_of(r) for r in ranks]
            for replica in range(self.layout.data_parallel_size):
                group = dist.new_group([self.layout.global_rank(replica, p) for p in positions])
                if replica == self.replica and self.rank in ranks:
                    self._groups.append((names, group))

    def close(self) -> None:
        """Destroy this rank's groups of shared weights (`PipelineEngine.close`)."""
        for _, group in self._groups:
            dist.destroy_process_group(group)
        self._groups = []

    def owner(self, name: str) -> int:
        return self.holders[name][0]

    def sum_tied_gradients(self, params: Mapping[str, nn.Parameter]) -> None:
        """Give every copy of a shared weight the sum of the copies' gradients."""
        for names, group in self._groups:
            grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.messenger.all_reduce(flat, group, "tied-weight gradients")
            offset = 0
            for name in names:
                size = params[name].numel()
                params[name].grad = flat[offset : offset + size].view_as(params[name]).clone()
                offset += size

    def remember_tied(self, params: Mapping[str, nn.Parameter]) -> None:
        """Note the current value of every weight shared with other ranks (see `reconcile_tied`)."""
        self._reference = {n: params[n].detach().clone() for names, _ in self._groups for n in names}

    def reconcile_tied(self, params: Mapping[str, nn.Parameter]) -> None:
        """Streaming schedules update each rank's copy of a shared weight with that rank's own
        gradients, at that rank's own pace. When the pipeline is empty the copies are made equal
        again: each becomes the reference value plus the sum of every copy's change since then —
        for SGD exactly the update with all the copies' gradients summed."""
        reference = self._reference
        if reference is None:
            return
        for names, group in self._groups:
            flat = torch.cat([(params[n].detach() - reference[n]).reshape(-1) for n in names])
            self.messenger.all_reduce(flat, group, "tied-weight changes")
            offset = 0
            for name in names:
                size = params[name].numel()
                with torch.no_grad():
                    params[name].copy_(reference[name] + flat[offset : offset + size].view_as(params[name]))
                offset += size
        self.remember_tied(params)

    def clip_grad_norm_(self, params: Mapping[str, nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (a shared weight counted once); returns the norm."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, param in params.items():
            if param.grad is not None and self.owner(name) == self.rank:
                squares += param.grad.detach().double().pow(2).sum()
        self.messenger.all_reduce(squares, self.messenger.pipeline_group, "squared gradient norms")
        total_norm = squares.sqrt().float()
        if max_norm < float("inf"):
            # clip_grads_with_norm_ scales the `.grad` of what it is given: pass the parameters.
            with_grads = [p for p in params.values() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total_norm.to(self.device))
        return total_norm

    def gather(
        self, local: Mapping[str, torch.Tensor], names: Iterable[str], dst: int
    ) -> dict[str, torch.Tensor] | None:
        """The tensors ``names`` on rank ``dst`` (CPU), each sent by its owner; ``None`` on other ranks.

        One tensor is in flight at a time, so no rank holds more than its own weights plus one. Only the
        replica of ``dst`` takes part: the others hold the same weights.
        """
        if self.layout.replica_of(dst) != self.replica:
            return None
        gathered: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            owner = self.owner(name)
            if owner == dst == self.rank:
                gathered[name] = local[name].detach().cpu().clone()
            elif self.rank == owner:
                work = dist.isend(local[name].detach().contiguous(), dst)
                self.messenger.wait(work, f"sending {name} to rank {dst}", (dst,))
            elif self.rank == dst:
                info = self.graph.params[name]
                buffer = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device=self.device)
                self.messenger.wait(dist.irecv(buffer, owner), f"receiving {name} from rank {owner}", (owner,))
                gathered[name] = buffer.cpu()
        return gathered if self.rank == dst else None
