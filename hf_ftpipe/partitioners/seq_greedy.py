"""Seq-Pipe, greedy: contiguous stages along the execution order, cut by cumulative compute.

The simplest of the partitioners FTPipe runs ("Seq pipe (greedy)", Eliad et al., ATC'21) and
the baseline the others must beat. Steps:

1. Walk the ops in execution order (a topological order) and weigh each by its forward +
   backward time from the cost model.
2. Cut before the op where the running total crosses k · total / num_stages, on whichever side
   of that op the total is nearer the target; never leave a stage empty (``greedy_cuts``, in
   ``contiguous``: the baselines and seq-dp's coarsening cut with it too).
3. Stage s runs on GPU s. Contiguous pieces of a topological order are numbered topologically.
   GPUs of different kinds (``gpu_profiles``) take shares of the total in proportion to their
   speed on this model (1 / its whole compute on that GPU): a faster GPU gets more ops.

Parts of multi-output ops (``getitem``) and side-effect ops are not cut on: they join the latest
stage among their producers (see ``plan.atoms``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ftpipe.costmodel.op_time import NodeCost
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner, greedy_cuts
from hf_ftpipe.partitioners.fit import check_memory
from hf_ftpipe.partitioners.registry import register_partitioner
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["greedy_cuts", "partition_seq_greedy"]  # greedy_cuts lives in `contiguous`; still importable from here

NAME = "seq-greedy"


@register_partitioner(NAME)
def partition_seq_greedy(
    graph: CostGraph, profile: GPUProfile, num_stages: int | None = None, **options: Unpack[PlanOptions]
) -> Partition:
    """Cut ``graph`` into ``num_stages`` contiguous stages of about equal compute, one per GPU.

    Args:
        num_stages (`int`, *optional*, defaults to ``profile.count``): at most ``profile.count``.
        options: ``num_microbatches`` and ``microbatch_size`` (required), ``schedule``,
            ``optimizer``, ``dtype``, ``key`` and ``memory``: the fields of `PlanRequest`.

    Raises ``PartitionError`` when the plan does not fit the usable memory of a GPU: the cuts
    ignore memory (use ``seq-dp`` for a memory-aware contiguous plan).
    """
    planner = ContiguousPlanner.of(NAME, graph, PlanRequest(profile=profile, num_stages=num_stages, **options))
    weights = _weights(planner, planner.costs)
    shares = None
    if planner.gpu_costs is not None and sum(weights) > 0:  # GPUs of several kinds: a share by speed
        shares = [1.0 / max(sum(_weights(planner, planner.stage_costs(s))), 1e-30) for s in range(planner.num_stages)]
    if sum(weights) == 0:  # nothing to balance: balance op counts instead
        weights = [1.0] * len(weights)
    bounds = [0, *greedy_cuts(weights, planner.num_stages, shares), len(weights)]
    return check_memory(planner, planner.partition(bounds))


def _weights(planner: ContiguousPlanner, cost: dict[str, NodeCost]) -> list[float]:
    """Each cuttable op's forward + backward time; followers (see plan.atoms) weigh nothing here,
    they join their producer's stage."""
    forward_again = 1.0 if planner.request.memory.recompute else 0.0
    return [cost[n].total_s + forward_again * cost[n].forward_s for n in planner.cut_order.cuttable]
