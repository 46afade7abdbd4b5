"""Pipeline × data parallelism on paper: which P × D to run on a topology (PipeDream-2BW's planner).

World = P × D: D replicas of a P-GPU pipeline. Replica d holds ranks d·P … d·P + P − 1, so a pipeline
whose P divides the GPUs per node stays inside one machine, and only the gradient all-reduces cross
the slow links between machines. For each P that divides the world:

1. The global mini-batch of M micro-batches is split across the replicas: each pipeline runs M / D
   of them (D must divide M).
2. One pipeline is planned by `auto` for its P GPUs, behind the link its stages cross: the node's
   own when the pipeline stays in a node, the link between nodes when it spans several (every
   boundary priced at the slower link: pessimistic where a long pipeline crosses nodes only a few
   times). With GPUs of several kinds, pipeline position g is planned for the weakest GPU at that
   position over the replicas (every replica runs the same plan, and the slowest sets the pace):
   the least memory, the lowest effective FLOP/s and memory bandwidth (`position_profile`); the
   contiguous partitioners then balance stages by each position's speed and memory.
3. Its step is simulated (`hf_ftpipe.simulate`: fill, drain and waits on messages included), and
   each GPU's gradients are all-reduced over its D replicas (`Topology.allreduce_s`, a ring at the
   pace of its slowest link). Under ``gpipe`` and ``1f1b`` a GPU's all-reduce starts when its last
   backward ends and the step ends when the last all-reduce does; under ``2bw`` a version's
   all-reduce runs while the pipeline works on the other buffer, so only what exceeds a step shows.
   ``async`` updates inside the pipeline with no point where replicas agree: it is refused with
   D > 1.
4. The predicted throughput is M × micro-batch size / that step; the best feasible layout wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hf_ftpipe._table import table
from hf_ftpipe.costmodel.profiles import GPUProfile, mixes_kinds
from hf_ftpipe.costmodel.topology import Topology, get_topology
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.auto import best_result, compare_partitioners, reason_line
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.simulator.api import simulate

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from hf_ftpipe.plan.request import PlanOptions

__all__ = [
    "LayoutResult",
    "best_layout",
    "compare_layouts",
    "divisors",
    "format_layouts",
    "layout_name",
    "pipeline_gpus",
    "position_profile",
]


def divisors(world_size: int) -> list[int]:
    """Every n that divides ``world_size``, ascending: the pipeline sizes P, and the replica counts D,
    of the layouts P × D a world of ``world_size`` processes can run."""
    return [n for n in range(1, world_size + 1) if world_size % n == 0]


def layout_name(pipeline_gpus: int, replicas: int) -> str:
    """``"2x4"``: a pipeline of 2 GPUs, 4 replicas of it."""
    return f"{pipeline_gpus}x{replicas}"


@dataclass(kw_only=True)
class LayoutResult:
    """One P × D layout's predicted figures, or why it cannot run."""

    layout: str
    pipeline_gpus: int
    replicas: int
    feasible: bool
    pipelines: list[list[int]] = field(default_factory=list)
    """The ranks of each replica's pipeline, in stage-GPU order."""
    error: str | None = None
    samples_per_s: float | None = None
    """Predicted throughput over the global mini-batch."""
    step_time_s: float | None = None
    """Predicted seconds per global mini-batch: the pipeline's step with its exposed all-reduce."""
    pipeline_step_s: float | None = None
    """One replica's simulated pipeline step for its share of the micro-batches."""
    allreduce_s: list[float] = field(default_factory=list)
    """Per pipeline GPU, the all-reduce of its gradients over the replicas."""
    exposed_allreduce_s: float | None = None
    """What the all-reduces add to the step (0 when they hide behind the pipeline's own work)."""
    crosses_nodes: bool = False
    """Whether a pipeline spans machines (its boundaries then priced at the link between them)."""
    max_memory_fraction: float | None = None
    partitioner: str | None = None
    partition: Partition | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (everything but the plan itself)."""
        return {name: value for name, value in self.__dict__.items() if name != "partition"}


def compare_layouts(
    graph: CostGraph,
    topology: Topology | str,
    *,
    layouts: Sequence[tuple[int, int]] | None = None,
    time_budget_s: float = 60.0,
    **options: Unpack[PlanOptions],
) -> list[LayoutResult]:
    """Plan and price every P × D of ``topology`` (or only ``layouts``, as ``(P, D)`` pairs).

    ``options`` are the partitioners' (see `PlanOptions`); ``num_microbatches`` is the global
    mini-batch's, which the replicas share. ``time_budget_s`` bounds each layout's partitioning.
    """
    topology = get_topology(topology)
    world = topology.world_size
    wanted = [(p, world // p) for p in divisors(world)] if layouts is None else list(layouts)
    for p, d in wanted:
        if p * d != world:
            raise PartitionError(f"layout {layout_name(p, d)} has {p * d} GPUs, topology {topology.name!r} has {world}")
    return [_price_layout(graph, topology, p, d, time_budget_s, options) for p, d in wanted]


def best_layout(results: Sequence[LayoutResult]) -> LayoutResult | None:
    """The feasible layout with the highest predicted throughput (on a tie, the shorter pipeline)."""
    feasible = [r for r in results if r.feasible and r.samples_per_s is not None]
    return max(feasible, key=lambda r: (r.samples_per_s, -r.pipeline_gpus), default=None)


def _price_layout(
    graph: CostGraph, topology: Topology, p: int, d: int, time_budget_s: float, options: dict[str, Any]
) -> LayoutResult:
    pipelines = [list(range(r * p, r * p + p)) for r in range(d)]
    crosses = any(len({topology.node_of(rank) for rank in ranks}) > 1 for ranks in pipelines)
    result = LayoutResult(
        layout=layout_name(p, d),
        pipeline_gpus=p,
        replicas=d,
        feasible=False,
        pipelines=pipelines,
        crosses_nodes=crosses,
    )
    schedule = options.get("schedule", "gpipe")
    total = options["num_microbatches"]
    if d > 1 and schedule == "async":
        result.error = "async updates inside the pipeline with no point where replicas agree: use 2bw, 1f1b or gpipe"
        return result
    if total % d:
        result.error = f"{total} micro-batches cannot be shared by {d} replicas: use a multiple of {d}"
        return result
    profile, gpus = pipeline_gpus(topology, p)
    reports = compare_partitioners(
        graph,
        profile,
        None,
        time_budget_s=time_budget_s,
        **(options | {"num_microbatches": total // d, "gpu_profiles": gpus}),
    )
    best = best_result(reports)
    if best is None:
        reasons = "; ".join(reason_line(r) for r in reports if r.error)
        result.error = f"no plan of {p} GPUs fits ({reasons})"
        return result
    plan = best.partition
    assert plan is not None and plan.predicted is not None  # a feasible result carries its predicted plan
    simulated = simulate(plan, profile=profile)
    allreduce = [
        topology.allreduce_s([ranks[g] for ranks in pipelines], _gradient_bytes(graph, plan, g)) for g in range(p)
    ]
    if schedule == "2bw":
        exposed = max(0.0, max(allreduce) - simulated.step_time_s)
    else:
        last_backward = [
            max((e.end_s for e in simulated.events if e.rank == g and e.kind != "F"), default=0.0) for g in range(p)
        ]
        finished = max(end + reduce for end, reduce in zip(last_backward, allreduce, strict=True))
        exposed = max(0.0, finished - simulated.step_time_s)
    step = simulated.step_time_s + exposed
    result.feasible = True
    result.samples_per_s = total * options["microbatch_size"] / step
    result.step_time_s = step
    result.pipeline_step_s = simulated.step_time_s
    result.allreduce_s = allreduce
    result.exposed_allreduce_s = exposed
    result.max_memory_fraction = best.max_memory_fraction
    result.partitioner = plan.partitioner
    result.partition = plan
    return result


def pipeline_gpus(topology: Topology, pipeline_gpus: int) -> tuple[GPUProfile, list[GPUProfile] | None]:
    """What one pipeline of ``pipeline_gpus`` positions is planned for on ``topology`` (replica d on
    ranks d·P ..): its `GPUProfile` (``count`` P, behind the slowest link of replica 0's pipeline,
    named for its kinds position by position when they differ: ``"rtx3090x2+rtx2080tix2"``, which the
    plan's cache and Hub key then carry), and with GPUs of several kinds, one profile per position
    (`PlanRequest.gpu_profiles`; ``None`` when all are alike)."""
    p = pipeline_gpus
    pipelines = [list(range(r * p, r * p + p)) for r in range(topology.world_size // p)]
    gpus = [position_profile([topology.profile_of(ranks[g]) for ranks in pipelines]) for g in range(p)]
    return _pipeline_profile(topology, pipelines[0], gpus), gpus if mixes_kinds(gpus) else None


def position_profile(gpus: Sequence[GPUProfile]) -> GPUProfile:
    """One pipeline position's GPU over the replicas: the GPU itself when they are alike, else the
    weakest of each figure (least memory, lowest effective FLOP/s per dtype and memory bandwidth),
    named ``"min(a,b)"``, so that a plan made for it fits and is timed safely on every replica."""
    first = gpus[0].with_count(1)
    if all(gpu.with_count(1) == first for gpu in gpus):
        return first
    dtypes = sorted({dtype for gpu in gpus for dtype in gpu.peak_flops})
    return replace(
        first,
        name="min(" + ",".join(dict.fromkeys(gpu.name for gpu in gpus)) + ")",
        memory_bytes=min(gpu.memory_bytes for gpu in gpus),
        peak_flops={dtype: min(gpu.effective_flops_per_s(dtype) for gpu in gpus) for dtype in dtypes},
        compute_efficiency=1.0,
        memory_bandwidth_bytes_per_s=min(gpu.effective_memory_bandwidth_bytes_per_s for gpu in gpus),
        memory_efficiency=1.0,
    )


def _pipeline_profile(topology: Topology, ranks: list[int], gpus: list[GPUProfile]) -> GPUProfile:
    """The pipeline's GPUs (``gpus``, one per position), behind the slowest link between ``ranks``: the
    GPU itself when all are alike, else the first one named for them all (``"rtx3090x2+rtx2080tix2"``)
    with the least memory, which `PlanRequest.gpu_profiles` then refines GPU by GPU."""
    links = [topology.link_between(a, b) for a, b in zip(ranks, ranks[1:])]
    gpu = gpus[0].with_count(len(ranks))
    if any(other != gpus[0] for other in gpus):
        runs: list[list[Any]] = []
        for other in gpus:
            if runs and runs[-1][0] == other.name:
                runs[-1][1] += 1
            else:
                runs.append([other.name, 1])
        name = "+".join(f"{kind}x{n}" for kind, n in runs)
        gpu = replace(gpu, name=name, memory_bytes=min(other.memory_bytes for other in gpus))
    if not links:
        return gpu
    slowest = min(links, key=lambda link: link.bandwidth_bytes_per_s)
    return replace(gpu, link_bandwidth_bytes_per_s=slowest.bandwidth_bytes_per_s, link_latency_s=slowest.latency_s)


def _gradient_bytes(graph: CostGraph, plan: Partition, gpu: int) -> int:
    """Bytes of the trainable weights on ``gpu``: what its replicas all-reduce each step (a weight
    tied between two of its stages once)."""
    nodes = [n for n, s in plan.node_stage.items() if plan.stage_device[s] == gpu]
    return graph.param_bytes(nodes, trainable_only=True)


def format_layouts(results: list[LayoutResult], best: LayoutResult | None) -> str:
    """The layouts side by side (`LayoutResult`s, ``best`` the chosen one), as ``compare`` prints them
    and `PipeTrainer` logs its choice under ``data_parallel_size="auto"``."""
    lines = [["layout", "samples/s", "pipeline step s", "all-reduce s", "exposed s", "peak mem", "plan", "note"]]
    for r in results:
        if not r.feasible:
            lines.append([r.layout, "-", "-", "-", "-", "-", "-", r.error or ""])
            continue
        note = ("chosen; " if r is best else "") + ("pipeline spans machines" if r.crosses_nodes else "")
        lines.append(
            [
                r.layout,
                f"{r.samples_per_s:.3g}",
                f"{r.pipeline_step_s:.3g}",
                f"{max(r.allreduce_s):.3g}",
                f"{r.exposed_allreduce_s:.3g}",
                f"{r.max_memory_fraction:.0%}",
                r.partitioner or "",
                note.strip("; "),
            ]
        )
    return table(lines) + "\nlayout: P × D, a pipeline of P GPUs and D replicas of it"
