"""What the contiguous partitioners share: the ops a stage may begin at, the checked request, the
priced split, and the cut of a list of weights into stages of about equal sums (``greedy_cuts``).

A contiguous (Seq-Pipe) plan cuts the execution order into ``num_stages`` pieces, stage s on GPU s;
asked for a V placement (``PlanRequest.placement = "v"``), 2·P pieces, stage s on GPU
min(s, 2P − 1 − s). The cuts balance the stages (equal stages are equal GPUs in a V too); in a V
each stage is cut to fit half a GPU (`ContiguousPlanner.stage_capacity`), and the plan's memory
is checked per GPU, its two stages together.
Ops that follow their producer (``plan.atoms``: parts of a multi-output op, side effects) are
never cut on: partitioners cut the list of the other ops (``CutOrder.cuttable``), and
``node_stage`` puts each follower in the latest stage among its producers.

The lowest layer of the partitioners: it imports none of them. Whether a plan fits memory, and
what would fit when it does not, is ``fit``'s (``fit.check_memory``), one layer up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hf_ftpipe.costmodel.op_time import NodeCost
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.atoms import follows_producer
from hf_ftpipe.plan.partition import Partition, PartitionKey
from hf_ftpipe.plan.request import PlanRequest

__all__ = ["ContiguousPlanner", "CutOrder", "greedy_cuts"]


@dataclass(frozen=True)
class CutOrder:
    """The execution order, and the ops in it that a stage may begin at."""

    order: list[str]
    cuttable: list[str]
    anchor: dict[str, str]
    """Every op → the cuttable op whose stage it takes (itself when cuttable)."""

    @classmethod
    def of(cls, graph: CostGraph) -> CutOrder:
        order = graph.topological_order()
        cuttable: list[str] = []
        anchor: dict[str, str] = {}
        position: dict[str, int] = {}
        for n in order:  # producers come first in execution order
            if follows_producer(graph, n):
                anchor[n] = max((anchor[u] for u in graph.graph.predecessors(n)), key=position.__getitem__)
            else:
                position[n] = len(cuttable)
                cuttable.append(n)
                anchor[n] = n
        return cls(order, cuttable, anchor)

    def node_stage(self, bounds: Sequence[int]) -> dict[str, int]:
        """Stage of every op (in execution order) for cuttable pieces ``[bounds[s], bounds[s+1])``."""
        stage_of: dict[str, int] = {}
        for s in range(len(bounds) - 1):
            for n in self.cuttable[bounds[s] : bounds[s + 1]]:
                stage_of[n] = s
        return {n: stage_of[self.anchor[n]] for n in self.order}


@dataclass(frozen=True, kw_only=True)
class ContiguousPlanner:
    """A request checked for a contiguous partitioner, with what every split of it shares: the op
    costs and the cut order; it turns cut positions into a priced plan."""

    name: str
    """The partitioner's name, recorded in its plans and its errors."""
    graph: CostGraph
    request: PlanRequest
    num_stages: int
    key: PartitionKey
    costs: dict[str, NodeCost]
    cut_order: CutOrder
    gpu_costs: list[dict[str, NodeCost]] | None = None
    """With GPUs of several kinds (``request.gpu_profiles``), each GPU's op costs; else None (``costs``)."""

    @classmethod
    def of(cls, name: str, graph: CostGraph, request: PlanRequest) -> ContiguousPlanner:
        """Check ``request`` for ``name``, one stage per GPU (two in a V): ``PartitionError`` saying what to change."""
        profile = request.profile
        per_gpu = 2 if request.placement == "v" else 1
        num_stages = request.stages_or(per_gpu * profile.count)
        assert num_stages is not None  # defaulted to the GPU count
        request.stage_devices(num_stages)  # a V's count is checked here
        if num_stages > per_gpu * profile.count:
            raise PartitionError(
                f"{name} puts one stage on each GPU: `num_stages` ({num_stages}) is more than the "
                f"{profile.count} GPUs of profile {profile.name!r}; pass num_stages ≤ "
                f"{profile.count} or use the mixed partitioner to put several stages on a GPU"
            )
        key = request.key_for(graph)
        cut_order = CutOrder.of(graph)
        if len(cut_order.cuttable) < num_stages:
            raise PartitionError(
                f"model has {len(cut_order.cuttable)} ops, fewer than {num_stages} stages; "
                f"use num_stages ≤ {len(cut_order.cuttable)}"
            )
        costs = request.node_costs(graph)
        return cls(name=name, graph=graph, request=request, num_stages=num_stages, key=key, costs=costs,
                   cut_order=cut_order, gpu_costs=request.gpu_costs(graph))  # fmt: skip

    @property
    def stage_capacity(self) -> int:
        """Memory one stage may use: a GPU's usable memory, or in a V, where two stages share a GPU,
        half of it each (the plan's check then sums the two: ``fit.check_memory``)."""
        usable = self.request.usable_bytes
        return usable // 2 if self.request.placement == "v" else usable

    @property
    def stage_capacities(self) -> list[int]:
        """`stage_capacity` per stage, on the stage's own GPU (GPUs of several kinds differ)."""
        usable = self.request.usable_bytes_per_gpu
        share = 2 if self.request.placement == "v" else 1
        return [usable[g] // share for g in self.request.stage_devices(self.num_stages)]

    def stage_costs(self, stage: int) -> dict[str, NodeCost]:
        """The op costs of stage ``stage`` of this planner's stages: those of the GPU it runs on."""
        if self.gpu_costs is None:
            return self.costs
        return self.gpu_costs[self.request.stage_devices(self.num_stages)[stage]]

    def partition(self, bounds: Sequence[int]) -> Partition:
        """The plan for cuttable pieces ``[bounds[s], bounds[s+1])``, stage s on GPU s (in a V, on
        GPU min(s, 2P − 1 − s)), priced by ``estimate`` (whether it fits memory: ``fit.check_memory``)."""
        node_stage = self.cut_order.node_stage(bounds)
        stage_device = self.request.stage_devices(len(bounds) - 1)
        predicted = self.request.estimate(self.graph, node_stage, stage_device, self.costs, self.gpu_costs)
        return Partition(
            node_stage=node_stage, stage_device=stage_device, partitioner=self.name, key=self.key, predicted=predicted
        )


def greedy_cuts(weights: list[float], num_stages: int, shares: Sequence[float] | None = None) -> list[int]:
    """Cut positions (``num_stages − 1`` indices, strictly increasing, in ``1..len − 1``).

    Cut k is at the prefix whose sum is nearest k · total / num_stages (with ``shares``, stage s's
    fraction of the total, e.g. its GPU's share of the speed: the sum of the first k shares times
    the total), among the two prefixes around the crossing, then moved just enough to leave every
    stage at least one item.
    """
    n, total = len(weights), float(sum(weights))
    if shares is not None and len(shares) != num_stages:
        raise PartitionError(f"greedy_cuts: {len(shares)} shares for {num_stages} stages; give one per stage")
    ends = None if shares is None else [math.fsum(shares[:k]) / math.fsum(shares) for k in range(num_stages)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts: list[int] = []
    i = 0  # prefix[i] < target <= prefix[i + 1] after the scan
    for k in range(1, num_stages):
        target = k * total / num_stages if ends is None else ends[k] * total
        while i < n and prefix[i + 1] < target:
            i += 1
        cut = i if i >= n or target - prefix[i] <= prefix[i + 1] - target else i + 1
        lowest = cuts[-1] + 1 if cuts else 1
        cuts.append(min(max(cut, lowest), n - (num_stages - k)))
    return cuts
