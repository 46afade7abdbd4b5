"""What the contiguous partitioners share: the ops a stage may begin at, the checked request, the memory check.

A contiguous (Seq-Pipe) plan cuts the execution order into ``num_stages`` pieces, stage s on GPU s;
asked for a V placement (``PlanRequest.placement = "v"``), 2·P pieces, stage s on GPU
min(s, 2P − 1 − s). The cuts balance the stages (equal stages are equal GPUs in a V too); in a V
each stage is cut to fit half a GPU (`ContiguousPlanner.stage_capacity`), and the plan's memory
is checked per GPU, its two stages together.
Ops that follow their producer (``plan.atoms``: parts of a multi-output op, side effects) are
never cut on: partitioners cut the list of the other ops (``CutOrder.cuttable``), and
``node_stage`` puts each follower in the latest stage among its producers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_ftpipe._units import format_bytes
from hf_ftpipe.costmodel.op_time import NodeCost
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.fit import FitAdvice
from hf_ftpipe.plan.atoms import follows_producer
from hf_ftpipe.plan.partition import Partition, PartitionKey
from hf_ftpipe.plan.request import PlanRequest

__all__ = ["ContiguousPlanner", "CutOrder"]


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
                   cut_order=cut_order)  # fmt: skip

    @property
    def stage_capacity(self) -> int:
        """Memory one stage may use: a GPU's usable memory, or in a V, where two stages share a GPU,
        half of it each (the plan's check then sums the two: `partition`)."""
        usable = self.request.usable_bytes
        return usable // 2 if self.request.placement == "v" else usable

    def partition(self, bounds: Sequence[int], *, check_memory: bool = True) -> Partition:
        """The plan for cuttable pieces ``[bounds[s], bounds[s+1])``, stage s on GPU s (in a V, on
        GPU min(s, 2P − 1 − s)), priced by ``estimate``; ``PlanDoesNotFitError`` naming each GPU over
        its usable memory."""
        node_stage = self.cut_order.node_stage(bounds)
        stage_device = self.request.stage_devices(len(bounds) - 1)
        predicted = self.request.estimate(self.graph, node_stage, stage_device, self.costs)
        plan = Partition(
            node_stage=node_stage, stage_device=stage_device, partitioner=self.name, key=self.key, predicted=predicted
        )
        capacity, request = self.request.usable_bytes, self.request
        over = [(g, gpu.memory_bytes) for g, gpu in enumerate(predicted.gpus) if gpu.memory_bytes > capacity]
        if check_memory and over:
            needs = ", ".join(f"GPU {g} {format_bytes(need)}" for g, need in over)
            reason = (
                f"{self.name}: its plan does not fit in GPU memory: {needs}, more than the {format_bytes(capacity)} "
                f"usable per GPU ({format_bytes(request.profile.memory_bytes)} less "
                f"{request.memory.headroom * 100:g}% headroom)"
            )
            # seq-dp never makes such a plan; the others cut by compute or parameters alone
            raise PlanDoesNotFitError(reason, self.advice(plans=[(self.name, plan)], blind=True))
        return plan

    def advice(self, plans: Sequence[tuple[str, Partition]] = (), *, blind: bool = False) -> FitAdvice:
        """What would fit this request, for its `PlanDoesNotFitError`; ``blind``: this partitioner
        cut without regard to memory, so the advice checks its fixes by running it again."""
        return FitAdvice(
            graph=self.graph, request=self.request, plans=tuple(plans), blind_partitioner=self.name if blind else None
        )
