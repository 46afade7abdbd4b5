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

Memory of a GPU follows ``memory_rules``: weights (distinct parameters and buffers, a tied weight
once) × the versions the schedule keeps (``weight_versions``) + optimizer state + the gradients
that persist (``gradients_persist``) + what each stage keeps per micro-batch × its micro-batches in
flight + what the largest of its backwards adds while it runs. Kept per micro-batch: the
``saved_bytes`` of the stage's ops (what autograd keeps from forward to backward; ``output_bytes``
for a hand-built graph without it) and the values that leave the stage. ``gpipe`` holds every
micro-batch; the 1F1B-style schedules hold, at stage s of S, one micro-batch per stage from s to
the end of the pipeline, stages that share a GPU counted separately (``in_flight``: the rule the
runtime's schedules in ``hf_ftpipe.schedules.orders`` follow).

With recomputation (``MemoryOptions.recompute``, activation checkpointing per stage) a stage keeps,
per micro-batch in flight, only the values it received from other stages (and those it sends), and
pays for that with its forward run a second time, counted in its ``backward_s`` (and in the ideal).
A GPU runs one action at a time, so it recomputes one micro-batch of one of its stages at a time:
the full activations of one micro-batch of its largest stage, in the backward term, not one per
stage. Inputs read straight from the batch (ids, masks, labels) are small and left out.

With token slices (TeraPipe; `TokenSlices`) the unit in flight is a slice of a sequence: a stage
keeps what each slice's own-length graph saves, ``in_flight(..., num_slices=k)`` of them, plus one
key/value buffer per attention layer for every sequence in flight, and the gradients of those
buffers while a sequence runs backward (``hf_ftpipe.runtime.prefix_attention``).

``GPUCost``: ``gradient_bytes`` holds the gradients that persist; ``activation_bytes`` what the
stages keep plus the largest backward's addition, gradients that do not persist included.

Capacity: ``GPUCost.capacity_bytes`` is the device's raw memory; a plan is feasible when every GPU
needs at most ``usable_capacity(profile, memory)``, the raw memory less the ``headroom`` fraction.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from hf_ftpipe.costmodel.memory_rules import (
    backward_bytes,
    kept_output_bytes,
    kv_buffer_bytes,
    largest_operand_bytes,
    optimizer_state_bytes,
    saved_bytes,
    sliced_saved_bytes,
    stage_rules,
)
from hf_ftpipe.costmodel.op_time import NodeCost, comm_time_s, node_costs
from hf_ftpipe.costmodel.prediction import GPUCost, Prediction, StageCost
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.schedules.registry import ScheduleName
from hf_ftpipe.schedules.rules import in_flight

__all__ = [
    "MemoryOptions",
    "Optimizer",
    "TokenSlices",
    "Schedule",
    "estimate",
    "estimate_memory",
    "gpu_cost_s",
    "usable_capacity",
]

Optimizer = Literal["sgd", "sgd-momentum", "adam", "adamw", "adafactor"]
Schedule = ScheduleName
"""The pipeline schedules a plan can be priced for (`hf_ftpipe.schedules.registry`)."""


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


@dataclass(frozen=True, kw_only=True)
class TokenSlices:
    """Token slicing (TeraPipe) for the memory model: each sequence cut into ``slice_lengths``.

    A slice is a unit in flight like a micro-batch (``in_flight(..., num_slices=k)``), keeping what
    its own length's graph saves (`memory_rules.sliced_saved_bytes`); each sequence in flight
    also holds its keys and values on every stage (`memory_rules.kv_buffer_bytes`), and the one in
    backward their gradients too. Plain data, built from ``SlicedModel`` by the caller.
    """

    slice_lengths: tuple[int, ...]
    graphs: Mapping[int, CostGraph]
    """Slice length → the model's graph at that length."""
    node_stages: Mapping[int, Mapping[str, int]]
    """Slice length → that graph's node → stage: the same stages as the whole graph's."""

    def __post_init__(self) -> None:
        missing = sorted(set(self.slice_lengths) - set(self.graphs) | set(self.slice_lengths) - set(self.node_stages))
        if missing:
            raise PartitionError(f"`TokenSlices` lacks a graph or a node → stage map for slice lengths {missing}")


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
        recompute=options.recompute,
        dtype=dtype,
        stage_edges=[[s, t, b] for (s, t), b in sorted(edge_bytes.items())],
    )


def gpu_cost_s(compute_s: float, comm_fwd_out_s: float, comm_bwd_in_s: float) -> float:
    """FTPipe's cost of a GPU: communication longer than the compute it overlaps adds the excess."""
    return compute_s + max(0.0, comm_fwd_out_s - compute_s) + max(0.0, comm_bwd_in_s - compute_s)


class _Memory:
    """Memory of each stage and each GPU, from the params and outputs of their nodes
    (the terms of ``memory_rules``)."""

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
        token_slices: TokenSlices | None = None,
    ) -> None:
        self.graph, self.stage_device = graph, stage_device
        self.optimizer = optimizer
        self.stage_params = [graph.params_of(nodes) for nodes in stage_nodes]
        self.versions: list[int] = []
        self.persist: list[bool] = []
        self.held_bytes: list[int] = []
        """Per stage: what it keeps for all its micro-batches in flight."""
        self.backward: list[int] = []
        """Per stage: what its backward adds while it runs (a GPU counts its largest)."""
        for s, nodes in enumerate(stage_nodes):
            rules = stage_rules(
                schedule,
                s,
                stage_device,
                num_microbatches,
                gradient_accumulation_steps=options.gradient_accumulation_steps,
                recompute=options.recompute,
            )
            self.versions.append(rules.versions)
            self.persist.append(rules.persist)
            if token_slices is not None:
                held, backward = _sliced_stage_bytes(
                    graph, nodes, s, token_slices, schedule, stage_device, num_microbatches, rules.persist
                )
                self.held_bytes.append(held)
                self.backward.append(backward)
                continue
            saved = sum(saved_bytes(graph, n) for n in nodes)
            kept = kept_output_bytes(graph, nodes, node_stage)
            if options.recompute:
                inputs = {u for v in nodes for u in graph.graph.predecessors(v) if node_stage[u] != s}
                kept += sum(graph.node(u)["output_bytes"] for u in inputs)
            else:
                kept += saved
            self.held_bytes.append(kept * rules.in_flight)
            self.backward.append(
                backward_bytes(
                    persist=rules.persist,
                    largest_operand=largest_operand_bytes(graph, nodes),
                    gradients=graph.param_bytes(nodes, trainable_only=True),
                    saved=saved,
                    recomputed=saved if options.recompute else 0,
                )
            )

    def _params(self, versions_of: dict[str, int], persist_of: dict[str, bool]) -> dict[str, int]:
        weights = gradients = optimizer = 0
        for name, versions in versions_of.items():
            info = self.graph.params[name]
            weights += info.bytes * versions
            if info.requires_grad:
                gradients += info.bytes if persist_of[name] else 0
                optimizer += optimizer_state_bytes(self.optimizer, info.shape, info.bytes)
        return {"weights_bytes": weights, "gradient_bytes": gradients, "optimizer_bytes": optimizer}

    def of_stage(self, s: int) -> int:
        names = self.stage_params[s]
        parts = self._params(dict.fromkeys(names, self.versions[s]), dict.fromkeys(names, self.persist[s]))
        return sum(parts.values()) + self.held_bytes[s] + self.backward[s]

    def of_gpu(self, g: int) -> dict[str, int]:
        # A weight read by several stages of this GPU (tied, or Mixed-Pipe) is stored once, with as
        # many versions as the most demanding of those stages keeps, and its gradient persists if
        # it does for any of them.
        versions_of: dict[str, int] = {}
        persist_of: dict[str, bool] = {}
        held = backward = 0
        for s, device in enumerate(self.stage_device):
            if device == g:
                for name in self.stage_params[s]:
                    versions_of[name] = max(versions_of.get(name, 0), self.versions[s])
                    persist_of[name] = persist_of.get(name, False) or self.persist[s]
                held += self.held_bytes[s]
                backward = max(backward, self.backward[s])  # one backward at a time
        parts = self._params(versions_of, persist_of)
        parts["activation_bytes"] = held + backward
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
    token_slices: TokenSlices | None = None,
) -> list[int]:
    """Predicted memory bytes of each GPU (index = device), without a profile.

    With ``token_slices`` each of the ``num_microbatches`` micro-batches is a sequence cut into
    token slices (`TokenSlices`); ``graph`` and ``node_stage`` are the whole sequence's.
    """
    _check_choice("schedule", schedule, Schedule)
    _check_choice("optimizer", optimizer, Optimizer)
    _check_positive("num_microbatches", num_microbatches)
    stage_nodes = _stage_nodes(graph, node_stage, stage_device)
    model = _Memory(
        graph,
        node_stage,
        stage_nodes,
        stage_device,
        num_microbatches,
        optimizer,
        schedule,
        memory or MemoryOptions(),
        token_slices,
    )
    num_devices = max(stage_device, default=-1) + 1
    return [model.of_gpu(g)["memory_bytes"] for g in range(num_devices)]


def _sliced_stage_bytes(
    graph: CostGraph,
    nodes: Sequence[str],
    stage: int,
    token_slices: TokenSlices,
    schedule: str,
    stage_device: Sequence[int],
    num_microbatches: int,
    persist: bool,
) -> tuple[int, int]:
    """A sliced stage's ``(held, backward)`` bytes, the terms `_Memory` keeps per stage.

    Held: the largest ``in_flight`` slice units (all of them under ``gpipe``) and the key/value
    buffers of the sequences they belong to. Backward: the working tensors of the largest slice,
    the gradients it creates where they do not persist, and the sequence's key/value gradients.
    """
    k = len(token_slices.slice_lengths)
    units, operand = [], 0
    for length in token_slices.slice_lengths:
        part, node_stage = token_slices.graphs[length], token_slices.node_stages[length]
        mine = [n for n in part.topological_order() if node_stage[n] == stage]
        units.append(sliced_saved_bytes(part, mine) + kept_output_bytes(part, mine, node_stage))
        operand = max(operand, largest_operand_bytes(part, mine))
    count = in_flight(schedule, stage, stage_device, num_microbatches, num_slices=k)
    held = sum(sorted(units * num_microbatches, reverse=True)[:count])
    sequences = min(num_microbatches, -(-(count - 1) // k) + 1)  # units in flight may straddle two
    kv = kv_buffer_bytes(graph, nodes)
    backward = backward_bytes(
        persist=persist,
        largest_operand=operand,
        gradients=graph.param_bytes(nodes, trainable_only=True),
        saved=units[-1],  # a sequence's first backward is its last slice's
        recomputed=0,
    )
    return held + sequences * kv, backward + kv


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
