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
schedule keeps + gradients + optimizer state + activations × micro-batches in flight. The
activations of one micro-batch are the ``saved_bytes`` of the GPU's ops: what autograd keeps from
forward to backward (``output_bytes`` for a hand-built graph without it). ``gpipe`` holds every
micro-batch; the 1F1B-style schedules hold, at stage s of S, one micro-batch per stage from s to
the end of the pipeline, stages that share a GPU counted separately (``in_flight``: the rule the
runtime's schedules in ``hf_ftpipe.runtime.schedule`` follow); ``weight_versions`` counts the
copies of the weights.

With recomputation (``MemoryOptions.recompute``, activation checkpointing per stage) a stage keeps,
per micro-batch in flight, only the values it received from other stages, and pays for that with
its forward run a second time, counted in its ``backward_s`` (and in the ideal). A GPU runs one
action at a time, so it recomputes one micro-batch of one of its stages at a time: on top of the
kept inputs it needs the full activations of one micro-batch of its largest stage, not one per
stage::

    activations of a GPU = Σ over its stages (kept inputs × in flight) + max over its stages (saved)

Inputs read straight from the batch (ids, masks, labels) are small and left out.

Capacity: ``GPUCost.capacity_bytes`` is the device's raw memory; a plan is feasible when every GPU
needs at most ``usable_capacity(profile, memory)``, the raw memory less the ``headroom`` fraction.
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
    "MemoryOptions",
    "Optimizer",
    "Schedule",
    "estimate",
    "estimate_memory",
    "gpu_cost_s",
    "in_flight",
    "optimizer_state_bytes",
    "usable_capacity",
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

    def __post_init__(self) -> None:
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)):
            raise PartitionError(f"`headroom` must be a number in [0, 1), got {self.headroom!r}")
        if not 0.0 <= self.headroom < 1.0:
            raise PartitionError(
                f"`headroom` is the fraction of GPU memory kept free and must be in [0, 1), got "
                f"{self.headroom!r}; e.g. 0.1 keeps 10% free"
            )
        _check_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)


def usable_capacity(profile: GPUProfile, memory: MemoryOptions | None = None) -> int:
    """Bytes a plan may use on one GPU of ``profile``: its memory less ``memory.headroom``."""
    headroom = (memory or MemoryOptions()).headroom
    return int(profile.memory_bytes * (1.0 - headroom))


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
    """
    _check_choice("schedule", schedule, Schedule)
    _check_choice("optimizer", optimizer, Optimizer)
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("microbatch_size", microbatch_size)
    options = memory or MemoryOptions()
    if costs is None:
        costs = node_costs(graph, profile, dtype)
    stage_nodes = _stage_nodes(graph, node_stage, stage_device)
    num_stages = len(stage_device)
    # Recomputation runs each forward again just before its backward.
    forward_again = 1.0 if options.recompute else 0.0

    edge_bytes, fwd_bytes, grad_bytes = _stage_traffic(graph, node_stage, stage_device)
    model = _Memory(graph, node_stage, stage_nodes, stage_device, num_microbatches, optimizer, schedule, options)
    stages = []

    def seconds(transfers: dict[int, int]) -> float:  # one message per stage pair
        return math.fsum(comm_time_s(b, profile) for b in transfers.values())

    for s, nodes in enumerate(stage_nodes):
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
                **model.of_gpu(g),
            )
        )
    total_compute_s = math.fsum(costs[n].total_s + forward_again * costs[n].forward_s for n in graph.graph)
    return Prediction(
        schedule=schedule,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        optimizer=optimizer,
        stages=stages,
        gpus=gpus,
        step_time_s=max((g.cost_s for g in gpus), default=0.0),
        ideal_step_time_s=total_compute_s / max(profile.count, num_devices, 1),
        stage_edges=[[s, t, b] for (s, t), b in sorted(edge_bytes.items())],
    )


def gpu_cost_s(compute_s: float, comm_fwd_out_s: float, comm_bwd_in_s: float) -> float:
    """FTPipe's cost of a GPU: communication longer than the compute it overlaps adds the excess."""
    return compute_s + max(0.0, comm_fwd_out_s - compute_s) + max(0.0, comm_bwd_in_s - compute_s)


def in_flight(schedule: str, stage_index: int, stage_device: Sequence[int], num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once.

    GPipe runs every forward before any backward: all M = ``num_microbatches``. The 1F1B-style
    schedules (``1f1b``, ``async``, ``2bw``) run a backward as soon as one is ready and hold
    min(M, S − ``stage_index``) at a stage, S = ``len(stage_device)``: one micro-batch per stage
    from this one to the end of the pipeline, its depth in stages, whichever GPUs run them.

    Stages, not GPUs: a GPU that runs several stages runs one action at a time, so a micro-batch's
    round trip from a stage to the end and back waits in the queue of every stage it passes, the
    stages that share a GPU included. To keep every GPU busy a stage needs one micro-batch in
    flight per stage downstream. ``hf_ftpipe.runtime.schedule`` follows this rule: each rank runs
    its deepest ready stage's action, a backward before a forward, a forward only while the stage
    holds fewer than ``in_flight`` micro-batches. Simulated in that schedule (forward 1, backward
    2, a chain of stages), limits counting each GPU once (the distinct GPUs from the stage on)
    keep the ranks of Mixed placements only 67–80% busy — GPUs [0, 1, 1, 0]: 67%, [0, 1, 2, 2, 1,
    0]: 71%, [0, 1, 2, 3, 3, 2, 1, 0]: 72% — where the depth in stages keeps them 88–97% busy
    (97%, 89%, 88%); a chain of one stage per GPU is 99% busy either way. Stages 0-3 on GPUs
    [0, 1, 1, 0], M ≥ 4::

        stage           0   1   2   3
        GPU             0   1   1   0
        in flight       4   3   2   1

    Args:
        stage_device (`Sequence[int]`): stage index → GPU index, for every stage of the plan.
    """
    if not 0 <= stage_index < len(stage_device):
        raise PartitionError(
            f"`stage_index` {stage_index} is outside the plan's stages 0..{len(stage_device) - 1} "
            f"(`stage_device` has {len(stage_device)} entries)"
        )
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, len(stage_device) - stage_index)


def weight_versions(
    schedule: str,
    stage_index: int,
    stage_device: Sequence[int],
    *,
    num_microbatches: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> int:
    """Copies of its weights a stage keeps: flushing schedules (``gpipe``, ``1f1b``) one, 2BW two,
    ``async`` (PipeDream's weight stashing) one per weight version still in flight.

    Under ``async`` the forward and backward of a micro-batch use the same version. A stage has
    k = ``in_flight(...)`` micro-batches between their forward and backward (S − ``stage_index``
    in the steady state, S = ``len(stage_device)``, stages sharing a GPU counted separately;
    ``num_microbatches`` caps it when given). They are k consecutive micro-batches, and the
    weights change once every G = ``gradient_accumulation_steps`` of them, so they span at most
    ⌈(k − 1) / G⌉ + 1 versions; the newest of those is the current weights. G = 1 gives k:
    PipeDream's "depth d from the end keeps d + 1 versions"::

        k = 4, G = 1: micro-batches 5 6 7 8 → versions 5 6 7 8    (4 copies)
        k = 4, G = 2: micro-batches 5 6 7 8 → versions 2 3 3 4    (⌈3/2⌉ + 1 = 3 copies)

    Args:
        stage_device (`Sequence[int]`): stage index → GPU index, for every stage of the plan.
        num_microbatches (`int`, *optional*): caps k; the steady state's k when not given.
    """
    if schedule == "2bw":
        return 2
    if schedule != "async":
        return 1
    # No cap given: S − stage_index, which never exceeds len(stage_device).
    cap = len(stage_device) if num_microbatches is None else num_microbatches
    k = in_flight(schedule, stage_index, stage_device, cap)
    return -(-(k - 1) // gradient_accumulation_steps) + 1


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
        node_stage: Mapping[str, int],
        stage_nodes: list[list[str]],
        stage_device: Sequence[int],
        num_microbatches: int,
        optimizer: str,
        schedule: str,
        options: MemoryOptions,
    ) -> None:
        self.graph, self.stage_device = graph, stage_device
        self.optimizer = optimizer
        num_stages = len(stage_nodes)
        self.stage_params = [graph.params_of(nodes) for nodes in stage_nodes]
        self.versions = [
            weight_versions(
                schedule,
                s,
                stage_device,
                num_microbatches=num_microbatches,
                gradient_accumulation_steps=options.gradient_accumulation_steps,
            )
            for s in range(num_stages)
        ]
        # Per stage: the activations held for its micro-batches in flight, and, under
        # recomputation, the full activations of the one being recomputed (0 without), which a GPU
        # needs for one of its stages at a time: of_gpu takes the largest.
        self.held_bytes: list[int] = []
        self.recomputed: list[int] = []
        for s, nodes in enumerate(stage_nodes):
            saved = sum(saved_bytes(graph, n) for n in nodes)
            held = in_flight(schedule, s, stage_device, num_microbatches)
            if options.recompute:
                inputs = {u for v in nodes for u in graph.graph.predecessors(v) if node_stage[u] != s}
                self.held_bytes.append(sum(graph.node(u)["output_bytes"] for u in inputs) * held)
                self.recomputed.append(saved)
            else:
                self.held_bytes.append(saved * held)
                self.recomputed.append(0)

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
        return sum(parts.values()) + self.held_bytes[s] + self.recomputed[s]

    def of_gpu(self, g: int) -> dict[str, int]:
        # A weight read by several stages of this GPU (tied, or Mixed-Pipe) is stored once,
        # with as many versions as the most demanding of those stages keeps.
        versions_of: dict[str, int] = {}
        held = recomputed = 0
        for s, device in enumerate(self.stage_device):
            if device == g:
                for name in self.stage_params[s]:
                    versions_of[name] = max(versions_of.get(name, 0), self.versions[s])
                held += self.held_bytes[s]
                recomputed = max(recomputed, self.recomputed[s])  # one stage recomputed at a time
        parts = self._params(versions_of)
        parts["activation_bytes"] = held + recomputed
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
    memory: MemoryOptions | None = None,
) -> list[int]:
    """Predicted memory bytes of each GPU (index = device), without a profile."""
    _check_choice("schedule", schedule, Schedule)
    _check_choice("optimizer", optimizer, Optimizer)
    _check_positive("num_microbatches", num_microbatches)
    stage_nodes = _stage_nodes(graph, node_stage, stage_device)
    model = _Memory(
        graph, node_stage, stage_nodes, stage_device, num_microbatches, optimizer, schedule, memory or MemoryOptions()
    )
    num_devices = max(stage_device, default=-1) + 1
    return [model.of_gpu(g)["memory_bytes"] for g in range(num_devices)]


def saved_bytes(graph: CostGraph, node: str) -> int:
    """Activation bytes ``node`` keeps per micro-batch: ``saved_bytes``, else ``output_bytes``
    (hand-built graphs)."""
    attrs = graph.node(node)
    value = attrs.get("saved_bytes")
    return attrs["output_bytes"] if value is None else value


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


def _stage_traffic(
    graph: CostGraph, node_stage: Mapping[str, int], stage_device: Sequence[int]
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int], defaultdict[tuple[int, int], int]]:
    """Bytes per (source stage, destination stage): activations between any two stages (the
    stage graph), activations between stages on different GPUs, and the gradients that come back
    for those of them that require grad."""
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


def _check_choice(name: str, value: str, options: object) -> None:
    valid = get_args(options)
    if value not in valid:
        raise PartitionError(f"unknown `{name}` {value!r}; use one of {list(valid)}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PartitionError(f"`{name}` must be a positive integer, got {value!r}")
