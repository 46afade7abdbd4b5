"""Seq-Pipe, greedy: contiguous stages along the execution order, cut by cumulative compute.

The simplest of the partitioners FTPipe runs ("Seq pipe (greedy)", Eliad et al., ATC'21) and
the baseline the others must beat. Steps:

1. Walk the ops in execution order (a topological order) and weigh each by its forward +
   backward time from the cost model.
2. Cut before the op where the running total crosses k · total / num_stages, on whichever side
   of that op the total is nearer the target; never leave a stage empty.
3. Stage s runs on GPU s. Contiguous pieces of a topological order are numbered topologically.

Ops that do nothing and feed nothing (``aten._assert_tensor_metadata``) are not cut on: they join
the latest stage among their producers, which keeps the numbering topological.
"""

from __future__ import annotations

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partition.estimate import Optimizer, Schedule, estimate
from hf_ftpipe.partition.plan import Partition, PartitionKey
from hf_ftpipe.profile.cost import node_costs
from hf_ftpipe.profile.gpu import GPUProfile, canonical_dtype

__all__ = ["greedy_cuts", "partition_seq_greedy"]

NAME = "seq-greedy"


def partition_seq_greedy(
    graph: CostGraph,
    profile: GPUProfile,
    num_stages: int | None = None,
    *,
    num_microbatches: int,
    microbatch_size: int,
    schedule: Schedule = "gpipe",
    optimizer: Optimizer = "adamw",
    dtype: str | None = None,
    key: PartitionKey | None = None,
) -> Partition:
    """Cut ``graph`` into ``num_stages`` contiguous stages of about equal compute, one per GPU.

    Args:
        num_stages (`int`, *optional*, defaults to ``profile.count``): at most ``profile.count``.
        dtype (`str`, *optional*): compute dtype for costs (e.g. ``"bfloat16"`` under autocast);
            by default each op's own, and the key records the parameters' dtype.
        key (`PartitionKey`, *optional*): the key to record; by default built from ``graph``,
            ``profile`` and the other arguments, which it must agree with.
    """
    num_stages = profile.count if num_stages is None else num_stages
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"`num_stages` must be a positive integer, got {num_stages!r}")
    if num_stages > profile.count:
        raise PartitionError(
            f"seq-greedy puts one stage on each GPU: `num_stages` ({num_stages}) is more than the "
            f"{profile.count} GPUs of profile {profile.name!r}; pass num_stages ≤ "
            f"{profile.count} or use the mixed partitioner to put several stages on a GPU"
        )
    if key is None:
        key = PartitionKey.from_graph(
            graph,
            dtype=canonical_dtype(dtype) if dtype is not None else _params_dtype(graph),
            schedule=schedule,
            num_microbatches=num_microbatches,
            gpu_profile=profile.name,
            num_gpus=profile.count,
        )
    else:
        _check_key_agrees(key, schedule=schedule, num_microbatches=num_microbatches, num_gpus=profile.count)

    costs = node_costs(graph, profile, dtype)
    order = graph.topological_order()
    followers = {n for n in order if _follows_producer(graph, n)}
    cuttable = [n for n in order if n not in followers]
    if len(cuttable) < num_stages:
        raise PartitionError(
            f"model has {len(cuttable)} ops, fewer than {num_stages} stages; use num_stages ≤ {len(cuttable)}"
        )
    weights = [costs[n].total_s for n in cuttable]
    if sum(weights) == 0:  # nothing to balance: balance op counts instead
        weights = [1.0] * len(cuttable)
    bounds = [0, *greedy_cuts(weights, num_stages), len(cuttable)]

    node_stage: dict[str, int] = {}
    for s in range(num_stages):
        for n in cuttable[bounds[s] : bounds[s + 1]]:
            node_stage[n] = s
    for n in order:  # producers come first in execution order
        if n in followers:
            node_stage[n] = max(node_stage[u] for u in graph.graph.predecessors(n))
    node_stage = {n: node_stage[n] for n in order}
    stage_device = list(range(num_stages))
    predicted = estimate(
        graph, node_stage, stage_device, profile,
        num_microbatches=num_microbatches, microbatch_size=microbatch_size,
        optimizer=optimizer, schedule=schedule, dtype=dtype, costs=costs,
    )  # fmt: skip
    return Partition(
        node_stage=node_stage,
        stage_device=stage_device,
        partitioner=NAME,
        key=key,
        predicted=predicted,
    )


def greedy_cuts(weights: list[float], num_stages: int) -> list[int]:
    """Cut positions (``num_stages − 1`` indices, strictly increasing, in ``1..len − 1``).

    Cut k is at the prefix whose sum is nearest k · total / num_stages, among the two prefixes
    around the crossing, then moved just enough to leave every stage at least one item.
    """
    n, total = len(weights), float(sum(weights))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts: list[int] = []
    i = 0  # prefix[i] < target <= prefix[i + 1] after the scan
    for k in range(1, num_stages):
        target = k * total / num_stages
        while i < n and prefix[i + 1] < target:
            i += 1
        cut = i if i >= n or target - prefix[i] <= prefix[i + 1] - target else i + 1
        lowest = cuts[-1] + 1 if cuts else 1
        cuts.append(min(max(cut, lowest), n - (num_stages - k)))
    return cuts


def _follows_producer(graph: CostGraph, node: str) -> bool:
    """An op that must share its producer's stage.

    A side-effect op (no FLOPs, no output, no consumer), or an element of a multi-output op
    (``getitem`` of ``split``): a tuple of tensors is never sent between stages, its parts are.
    """
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


def _params_dtype(graph: CostGraph) -> str:
    """The dtype holding the most parameter bytes (``float32`` for a graph without parameters)."""
    by_dtype: dict[str, int] = {}
    for info in graph.params.values():
        name = canonical_dtype(info.dtype)
        by_dtype[name] = by_dtype.get(name, 0) + info.bytes
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "float32"


def _check_key_agrees(key: PartitionKey, **expected: object) -> None:
    wrong = [
        f"{name}={getattr(key, name)!r} (argument: {value!r})"
        for name, value in expected.items()
        if getattr(key, name) != value
    ]
    if wrong:
        raise PartitionError(
            f"`key` disagrees with the arguments: {', '.join(wrong)}; pass matching arguments or no key"
        )
