"""What the contiguous partitioners share: the ops a stage may begin at, the arguments, the memory check.

A contiguous (Seq-Pipe) plan cuts the execution order into ``num_stages`` pieces, stage s on GPU s.
Two kinds of op are never cut on and always join a producer's stage (``follows_producer``):

- an element of a multi-output op (``getitem`` of ``split``): a tuple is never sent between
  stages, its parts are, so the runtime needs the getitems beside their producer;
- a side-effect op (no FLOPs, no output, no consumer, e.g. ``aten._assert_tensor_metadata``).

Such an op joins the latest stage among its producers, which keeps the numbering topological.
Partitioners cut the list of the other ops (``CutOrder.cuttable``) and ``node_stage`` adds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_ftpipe.costmodel.estimate import MemoryOptions, Optimizer, Schedule, estimate, usable_capacity
from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.fit import FitAdvice, format_bytes
from hf_ftpipe.plan.keys import resolve_key
from hf_ftpipe.plan.partition import Partition, PartitionKey


def follows_producer(graph: CostGraph, node: str) -> bool:
    """An op that must share its producer's stage: a part of a multi-output op, or a side effect."""
    attrs = graph.node(node)
    g = graph.graph
    producers = list(g.predecessors(node))
    if len(producers) == 1 and len(graph.node(producers[0])["output_shapes"]) > 1:
        return True
    return (
        attrs["flops"] == 0
        and attrs["output_bytes"] == 0
        and g.out_degree(node) == 0
        and g.in_degree(node) > 0
        and node not in graph.outputs
    )


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
class Setup:
    """The checked arguments of the common partitioner signature (see ``registry``)."""

    name: str
    graph: CostGraph
    profile: GPUProfile
    num_stages: int
    num_microbatches: int
    microbatch_size: int
    schedule: Schedule
    optimizer: Optimizer
    dtype: str | None
    key: PartitionKey
    memory: MemoryOptions
    costs: dict[str, NodeCost]
    cut_order: CutOrder

    @classmethod
    def of(
        cls,
        name: str,
        graph: CostGraph,
        profile: GPUProfile,
        num_stages: int | None,
        *,
        num_microbatches: int,
        microbatch_size: int,
        schedule: Schedule,
        optimizer: Optimizer,
        dtype: str | None,
        key: PartitionKey | None,
        memory: MemoryOptions | None,
    ) -> Setup:
        num_stages = profile.count if num_stages is None else num_stages
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PartitionError(f"`num_stages` must be a positive integer, got {num_stages!r}")
        if num_stages > profile.count:
            raise PartitionError(
                f"{name} puts one stage on each GPU: `num_stages` ({num_stages}) is more than the "
                f"{profile.count} GPUs of profile {profile.name!r}; pass num_stages ≤ "
                f"{profile.count} or use the mixed partitioner to put several stages on a GPU"
            )
        key = resolve_key(graph, profile, key, schedule=schedule, num_microbatches=num_microbatches, dtype=dtype)
        cut_order = CutOrder.of(graph)
        if len(cut_order.cuttable) < num_stages:
            raise PartitionError(
                f"model has {len(cut_order.cuttable)} ops, fewer than {num_stages} stages; "
                f"use num_stages ≤ {len(cut_order.cuttable)}"
            )
        return cls(
            name=name,
            graph=graph,
            profile=profile,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            schedule=schedule,
            optimizer=optimizer,
            dtype=dtype,
            key=key,
            memory=memory or MemoryOptions(),
            costs=node_costs(graph, profile, dtype),
            cut_order=cut_order,
        )

    def partition(self, bounds: Sequence[int], *, check_memory: bool = True) -> Partition:
        """The plan for cuttable pieces ``[bounds[s], bounds[s+1])``, stage s on GPU s, priced by
        ``estimate``; ``PlanDoesNotFitError`` naming each GPU over its usable memory."""
        node_stage = self.cut_order.node_stage(bounds)
        stage_device = list(range(len(bounds) - 1))
        predicted = estimate(
            self.graph, node_stage, stage_device, self.profile,
            num_microbatches=self.num_microbatches, microbatch_size=self.microbatch_size,
            optimizer=self.optimizer, schedule=self.schedule, dtype=self.dtype, costs=self.costs,
            memory=self.memory,
        )  # fmt: skip
        plan = Partition(
            node_stage=node_stage, stage_device=stage_device, partitioner=self.name, key=self.key, predicted=predicted
        )
        capacity = usable_capacity(self.profile, self.memory)
        over = [(g, gpu.memory_bytes) for g, gpu in enumerate(predicted.gpus) if gpu.memory_bytes > capacity]
        if check_memory and over:
            needs = ", ".join(f"GPU {g} {format_bytes(need)}" for g, need in over)
            reason = (
                f"{self.name}: its plan does not fit in GPU memory: {needs}, more than the {format_bytes(capacity)} "
                f"usable per GPU ({format_bytes(self.profile.memory_bytes)} less {self.memory.headroom * 100:g}% "
                "headroom)"
            )
            # seq-dp never makes such a plan; the others cut by compute or parameters alone
            raise PlanDoesNotFitError(reason, self.advice(plans=[(self.name, plan)], memory_blind=True))
        return plan

    def advice(self, plans: Sequence[tuple[str, Partition]] = (), *, memory_blind: bool = False) -> FitAdvice:
        """What would fit this request, for its `PlanDoesNotFitError`."""
        return FitAdvice(
            graph=self.graph, profile=self.profile, num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size, schedule=self.schedule, optimizer=self.optimizer, dtype=self.dtype,
            memory=self.memory, plans=tuple(plans), memory_blind=memory_blind,
        )  # fmt: skip
