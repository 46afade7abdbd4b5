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
   stage k − 1 (its micro-batches in flight and weight versions depend on k). O(P · B²), exact
   on the coarsened chain, and exact on the graph when no coarsening was needed.

The cost of a stage is FTPipe's cost of a GPU (``estimate.gpu_cost_s``): its forward + backward
compute, plus what its sending of activations and receiving of gradients does not hide. A value
that leaves the stage is counted once, as if it went to the next stage only; the plan found is
then priced exactly by ``estimate`` (which sends a value to every stage that reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hf_ftpipe._units import format_bytes
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.chain import Chain
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner
from hf_ftpipe.partitioners.registry import register_partitioner
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ContiguousFit", "contiguous_fit", "partition_seq_dp"]

NAME = "seq-dp"
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
    capacity = planner.stage_capacity
    cuts = chain.solve(planner.num_stages, capacity)
    if cuts is None:
        raise _infeasible(chain, planner, capacity)
    if chain.num_blocks < len(planner.cut_order.cuttable):
        chain, cuts = _refine(planner, chain, cuts, capacity, max_blocks)
    return planner.partition([chain.starts[b] for b in cuts])


def _refine(
    planner: ContiguousPlanner, coarse: Chain, cuts: list[int], capacity: int, max_blocks: int
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


def _infeasible(chain: Chain, planner: ContiguousPlanner, capacity: int) -> PlanDoesNotFitError:
    """The error when no split fits: the split that needs the least memory, which the error keeps
    (a comparison shows its figures); what would fit is the advice's."""
    cuts = chain.solve(planner.num_stages, float("inf"), by_memory=True)
    assert cuts is not None  # without a limit every split is allowed
    leanest = planner.partition([chain.starts[b] for b in cuts], check_memory=False)
    assert leanest.predicted is not None  # ContiguousPlanner.partition always predicts
    need = max(g.memory_bytes for g in leanest.predicted.gpus)
    request = planner.request
    reason = (
        f"seq-dp: no contiguous split into {planner.num_stages} stages fits the {format_bytes(capacity)} usable per "
        f"GPU ({format_bytes(request.profile.memory_bytes)} less {request.memory.headroom * 100:g}% headroom): "
        f"the best split needs {format_bytes(need)} on its fullest GPU"
    )
    return PlanDoesNotFitError(reason, planner.advice(plans=[(NAME, leanest)]))


@dataclass(frozen=True)
class ContiguousFit:
    """What contiguous splits can do within a GPU's usable memory (``contiguous_fit``)."""

    least_peak_bytes: float | None
    """The least memory of the fullest GPU over the splits into ``profile.count`` stages (None:
    fewer cut points than GPUs)."""
    num_gpus: int | None
    """The fewest GPUs (one stage each) a split fits; None: no number of them."""
    fits_count: bool = False
    """A split onto ``profile.count`` GPUs fits."""
    piece: list[str] = field(default_factory=list)
    """When no number fits: the ops of a piece of the chain (ops that seq-dp never separates) that
    overflows a GPU of its own."""
    piece_bytes: float = 0.0
    piece_in_flight: int = 0
    """Micro-batches that piece holds in flight there."""
    piece_anywhere: bool = False
    """The piece overflows wherever it stands: ``piece_in_flight`` is the fewest it can hold."""


def contiguous_fit(
    graph: CostGraph,
    profile: GPUProfile,
    *,
    max_blocks: int = 512,
    least_peak: bool = True,
    **options: Unpack[PlanOptions],
) -> ContiguousFit:
    """The least memory a split onto ``profile.count`` GPUs needs on its fullest GPU, and the fewest
    of these GPUs a split fits: seq-dp's own chain and memory rules, so ``partition_seq_dp`` succeeds
    on ``num_gpus`` of them and fails on one fewer. A tenth of a second or so on GPT2-XL (2000
    ops), where running every partitioner at growing GPU counts took 40 s. ``least_peak=False``
    skips the first figure (``least_peak_bytes`` is None), the slowest on many GPUs."""
    request = PlanRequest(profile=profile, num_stages=1, **(options | {"key": None}))
    planner = ContiguousPlanner.of(NAME, graph, request)
    chain = Chain(planner, max_blocks)
    least = None
    if least_peak and profile.count <= chain.num_blocks:
        chain.solve(profile.count, float("inf"), by_memory=True)
        least = chain.optimum
    capacity = request.usable_bytes
    num_gpus = chain.fewest_stages(capacity)
    if num_gpus is not None:
        fits_count = num_gpus == profile.count or (
            num_gpus < profile.count <= chain.num_blocks and chain.solve(profile.count, capacity) is not None
        )
        return ContiguousFit(least, num_gpus, fits_count)
    # The piece to blame: one that overflows wherever it stands, holding the fewest micro-batches
    # it can; else (1F1B-like schedules hold more the deeper a stage is) the worst piece of the split
    # into one piece per GPU, which does not fit either, or it would have been found.
    num_blocks, m = chain.num_blocks, request.num_microbatches
    depths = range(1, min(num_blocks, m) + 1)  # depth d > M keeps what depth M does
    by_depth = np.array([chain.piece_memory(d) for d in depths])  # [depth - 1, piece]
    k = int(np.argmax(by_depth.min(axis=0)))
    anywhere = bool(by_depth[:, k].min() > capacity)
    if anywhere:
        depth = int(np.argmin(by_depth[:, k])) + 1
    else:
        one_each = by_depth[np.minimum(num_blocks - np.arange(num_blocks), m) - 1, np.arange(num_blocks)]
        k = int(np.argmax(one_each))
        depth = min(num_blocks - k, m)
    return ContiguousFit(
        least,
        None,
        piece=planner.cut_order.cuttable[chain.starts[k] : chain.starts[k + 1]],
        piece_bytes=float(by_depth[depth - 1, k]),
        piece_in_flight=chain.rules(depth).in_flight,
        piece_anywhere=anywhere,
    )
