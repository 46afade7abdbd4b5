"""Check that a Partition is a plan the runtime can run on a graph, before anything starts.

The one home of the structural checks: `validate_partition` (a plan against its graph and the
GPUs' memory), `check_stages` (an op → stage map, what the runtime builds its stages from) and
`index_problems` (what a plan file can be checked for without a graph) share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import networkx as nx

from hf_ftpipe._units import GiB
from hf_ftpipe.costmodel.estimate import MemoryOptions, Optimizer, estimate_memory
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph

if TYPE_CHECKING:  # partition.py checks files with `index_problems`
    from hf_ftpipe.plan.partition import Partition

__all__ = ["check_fits_run", "check_stages", "index_problems", "stage_graph", "validate_partition"]


def validate_partition(
    partition: Partition,
    graph: CostGraph,
    memory_capacity_bytes: int | Sequence[int] | None = None,
    *,
    memory: MemoryOptions | None = None,
) -> None:
    """Raise ``PartitionError`` unless ``partition`` is runnable on ``graph``.

    Checks, in order (each step reports every problem it finds):

    1. every node of ``graph`` is in exactly one stage and no other node is; stage indices are
       ``0..num_stages-1``, every stage has an op, GPU indices ``0..num_devices-1`` are all used;
    2. the stage graph (an edge s → t where an op of s feeds an op of t) has no cycle, and its
       numbering is topological: stage s only feeds stages > s (the runtime runs stages in index
       order within a micro-batch); the output of a multi-output op (a tuple) stays in its stage:
       the runtime sends tensors, so the ``getitem`` ops that take it apart run beside it;
    3. with ``memory_capacity_bytes`` (one number for every GPU, or one per GPU), each GPU's
       predicted memory fits: from ``partition.predicted``, or estimated for the key's schedule
       and micro-batches with AdamW (and ``memory``'s recomputation) when the plan has no
       prediction. With ``memory``, each capacity is first reduced by ``memory.headroom``;
       without it, the capacities are taken as they are.
    """
    problems = index_problems(partition) + _node_problems(graph, partition.node_stage, partition.num_stages)
    _raise_if("the partition does not fit the graph", problems + _unused_gpu_problems(partition))
    _raise_if("the stage graph is not a pipeline", _pipeline_problems(graph, partition.node_stage))
    if memory_capacity_bytes is not None:
        problems = _memory_problems(partition, graph, memory_capacity_bytes, memory)
        _raise_if("the partition does not fit in GPU memory", problems)


def check_stages(graph: CostGraph, node_stage: Mapping[str, int]) -> None:
    """Raise ``PartitionError`` unless ``node_stage`` puts every op of ``graph`` in one of stages
    ``0..S-1``, every stage has an op, and the stages form a pipeline: steps 1 and 2 of
    `validate_partition`, for a plan without GPUs (S is one more than the highest stage)."""
    num_stages = max(node_stage.values(), default=-1) + 1
    problems = _node_problems(graph, node_stage, num_stages) + _stage_index_problems(node_stage, num_stages)
    _raise_if("the partition does not fit the graph", problems)
    _raise_if("the stage graph is not a pipeline", _pipeline_problems(graph, node_stage))


def index_problems(partition: Partition) -> list[str]:
    """What is wrong with a plan's indices, whatever the graph: it has no stage, an op has a stage
    outside ``0..num_stages-1``, a stage a GPU outside ``0..key.num_gpus-1``."""
    num_stages, num_gpus = partition.num_stages, partition.key.num_gpus
    if num_stages == 0:
        return ["'stage_device' is empty: a plan has at least one stage"]
    problems = _stage_index_problems(partition.node_stage, num_stages)
    bad = [(s, d) for s, d in enumerate(partition.stage_device) if not _is_index(d, num_gpus)]
    if bad:
        problems.append(
            f"'stage_device' puts stages on GPUs outside 0..{num_gpus - 1} (key.num_gpus is {num_gpus}): "
            f"stage→GPU {dict(bad[:5])}"
        )
    return problems


def check_fits_run(
    partition: Partition,
    graph: CostGraph,
    memory_capacity_bytes: int,
    *,
    optimizer: Optimizer,
    memory: MemoryOptions,
) -> None:
    """Raise ``PartitionError`` unless a stored plan fits this run's memory budget.

    A plan's key records the model, shapes, dtype, schedule and GPUs, not the optimizer,
    recomputation or headroom it was made for, so a plan from the cache or the Hub may have been
    planned for a lighter budget (recomputation on, SGD, no headroom). Its memory is estimated
    again under this run's options, against each GPU's capacity less this run's headroom.
    """
    used = estimate_memory(
        graph,
        partition.node_stage,
        partition.stage_device,
        num_microbatches=partition.key.num_microbatches,
        optimizer=optimizer,
        schedule=partition.key.schedule,  # type: ignore[arg-type]
        memory=memory,
    )
    setup = f"optimizer {optimizer!r}, recompute={memory.recompute}, headroom {memory.headroom:g}"
    problems = _memory_problems_of(used, [memory_capacity_bytes] * len(used), memory.headroom)
    _raise_if(f"the plan was made for another memory budget and does not fit this run's ({setup})", problems)


def stage_graph(graph: CostGraph, node_stage: Mapping[str, int]) -> nx.DiGraph:
    """Stages as nodes, an edge s → t when an op of s feeds an op of t; edge attr ``via`` = one
    example (producer, consumer) pair, for messages."""
    stages = nx.DiGraph()
    stages.add_nodes_from(set(node_stage.values()))
    for u, v in graph.graph.edges:
        s, t = node_stage[u], node_stage[v]
        if s != t and not stages.has_edge(s, t):
            stages.add_edge(s, t, via=(u, v))
    return stages


def _node_problems(graph: CostGraph, node_stage: Mapping[str, int], num_stages: int) -> list[str]:
    problems = []
    missing = [n for n in graph.topological_order() if n not in node_stage]
    if missing:
        problems.append(f"{len(missing)} ops are in no stage, e.g. {missing[:5]}")
    extra = [n for n in node_stage if n not in graph.graph]
    if extra:
        problems.append(f"{len(extra)} ops of the partition are not in the graph, e.g. {extra[:5]}")
    used = set(node_stage.values())
    empty = [s for s in range(num_stages) if s not in used]
    if empty:
        problems.append(f"stages {empty} have no op; every stage needs at least one")
    return problems


def _stage_index_problems(node_stage: Mapping[str, int], num_stages: int) -> list[str]:
    bad = [(n, s) for n, s in node_stage.items() if not _is_index(s, num_stages)]
    if not bad:
        return []
    return [f"'node_stage' puts {len(bad)} ops on stages outside 0..{num_stages - 1}, e.g. {dict(bad[:5])}"]


def _unused_gpu_problems(partition: Partition) -> list[str]:
    unused = sorted(set(range(partition.num_devices)) - set(partition.stage_device))
    if not unused:
        return []
    return [
        f"GPUs {unused} run no stage while GPU {partition.num_devices - 1} does; "
        "number the GPUs a plan uses 0..num_devices-1"
    ]


def _pipeline_problems(graph: CostGraph, node_stage: Mapping[str, int]) -> list[str]:
    return _order_problems(graph, node_stage) + _tuple_problems(graph, node_stage)


def _order_problems(graph: CostGraph, node_stage: Mapping[str, int]) -> list[str]:
    stages = stage_graph(graph, node_stage)
    try:
        cycle = nx.find_cycle(stages)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle is not None:
        path = " → ".join(str(s) for s, _ in cycle) + f" → {cycle[0][0]}"
        vias = [(s, t, *stages.edges[s, t]["via"]) for s, t in cycle]
        feeds = "; ".join(f"{u!r} (stage {s}) feeds {v!r} (stage {t})" for s, t, u, v in vias)
        return [f"stages form a cycle {path}: {feeds}. Move ops so that data flows one way."]
    backward = [(s, t) for s, t in stages.edges if s > t]
    return [
        f"stage {s} feeds the earlier stage {t} ({stages.edges[s, t]['via'][0]!r} → "
        f"{stages.edges[s, t]['via'][1]!r}); renumber the stages in a topological order"
        for s, t in sorted(backward)
    ]


def _tuple_problems(graph: CostGraph, node_stage: Mapping[str, int]) -> list[str]:
    problems = []
    for u in graph.topological_order():
        if len(graph.node(u)["output_shapes"]) > 1:
            s = node_stage[u]
            away = [(v, node_stage[v]) for v in graph.graph.successors(u) if node_stage[v] != s]
            if away:
                where = ", ".join(f"{v!r} (stage {t})" for v, t in away[:5])
                problems.append(
                    f"{u!r} (stage {s}) returns {len(graph.node(u)['output_shapes'])} tensors as one tuple, "
                    f"and {where} take it apart in another stage; put them in stage {s}"
                )
    return problems


def _memory_problems(
    partition: Partition, graph: CostGraph, capacity: int | Sequence[int], memory: MemoryOptions | None
) -> list[str]:
    if partition.predicted is not None:
        used = [gpu.memory_bytes for gpu in partition.predicted.gpus]
    else:
        used = estimate_memory(
            graph,
            partition.node_stage,
            partition.stage_device,
            num_microbatches=partition.key.num_microbatches,
            schedule=partition.key.schedule,  # type: ignore[arg-type]
            memory=memory,
        )
    capacities = [capacity] * len(used) if isinstance(capacity, int) else list(capacity)
    if len(capacities) < len(used):
        raise PartitionError(
            f"`memory_capacity_bytes` lists {len(capacities)} GPUs, the partition uses "
            f"{len(used)}; give one number, or one per GPU"
        )
    return _memory_problems_of(used, capacities, memory.headroom if memory is not None else 0.0)


def _memory_problems_of(used: Sequence[int], capacities: Sequence[int], headroom: float) -> list[str]:
    note = f" less {headroom * 100:g}% headroom" if headroom else ""
    problems = []
    for g, (need, raw) in enumerate(zip(used, capacities)):
        cap = int(raw * (1.0 - headroom))
        if need > cap:
            problems.append(
                f"GPU {g} needs {need} bytes ({need / GiB:.2f} GiB), more than its {cap} bytes "
                f"({cap / GiB:.2f} GiB{note}); use more GPUs, fewer micro-batches, activation recomputation "
                "or a memory-aware partitioner"
            )
    return problems


def _is_index(value: object, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _raise_if(summary: str, problems: list[str]) -> None:
    if problems:
        raise PartitionError(f"{summary}:\n" + "\n".join(f"  - {p}" for p in problems))
