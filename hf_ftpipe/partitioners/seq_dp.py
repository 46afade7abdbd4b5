"""Seq-Pipe, exhaustive: the contiguous split with the smallest bottleneck that fits memory.

A dynamic program over cut points of the execution order, as PipeDream's planner (Narayanan et
al., SOSP'19) and FTPipe's "Seq pipe (exhaustive)" (Eliad et al., ATC'21), made fast by
coarsening first:

1. Ops that cannot begin a stage (``plan.atoms``) join their producer. The remaining N ops are
   grouped into at most ``max_blocks`` consecutive blocks of about equal compute (none when
   N ≤ ``max_blocks``): stages may begin only at a block boundary. After solving, the blocks
   around each cut found are split back into single ops and the chain solved again, for a few
   rounds while the bottleneck improves.
2. Every figure of a candidate stage [a, b) of blocks is read in O(1) from tables built by one
   sweep over the graph: compute from prefix sums; bytes that leave the stage, the stage's
   inputs, and its distinct parameters from 2-D tables filled with rectangle sums (a value
   produced in block p and last read in block q leaves every stage with a ≤ p < b ≤ q).
3. best[k][b] = min over a of max(best[k−1][a], cost(a, b)) over stages that fit memory as
   stage k − 1 (its micro-batches in flight and weight versions depend on k; where the schedule's
   order is fixed by the plan, ``zb-h1``, ``zbv``, its busiest moment in that order:
   ``Chain.memory``). O(P · B²), exact
   on the coarsened chain, and exact on the graph when no coarsening was needed. With GPUs of
   several kinds (``gpu_profiles``), cost(a, b) of stage k − 1 is its time on GPU k − 1 and
   it must fit that GPU's memory, so the split found is the best for those GPUs in that order.

The cost of a stage is FTPipe's cost of a GPU (``estimate.gpu_cost_s``): its forward + backward
compute, plus what its sending of activations and receiving of gradients does not hide. A value
that leaves the stage is counted once, as if it went to the next stage only; the plan found is
then priced exactly by ``estimate`` (which sends a value to every stage that reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hf_ftpipe._units import format_bytes
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.chain import SEQ_DP, Chain
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner
from hf_ftpipe.partitioners.fit import FitAdvice, check_memory
from hf_ftpipe.partitioners.registry import register_partitioner
from hf_ftpipe.partitioners.split_fit import ContiguousFit, contiguous_fit
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

# ContiguousFit and contiguous_fit live in `split_fit` (fit's figures, below this module); still importable from here.
__all__ = ["ContiguousFit", "contiguous_fit", "partition_seq_dp"]

NAME = SEQ_DP
_REFINE = 2
"""Coarse blocks on each side of a cut that refinement opens up op by op."""
_REFINE_ROUNDS = 4
_REFINE_MAX_BLOCKS = 1536


@register_partitioner(NAME)
def partition_seq_dp(
    graph: CostGraph,
    profile: GPUProfile,
    num_stages: int | None = None,
    *,
    max_blocks: int = 512,
    **options: Unpack[PlanOptions],
) -> Partition:
    """The contiguous split into ``num_stages`` stages (one per GPU) with the smallest bottleneck
    whose every stage fits the usable memory of a GPU.

    Arguments as in ``partition_seq_greedy``, and:
        max_blocks (`int`, defaults to 512): cut points considered at most (see the module
            docstring); time grows with its square.

    Raises ``PlanDoesNotFitError`` when no split fits, with the least memory a split needs; its
    advice adds the memory per GPU and the number of GPUs that would fit (``contiguous_fit``).
    """
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
        raise PartitionError(f"`max_blocks` must be a positive integer, got {max_blocks!r}")
    planner = ContiguousPlanner.of(NAME, graph, PlanRequest(profile=profile, num_stages=num_stages, **options))
    chain = Chain(planner, max(max_blocks, planner.num_stages))
    # GPUs of several kinds: each stage within its own GPU's memory (and timed on it: `Chain.solve`)
    capacity = planner.stage_capacities if planner.gpu_costs is not None else planner.stage_capacity
    cuts = chain.solve(planner.num_stages, capacity)
    if cuts is None:
        raise _infeasible(chain, planner)
    if chain.num_blocks < len(planner.cut_order.cuttable):
        chain, cuts = _refine(planner, chain, cuts, capacity, max_blocks)
    return check_memory(planner, planner.partition([chain.starts[b] for b in cuts]))


def _refine(
    planner: ContiguousPlanner, coarse: Chain, cuts: list[int], capacity: int | list[int], max_blocks: int
) -> tuple[Chain, list[int]]:
    """Split the coarse blocks around each cut into single ops and solve again, while that helps
    (a few rounds: a better cut moves the next stage's window). A previous answer stays a
    candidate, so no round is worse."""
    chain, at = coarse, [coarse.starts[b] for b in cuts]  # cuts as op positions
    for _ in range(_REFINE_ROUNDS):
        starts = set(coarse.starts)
        for position in at[1:-1]:
            b = int(np.searchsorted(coarse.starts, position, side="right")) - 1
            low, high = max(b - _REFINE, 0), min(b + 1 + _REFINE, coarse.num_blocks)
            starts.update(range(coarse.starts[low], coarse.starts[high]))
        if len(starts) > max(2 * max_blocks, _REFINE_MAX_BLOCKS):  # blocks so coarse that this would be slow
            break
        fine = Chain(planner, max_blocks, starts=sorted(starts))
        fine_cuts = fine.solve(planner.num_stages, capacity)
        if fine_cuts is None or fine.optimum >= chain.optimum:
            break
        chain, cuts, at = fine, fine_cuts, [fine.starts[b] for b in fine_cuts]
    return chain, cuts


def _infeasible(chain: Chain, planner: ContiguousPlanner) -> PlanDoesNotFitError:
    """The error when no split fits: the split that needs the least memory, which the error keeps
    (a comparison shows its figures); what would fit is the advice's."""
    cuts = chain.solve(planner.num_stages, float("inf"), by_memory=True)
    assert cuts is not None  # without a limit every split is allowed
    leanest = planner.partition([chain.starts[b] for b in cuts])
    assert leanest.predicted is not None  # ContiguousPlanner.partition always predicts
    need = max(g.memory_bytes for g in leanest.predicted.gpus)
    request = planner.request
    halves = ", half of it per stage in a V" if request.placement == "v" else ""
    reason = (
        f"seq-dp: no contiguous split into {planner.num_stages} stages fits the {format_bytes(request.usable_bytes)} "
        f"usable per GPU ({format_bytes(request.profile.memory_bytes)} less {request.memory.headroom * 100:g}% "
        f"headroom{halves}): the best split needs {format_bytes(need)} on its fullest GPU"
    )
    return PlanDoesNotFitError(reason, FitAdvice(graph=planner.graph, request=request, plans=((NAME, leanest),)))
