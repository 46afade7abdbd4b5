"""What contiguous splits can do within a GPU's memory (``contiguous_fit``): the least memory a
split needs and the fewest GPUs one fits, read off seq-dp's chain; the figures of ``fit``'s advice.

Above ``chain`` and below ``fit`` and the partitioners: it imports no partitioner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.chain import SEQ_DP, Chain
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ContiguousFit", "contiguous_fit"]


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
    planner = ContiguousPlanner.of(SEQ_DP, graph, request)
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
