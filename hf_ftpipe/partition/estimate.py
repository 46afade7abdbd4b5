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

Memory of a GPU: weights (distinct parameters and buffers, a tied weight once) × the versions the
schedule keeps + gradients + optimizer state + activations × micro-batches in flight. Activations
are approximated by the outputs of the GPU's ops. ``gpipe`` is the reference; the other schedules
are approximations (see ``in_flight`` and ``weight_versions``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partition.plan import GPUCost, Prediction, StageCost
from hf_ftpipe.profile.cost import NodeCost, comm_time_s, node_costs
from hf_ftpipe.profile.gpu import GPUProfile

__all__ = [
    "Optimizer",
    "Schedule",
    "estimate",
    "estimate_memory",
    "gpu_cost_s",
    "in_flight",
    "optimizer_state_bytes",
    "weight_versions",
]

Optimizer = Literal["sgd", "sgd-momentum", "adam", "adamw", "adafactor"]
Schedule = Literal["gpipe", "1f1b", "async", "2bw"]


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """How memory is budgeted when a plan is made and checked."""

    headroom: float = 0.1
    """Fraction of each GPU's memory kept free (allocator fragmentation, CUDA context, buffers)."""
    recompute: bool = False
    """Activation recomputation: a stage keeps only its inputs per micro-batch in flight, and
    recomputes one micro-batch's activations during its backward."""
    gradient_accumulation_steps: int = 1
    """For `async`: micro-batches per weight update; fewer updates in flight means fewer stashed
    weight versions."""


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
) -> Prediction:
    """Predict per-stage and per-GPU time and memory of a plan (see the module docstring).

    Args:
        node_stage (`Mapping[str, int]`): every node of ``graph`` → stage index.
        stage_device (`Sequence[int]`): stage index → GPU index.
        microbatch_size (`int`): samples per micro-batch, for the throughput.
        dtype (`str`, *optional*): compute dtype for ``node_costs``; each node's own by default.
        costs (`Mapping[str, NodeCost]`, *optional*): ``node_costs(graph, profile, dtype)``
            when the caller already has them (partitioners that estimate many plans).
    """
    _check_choice("schedule", schedule, Schedule)
    _check_choice("optimizer", optimizer, Optimizer)
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("microbatch_size", microbatch_size)
    if costs is None:
        costs = node_costs(graph, profile, dtype)
    stage_nodes = _stage_nodes(graph, node_stage, stage_device)
    num_stages = len(stage_device)

    fwd_bytes, grad_bytes = _cross_gpu_traffic(graph, node_stage, stage_device)
    memory = _Memory(graph, stage_nodes, stage_device, num_microbatches, optimizer, schedule)
    stages = []

    def seconds(transfers: dict[int, int]) -> float:  # one message per stage pair
        return math.fsum(comm_time_s(b, profile) for b in transfers.values())

    for s, nodes in enumerate(stage_nodes):
        sent = {t: b for (src, t), b in fwd_bytes.items() if src == s}
        received = {src: b for (src, t), b in fwd_bytes.items() if t == s}
        stages.append(
            StageCost(
                device=stage_device[s],
                forward_s=math.fsum(costs[n].forward_s for n in nodes),
                backward_s=math.fsum(costs[n].backward_s for n in nodes),
                fwd_in_bytes=sum(received.values()),
                fwd_out_bytes=sum(sent.values()),
                comm_fwd_in_s=seconds(received),
                comm_fwd_out_s=seconds(sent),
                comm_bwd_in_s=seconds({t: grad_bytes[s, t] for t in sent}),
                comm_bwd_out_s=seconds({src: grad_bytes[src, s] for src in received}),
                memory_bytes=memory.of_stage(s),
            )
        )

    num_devices = max(stage_device, default=-1) + 1
    gpus = []
    for g in range(num_devices):
        mine = [stages[s] for s in range(num_stages) if stage_device[s] == g]
        compute_s = math.fsum(st.forward_s + st.backward_s for st in mine)
        fwd_out_s = math.fsum(st.comm_fwd_out_s for st in mine)
        bwd_in_s = math.fsum(st.comm_bwd_in_s for st in mine)
        gpus.append(
            GPUCost(
                compute_s=compute_s,
                comm_fwd_out_s=fwd_out_s,
                comm_bwd_in_s=bwd_in_s,
                cost_s=gpu_cost_s(compute_s, fwd_out_s, bwd_in_s),
                capacity_bytes=profile.memory_bytes,
                **memory.of_gpu(g),
            )
        )
    total_compute_s = math.fsum(costs[n].total_s for n in graph.graph)
    return Prediction(
        schedule=schedule,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        optimizer=optimizer,
        stages=stages,
        gpus=gpus,
        step_time_s=max((g.cost_s for g in gpus), default=0.0),
        ideal_step_time_s=total_compute_s / max(profile.count, num_devices, 1),
    )


def gpu_cost_s(compute_s: float, comm_fwd_out_s: float, comm_bwd_in_s: float) -> float:
    """FTPipe's cost of a GPU: communication longer than the compute it overlaps adds the excess."""
    return compute_s + max(0.0, comm_fwd_out_s - compute_s) + max(0.0, comm_bwd_in_s - compute_s)


def in_flight(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once.

    GPipe runs every forward before any backward: all ``num_microbatches``. 1F1B-style schedules
    (``1f1b``, ``async``, ``2bw``) start backwards as soon as the last stage can: a stage holds
    one micro-batch per stage from it to the end, ``num_stages − stage_index`` (approximate when
    a GPU runs several stages).
    """
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage_index)


def weight_versions(schedule: str, stage_index: int, num_stages: int) -> int:
    """Copies of its weights a stage keeps: PipeDream's weight stashing keeps one per micro-batch
    between its forward and its backward (``num_stages − stage_index``), 2BW two, flushing
    schedules one."""
    if schedule == "async":
        return num_stages - stage_index
    if schedule == "2bw":
        return 2
    return 1


def optimizer_state_bytes(optimizer: str, shape: tuple[int, ...], num_bytes: int) -> int:
    """Optimizer state of one trainable tensor of ``shape`` taking ``num_bytes``.

    SGD keeps none, momentum one buffer, Adam(W) two (first and second moments). Adafactor (as in
    transformers, without first moment) keeps a row and a column vector per matrix — factored
    second moments, ``(rows + cols) / (rows × cols)`` of the tensor — and a full vector for 1-D
    tensors.
    """
    if optimizer == "sgd":
        return 0
    if optimizer == "sgd-momentum":
        return num_bytes
    if optimizer in ("adam", "adamw"):
        return 2 * num_bytes
    numel = 1
    for size in shape:
        numel *= size
    if len(shape) < 2 or numel == 0:
        return num_bytes
    rows, cols = shape[-2], shape[-1]
    return num_bytes * (rows + cols) // (rows * cols)


class _Memory:
    """Memory of each stage and each GPU, from the params and outputs of their nodes."""

    def __init__(
        self,
        graph: CostGraph,
        stage_nodes: list[list[str]],
        stage_device: Sequence[int],
        num_microbatches: int,
        optimizer: str,
        schedule: str,
    ) -> None:
        self.graph, self.stage_device = graph, stage_device
        self.optimizer = optimizer
        num_stages = len(stage_nodes)
        self.stage_params = [graph.params_of(nodes) for nodes in stage_nodes]
        self.versions = [weight_versions(schedule, s, num_stages) for s in range(num_stages)]
        self.activations = [
            sum(graph.node(n)["output_bytes"] for n in nodes) * in_flight(schedule, s, num_stages, num_microbatches)
            for s, nodes in enumerate(stage_nodes)
        ]

    def _params(self, versions_of: dict[str, int]) -> dict[str, int]:
        weights = gradients = optimizer = 0
        for name, versions in versions_of.items():
            info = self.graph.params[name]
            weights += info.bytes * versions
            if info.requires_grad:
                gradients += info.bytes
                optimizer += optimizer_state_bytes(self.optimizer, info.shape, info.bytes)
        return {"weights_bytes": weights, "gradient_bytes": gradients, "optimizer_bytes": optimizer}

    def of_stage(self, s: int) -> int:
        parts = self._params(dict.fromkeys(self.stage_params[s], self.versions[s]))
        return sum(parts.values()) + self.activations[s]

    def of_gpu(self, g: int) -> dict[str, int]:
        # A weight read by several stages of this GPU (tied, or Mixed-Pipe) is stored once,
        # with as many versions as the most demanding of those stages keeps.
        versions_of: dict[str, int] = {}
        activations = 0
        for s, device in enumerate(self.stage_device):
            if device == g:
                for name in self.stage_params[s]:
                    versions_of[name] = max(versions_of.get(name, 0), self.versions[s])
                activations += self.activations[s]
        parts = self._params(versions_of)
        parts["activation_bytes"] = activations
        parts["memory_bytes"] = sum(parts.values())
        return parts


def estimate_memory(
    graph: CostGraph,
    node_stage: Mapping[str, int],
    stage_device: Sequence[int],
    *,
    num_microbatches: int,
    optimizer: Optimizer = "adamw",
    schedule: Schedule = "gpipe",
) -> list[int]:
    """Predicted memory bytes of each GPU (index = device), without a profile."""
    _check_choice("schedule", schedule, Schedule)
    _check_choice("optimizer", optimizer, Optimizer)
    stage_nodes = _stage_nodes(graph, node_stage, stage_device)
    memory = _Memory(graph, stage_nodes, stage_device, num_microbatches, optimizer, schedule)
    num_devices = max(stage_device, default=-1) + 1
    return [memory.of_gpu(g)["memory_bytes"] for g in range(num_devices)]


def _stage_nodes(graph: CostGraph, node_stage: Mapping[str, int], stage_device: Sequence[int]) -> list[list[str]]:
    """Nodes of each stage in execution order; a plain error for a map that does not fit."""
    missing = [n for n in graph.graph.nodes if n not in node_stage]
    if missing:
        raise PartitionError(
            f"{len(missing)} ops of the graph are in no stage, e.g. {missing[:5]}; "
            "`node_stage` must map every node (run validate_partition for details)"
        )
    stage_nodes: list[list[str]] = [[] for _ in stage_device]
    for node in graph.topological_order():
        s = node_stage[node]
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(stage_device):
            raise PartitionError(
                f"op {node!r} is in stage {s!r}, outside 0..{len(stage_device) - 1} "
                f"({len(stage_device)} stages in `stage_device`)"
            )
        stage_nodes[s].append(node)
    return stage_nodes


def _cross_gpu_traffic(
    graph: CostGraph, node_stage: Mapping[str, int], stage_device: Sequence[int]
) -> tuple[dict[tuple[int, int], int], defaultdict[tuple[int, int], int]]:
    """Bytes per (source stage, destination stage) on different GPUs: activations forward, and
    the gradients that come back for those of them that require grad."""
    fwd: dict[tuple[int, int], int] = defaultdict(int)
    grad: defaultdict[tuple[int, int], int] = defaultdict(int)
    for u, attrs in graph.graph.nodes(data=True):
        s = node_stage[u]
        for t in {node_stage[v] for v in graph.graph.successors(u)}:
            if stage_device[t] != stage_device[s]:
                fwd[s, t] += attrs["output_bytes"]
                if attrs["requires_grad"]:
                    grad[s, t] += attrs["output_bytes"]
    return dict(fwd), grad


def _check_choice(name: str, value: str, options: object) -> None:
    valid = get_args(options)
    if value not in valid:
        raise PartitionError(f"unknown `{name}` {value!r}; use one of {list(valid)}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PartitionError(f"`{name}` must be a positive integer, got {value!r}")
