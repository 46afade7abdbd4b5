"""Predicted time and memory of a plan: FTPipe's cost of a GPU and the memory it needs.

Every time is per micro-batch. A GPU g computes C_g = Σ forward + backward of its ops; what it
sends forward and receives backward overlaps with that compute (FTPipe, Eliad et al., ATC'21:
the CCO property, "computation overlaps with communication")::

    cost_g = C_g + max(0, comm_fwd_out_g − C_g) + max(0, comm_bwd_in_g − C_g)

The pipeline's step time is max_g cost_g: in the steady state one micro-batch leaves the pipeline
every bottleneck interval (fill and drain are left out; they shrink as num_microbatches grows).
The ideal is Σ compute / number of GPUs. Only traffic between GPUs counts: stages that share a GPU
hand tensors over in memory. A producer's output is sent once to each stage on another GPU that
reads it, and stages exchange one message per direction per micro-batch.

Memory: `hf_ftpipe.costmodel.memory_estimate` (the rules, and what each stage keeps); the options a
plan is priced for: `hf_ftpipe.costmodel.options`.

Capacity: ``GPUCost.capacity_bytes`` is the device's raw memory; a plan is feasible when every GPU
needs at most ``usable_capacity(profile, memory)``, the raw memory less the ``headroom`` fraction.

GPUs of different kinds (``gpus``: a profile per GPU, e.g. a topology's ranks): each stage's ops are
priced on the GPU the stage runs on, and each GPU's capacity is its own. The ideal is then the
time at which all GPUs would finish together with the work shared in proportion to their speeds,
1 / Σ_g (1 / T_g), T_g being the whole model's compute on GPU g.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from hf_ftpipe.costmodel.memory_estimate import StageMemory, estimate_memory, nodes_by_stage
from hf_ftpipe.costmodel.op_time import NodeCost, comm_time_s, node_costs
from hf_ftpipe.costmodel.options import (
    MemoryOptions,
    Optimizer,
    Schedule,
    TokenSlices,
    check_positive,
    check_training,
    usable_capacity,
)
from hf_ftpipe.costmodel.prediction import GPUCost, Prediction, StageCost
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import ProfileError
from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = [
    "MemoryOptions",
    "Optimizer",
    "TokenSlices",
    "Schedule",
    "estimate",
    "estimate_memory",
    "gpu_cost_s",
    "reprice",
    "stage_traffic",
    "usable_capacity",
]


def estimate(
    graph: CostGraph,
    node_stage: Mapping[str, int],
    stage_device: Sequence[int],
    profile: GPUProfile,
    *,
    num_microbatches: int,
    microbatch_size: int,
    optimizer: Optimizer = "adamw",
    schedule: Schedule = "gpipe",
    dtype: str | None = None,
    costs: Mapping[str, NodeCost] | None = None,
    memory: MemoryOptions | None = None,
    gpus: Sequence[GPUProfile] | None = None,
    gpu_costs: Sequence[Mapping[str, NodeCost]] | None = None,
) -> Prediction:
    """Predict per-stage and per-GPU time and memory of a plan (see the module docstring).

    Args:
        node_stage (`Mapping[str, int]`): every node of ``graph`` → stage index.
        stage_device (`Sequence[int]`): stage index → GPU index.
        microbatch_size (`int`): samples per micro-batch, for the throughput.
        dtype (`str`, *optional*): compute dtype for ``node_costs``; each node's own by default.
        costs (`Mapping[str, NodeCost]`, *optional*): ``node_costs(graph, profile, dtype)``
            when the caller already has them (partitioners that estimate many plans).
        memory (`MemoryOptions`, *optional*): recomputation and gradient accumulation (they change
            time and memory); ``MemoryOptions()`` by default.
        gpus (`Sequence[GPUProfile]`, *optional*): GPU g's own profile, when the GPUs differ: its
            stages' ops are priced on it and its capacity is its memory (``profile`` then gives
            only the link).
        gpu_costs (`Sequence[Mapping[str, NodeCost]]`, *optional*): with ``gpus``, each GPU's op
            costs when the caller already has them.
    """
    check_training(schedule, optimizer, num_microbatches)
    check_positive("microbatch_size", microbatch_size)
    options = memory or MemoryOptions()
    if gpus is not None:
        if gpu_costs is None:
            gpu_costs = [node_costs(graph, gpu, dtype) for gpu in gpus]
        if len(gpu_costs) != len(gpus) or max(stage_device, default=-1) >= len(gpus):
            raise ProfileError(
                f"estimate: {len(gpus)} GPU profiles and {len(gpu_costs)} cost tables for a plan on "
                f"{max(stage_device, default=-1) + 1} GPUs; give one of each per GPU"
            )
    elif costs is None:
        costs = node_costs(graph, profile, dtype)
    stage_nodes = nodes_by_stage(graph, node_stage, stage_device)
    num_stages = len(stage_device)
    # Recomputation runs each forward again just before its backward.
    forward_again = 1.0 if options.recompute else 0.0

    edge_bytes, fwd_bytes, grad_bytes = stage_traffic(graph, node_stage, stage_device)
    model = StageMemory(graph, node_stage, stage_nodes, stage_device, num_microbatches, optimizer, schedule, options)
    stages = []

    def seconds(transfers: dict[int, int]) -> float:  # one message per stage pair
        return math.fsum(comm_time_s(b, profile) for b in transfers.values())

    for s, nodes in enumerate(stage_nodes):
        if gpu_costs is not None:
            costs = gpu_costs[stage_device[s]]
        assert costs is not None  # set above for one profile, per stage for several
        sent = {t: b for (src, t), b in fwd_bytes.items() if src == s}
        received = {src: b for (src, t), b in fwd_bytes.items() if t == s}
        forward_s = math.fsum(costs[n].forward_s for n in nodes)
        stages.append(
            StageCost(
                device=stage_device[s],
                forward_s=forward_s,
                backward_s=math.fsum(costs[n].backward_s for n in nodes) + forward_again * forward_s,
                fwd_in_bytes=sum(received.values()),
                fwd_out_bytes=sum(sent.values()),
                comm_fwd_in_s=seconds(received),
                comm_fwd_out_s=seconds(sent),
                comm_bwd_in_s=seconds({t: grad_bytes[s, t] for t in sent}),
                comm_bwd_out_s=seconds({src: grad_bytes[src, s] for src in received}),
                memory_bytes=model.of_stage(s),
            )
        )

    num_devices = max(stage_device, default=-1) + 1
    gpu_figures = []
    for g in range(num_devices):
        mine = [stages[s] for s in range(num_stages) if stage_device[s] == g]
        compute_s = math.fsum(st.forward_s + st.backward_s for st in mine)
        fwd_out_s = math.fsum(st.comm_fwd_out_s for st in mine)
        bwd_in_s = math.fsum(st.comm_bwd_in_s for st in mine)
        gpu_figures.append(
            GPUCost(
                compute_s=compute_s,
                comm_fwd_out_s=fwd_out_s,
                comm_bwd_in_s=bwd_in_s,
                cost_s=gpu_cost_s(compute_s, fwd_out_s, bwd_in_s),
                capacity_bytes=(profile if gpus is None else gpus[g]).memory_bytes,
                **model.of_gpu(g),
            )
        )

    def total_compute_s(costs: Mapping[str, NodeCost]) -> float:
        return math.fsum(costs[n].total_s + forward_again * costs[n].forward_s for n in graph.graph)

    if gpu_costs is None:
        assert costs is not None
        ideal_s = total_compute_s(costs) / max(profile.count, num_devices, 1)
    else:  # the work shared in proportion to each GPU's speed
        rates = [1.0 / t for t in map(total_compute_s, gpu_costs) if t > 0]
        ideal_s = 1.0 / math.fsum(rates) if rates else 0.0
    return Prediction(
        schedule=schedule,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        optimizer=optimizer,
        stages=stages,
        gpus=gpu_figures,
        step_time_s=max((g.cost_s for g in gpu_figures), default=0.0),
        ideal_step_time_s=ideal_s,
        recompute=options.recompute,
        dtype=dtype,
        stage_edges=[[s, t, b] for (s, t), b in sorted(edge_bytes.items())],
    )


def reprice(prediction: Prediction, node_stage: Mapping[str, int], costs: Mapping[str, NodeCost]) -> Prediction:
    """``prediction`` with every stage's compute taken from ``costs`` (e.g. a measured `CostTable`'s),
    communication and memory kept: what ``hf-ftpipe show --costs`` prints for a plan without its graph."""
    forward_again = 1.0 if prediction.recompute else 0.0
    forward = [0.0] * len(prediction.stages)
    backward = [0.0] * len(prediction.stages)
    for n, s in node_stage.items():
        forward[s] += costs[n].forward_s
        backward[s] += costs[n].backward_s + forward_again * costs[n].forward_s
    stages = [
        replace(st, forward_s=f, backward_s=b) for st, f, b in zip(prediction.stages, forward, backward, strict=True)
    ]
    gpus = []
    for g, gpu in enumerate(prediction.gpus):
        compute_s = math.fsum(st.forward_s + st.backward_s for st in stages if st.device == g)
        cost_s = gpu_cost_s(compute_s, gpu.comm_fwd_out_s, gpu.comm_bwd_in_s)
        gpus.append(replace(gpu, compute_s=compute_s, cost_s=cost_s))
    # the ideal keeps its divisor (the GPUs of the profile): it scales with the total compute
    before_s = math.fsum(st.forward_s + st.backward_s for st in prediction.stages)
    after_s = math.fsum(forward) + math.fsum(backward)
    ideal_s = prediction.ideal_step_time_s * after_s / before_s if before_s > 0 else after_s / max(len(gpus), 1)
    return replace(
        prediction,
        stages=stages,
        gpus=gpus,
        step_time_s=max((g.cost_s for g in gpus), default=0.0),
        ideal_step_time_s=ideal_s,
    )


def gpu_cost_s(compute_s: float, comm_fwd_out_s: float, comm_bwd_in_s: float) -> float:
    """FTPipe's cost of a GPU: communication longer than the compute it overlaps adds the excess."""
    return compute_s + max(0.0, comm_fwd_out_s - compute_s) + max(0.0, comm_bwd_in_s - compute_s)


def stage_traffic(
    graph: CostGraph, node_stage: Mapping[str, int], stage_device: Sequence[int]
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int], defaultdict[tuple[int, int], int]]:
    """Bytes per (source stage, destination stage): activations between any two stages (the
    stage graph), activations between stages on different GPUs, and the gradients that come back
    for those of them that require grad. One rule for the estimate and the simulator's messages."""
    edges: dict[tuple[int, int], int] = defaultdict(int)
    fwd: dict[tuple[int, int], int] = defaultdict(int)
    grad: defaultdict[tuple[int, int], int] = defaultdict(int)
    for u, attrs in graph.graph.nodes(data=True):
        s = node_stage[u]
        for t in {node_stage[v] for v in graph.graph.successors(u)}:
            if t == s:
                continue
            edges[s, t] += attrs["output_bytes"]
            if stage_device[t] != stage_device[s]:
                fwd[s, t] += attrs["output_bytes"]
                if attrs["requires_grad"]:
                    grad[s, t] += attrs["output_bytes"]
    return dict(edges), dict(fwd), grad
