"""What the simulator prices a pipeline with: per stage its forward, backward and update times and
what it keeps in memory, per pair of stages the bytes that travel, per rank what stays in memory.

Two ways to get them, one result (`PipelineCosts`):

- `pipeline_costs` with the plan's graph: each stage's times summed over its nodes' `NodeCost`
  (the roofline's ``node_costs`` by default, or any other per-node costs, e.g. measured ones),
  each message's bytes as the estimate counts them (`hf_ftpipe.costmodel.estimate.stage_traffic`),
  and memory from the cost model's own rules (`hf_ftpipe.costmodel.memory_estimate.StageMemory`).
- `costs_from_prediction` from a plan file alone (no model, no trace): the times the plan's
  prediction recorded per stage, the stage graph's bytes (``Prediction.stage_edges``; a gradient
  is counted as large as its activation), and each GPU's predicted activation memory shared among
  its stages in proportion to their forward time times their micro-batches in flight under the
  planned schedule (static memory, the weights' versions included, stays the planned schedule's).

Messages run over the profile's link: ``latency + bytes / bandwidth`` (`comm_time_s`'s rule);
stages on one GPU hand values over in memory, for free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hf_ftpipe.costmodel.estimate import stage_traffic
from hf_ftpipe.costmodel.memory_estimate import StageMemory, nodes_by_stage
from hf_ftpipe.costmodel.memory_rules import defers_weight_gradient
from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
from hf_ftpipe.costmodel.options import MemoryOptions
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.schedules.rules import awaiting_weight_gradients, in_flight

__all__ = ["LOSS_BYTES", "PipelineCosts", "StageEdge", "costs_from_prediction", "pipeline_costs"]

LOSS_BYTES = 4
"""The loss a last stage copies to every other rank: one float32 per micro-batch."""


@dataclass(frozen=True)
class StageEdge:
    """Stage ``source`` feeds stage ``target``: ``bytes`` of activations per micro-batch, and
    ``grad_bytes`` of their gradients back (0 where nothing sent requires grad)."""

    source: int
    target: int
    bytes: int
    grad_bytes: int


@dataclass(frozen=True, kw_only=True)
class PipelineCosts:
    """Everything the replay prices, as plain numbers (seconds, bytes), per micro-batch.

    Build it with `pipeline_costs` or `costs_from_prediction`, or by hand for a toy pipeline (the
    tests' literal timelines do).
    """

    stage_rank: list[int]
    """The rank (GPU) of each stage."""
    forward_s: list[float]
    backward_s: list[float]
    """Per stage, recomputation's second forward included where the plan recomputes."""
    edges: list[StageEdge]
    """Every pair of stages where one feeds the other, stages on one rank included (free)."""
    link_latency_s: float = 0.0
    link_bandwidth_bytes_per_s: float = math.inf
    update_s: list[float] | None = None
    """Per stage, a weight update inside the pipeline (``async``, ``2bw``); none by default: the
    cost model does not price the optimizer step."""
    loss_stage: int | None = None
    """The stage that computes the loss (its rank copies it to every other); the last by default."""
    static_bytes: list[int] | None = None
    """Per rank, memory held the whole step: weights (and the versions the schedule keeps),
    persistent gradients, optimizer state."""
    activation_bytes: list[int] | None = None
    """Per stage, what one micro-batch keeps from its forward until its backward."""
    backward_bytes: list[int] | None = None
    """Per stage, what its backward adds while it runs."""
    weight_s: list[float] | None = None
    """Per stage, the part of ``backward_s`` that computes weight gradients: under a split-backward
    schedule (``zb-h1``, ``zbv``) ``W`` takes it and ``B`` the rest. ``None``: half of
    ``backward_s`` (a matmul with weights: its backward is two matmuls as large as the forward, one
    for the input gradient and one for the weight's)."""
    weight_kept_bytes: list[int] | None = None
    """Per stage, what a split backward keeps of one micro-batch from its ``B`` to its ``W``."""
    microbatch_size: int = 1
    notes: list[str] = field(default_factory=list)
    """Where the figures come from, for the report (`SimulationResult.to_json`)."""

    def __post_init__(self) -> None:
        num_stages = len(self.stage_rank)
        if num_stages == 0:
            raise PartitionError("a pipeline needs at least one stage; `stage_rank` is empty")
        for name in (
            "forward_s",
            "backward_s",
            "update_s",
            "activation_bytes",
            "backward_bytes",
            "weight_s",
            "weight_kept_bytes",
        ):
            values = getattr(self, name)
            if values is not None and len(values) != num_stages:
                raise PartitionError(f"`{name}` has {len(values)} entries for {num_stages} stages")
            if values is not None and any(v < 0 or not math.isfinite(v) for v in values):
                raise PartitionError(f"`{name}` must be finite and non-negative, got {values}")
        if self.weight_s is not None and any(w > b for w, b in zip(self.weight_s, self.backward_s, strict=True)):
            raise PartitionError(f"`weight_s` {self.weight_s} is a part of `backward_s` {self.backward_s}: never more")
        if self.static_bytes is not None and len(self.static_bytes) != self.num_ranks:
            raise PartitionError(f"`static_bytes` has {len(self.static_bytes)} entries for {self.num_ranks} ranks")
        if self.loss_stage is not None and not 0 <= self.loss_stage < num_stages:
            raise PartitionError(f"`loss_stage` {self.loss_stage} is outside stages 0..{num_stages - 1}")
        for edge in self.edges:
            if not 0 <= edge.source < edge.target < num_stages:
                raise PartitionError(
                    f"stage edge {edge.source}->{edge.target} must go forward between stages 0..{num_stages - 1} "
                    "(stages are numbered in topological order)"
                )
        if self.link_latency_s < 0 or self.link_bandwidth_bytes_per_s <= 0:
            raise PartitionError(
                f"the link needs latency >= 0 and bandwidth > 0, got {self.link_latency_s} s and "
                f"{self.link_bandwidth_bytes_per_s} B/s"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    def split_s(self, stage: int) -> tuple[float, float]:
        """``(B, W)`` of ``stage`` under a split-backward schedule (`weight_s`)."""
        backward = self.backward_s[stage]
        weight = backward / 2 if self.weight_s is None else self.weight_s[stage]
        return backward - weight, weight

    @property
    def num_ranks(self) -> int:
        return max(self.stage_rank) + 1

    @property
    def loss(self) -> int:
        return self.num_stages - 1 if self.loss_stage is None else self.loss_stage

    def transfer_s(self, num_bytes: int) -> tuple[float, float]:
        """``(time on the link, latency after it)`` of one message; zero bytes cost nothing."""
        if num_bytes <= 0:
            return 0.0, 0.0
        return num_bytes / self.link_bandwidth_bytes_per_s, self.link_latency_s


def pipeline_costs(
    plan: Partition,
    graph: CostGraph,
    profile: GPUProfile,
    *,
    costs: Mapping[str, NodeCost] | None = None,
    schedule: str,
    num_microbatches: int,
    dtype: str | None = None,
    recompute: bool = False,
    optimizer: str = "adamw",
    memory: MemoryOptions | None = None,
    microbatch_size: int = 1,
    gpu_profiles: Sequence[GPUProfile] | None = None,
) -> PipelineCosts:
    """The costs of ``plan`` on its ``graph``: times from ``costs`` (per node, e.g. measured; the
    roofline ``node_costs(graph, profile, dtype)`` when not given, or with ``gpu_profiles``, GPU
    g's own profile, the roofline of the GPU each stage runs on) summed per stage, as
    `hf_ftpipe.costmodel.estimate.estimate` sums them; bytes and memory from the cost model's rules.

    A split backward's ``W`` (`PipelineCosts.weight_s`) is half the backward of every product whose
    weight gradient the runtime defers (`defers_weight_gradient`: a linear layer's backward is two
    equal matmuls, the input's gradient and the weight's), measured costs alike; everything else,
    recomputation and the gradients of layer norms and embeddings included, is ``B``'s.
    """
    options = memory or MemoryOptions(recompute=recompute)
    recompute = options.recompute
    source = "the per-node costs given" if costs is not None else "the roofline"
    stage_device = plan.stage_device
    if costs is None and gpu_profiles is not None:
        if len(gpu_profiles) <= max(stage_device):
            raise PartitionError(
                f"`gpu_profiles` lists {len(gpu_profiles)} GPUs, the plan runs on {max(stage_device) + 1}; "
                "give one profile per GPU"
            )
        by_gpu = [node_costs(graph, gpu, dtype) for gpu in gpu_profiles]
        stage_costs = [by_gpu[g] for g in stage_device]
        source = "the roofline of each stage's GPU"
    else:
        costs = node_costs(graph, profile, dtype) if costs is None else costs
        missing = [n for n in graph.graph.nodes if n not in costs]
        if missing:
            raise PartitionError(
                f"`costs` has no entry for {len(missing)} ops of the graph, e.g. {missing[:5]}; pass a cost per "
                "node (hf_ftpipe.costmodel.op_time.node_costs gives the roofline's)"
            )
        stage_costs = [costs] * len(stage_device)
    stage_nodes = nodes_by_stage(graph, plan.node_stage, stage_device)
    forward = [math.fsum(stage_costs[s][n].forward_s for n in nodes) for s, nodes in enumerate(stage_nodes)]
    backward = [
        math.fsum(stage_costs[s][n].backward_s for n in nodes) + (forward[s] if recompute else 0.0)
        for s, nodes in enumerate(stage_nodes)
    ]
    weight = [
        math.fsum(stage_costs[s][n].backward_s / 2 for n in nodes if defers_weight_gradient(graph, n))
        for s, nodes in enumerate(stage_nodes)
    ]
    pairs, _, grads = stage_traffic(graph, plan.node_stage, stage_device)
    # Same-GPU pairs send nothing; their gradient bytes only say that a backward waits (program order does).
    edges = [
        StageEdge(s, t, b, grads.get((s, t), 0) if stage_device[s] != stage_device[t] else b)
        for (s, t), b in sorted(pairs.items())
    ]
    model = StageMemory(
        graph, plan.node_stage, stage_nodes, stage_device, num_microbatches, optimizer, schedule, options
    )
    activation = [
        (held - awaiting_weight_gradients(schedule, s, stage_device, num_microbatches) * model.weight_kept[s])
        // in_flight(schedule, s, stage_device, num_microbatches)
        for s, held in enumerate(model.held_bytes)
    ]
    static = []
    for g in range(max(stage_device) + 1):
        parts = model.of_gpu(g)
        static.append(parts["weights_bytes"] + parts["gradient_bytes"] + parts["optimizer_bytes"])
    outputs = dict(zip(graph.output_names, graph.outputs, strict=False))
    loss_stage = plan.node_stage.get(outputs["loss"]) if "loss" in outputs else None
    return PipelineCosts(
        stage_rank=list(stage_device),
        forward_s=forward,
        backward_s=backward,
        edges=edges,
        link_latency_s=profile.link_latency_s,
        link_bandwidth_bytes_per_s=profile.link_bandwidth_bytes_per_s,
        loss_stage=loss_stage,
        static_bytes=static,
        activation_bytes=activation,
        backward_bytes=list(model.backward),
        weight_s=weight,
        weight_kept_bytes=list(model.weight_kept),
        microbatch_size=microbatch_size,
        notes=[f"times: {source}, summed per stage over the graph's ops; memory: the cost model's rules"],
    )


def costs_from_prediction(plan: Partition, profile: GPUProfile) -> PipelineCosts:
    """The costs a plan file carries (its ``predicted`` figures), for a plan without its model.

    The prediction holds each stage's forward and backward time and the stage graph's activation
    bytes, but not which of them require grad nor each stage's own activation memory: a gradient
    is taken as large as its activation, and each GPU's predicted ``activation_bytes`` is shared
    among its stages in proportion to forward time × micro-batches in flight under the planned
    schedule, so the planned schedule peaks at the predicted memory. Static memory (weights and
    their versions, gradients, optimizer state) is the planned schedule's.
    """
    predicted = plan.predicted
    if predicted is None:
        raise PartitionError(
            "the plan carries no prediction to simulate from; pass its `graph` (hf_ftpipe.trace_model) so the "
            "simulator can price its ops"
        )
    stage_device = plan.stage_device
    if len(predicted.stages) != len(stage_device):
        raise PartitionError(
            f"the plan's prediction has {len(predicted.stages)} stages for {len(stage_device)} in `stage_device`"
        )
    forward = [st.forward_s for st in predicted.stages]
    edges = [StageEdge(int(s), int(t), int(b), int(b)) for s, t, b in predicted.stage_edges]
    notes = ["times: the plan's recorded prediction (roofline) per stage"]
    if not edges and len(stage_device) > 1:  # files written before stage_edges: one value along the chain
        edges = _chain_from_stage_bytes(predicted.stages)
        notes.append("messages: the plan records no stage graph; each stage's bytes sent go to the next stage")
    # Per micro-batch, from what the planned schedule holds: a stage's memory per micro-batch is the
    # model's, whichever schedule is simulated.
    planned, planned_microbatches = predicted.schedule, predicted.num_microbatches
    held = [in_flight(planned, s, stage_device, planned_microbatches) for s in range(len(stage_device))]
    weights = [f * h for f, h in zip(forward, held, strict=True)]
    activation = []
    for s, gpu in enumerate(stage_device):
        total = sum(w for t, w in enumerate(weights) if stage_device[t] == gpu)
        share = weights[s] / total if total > 0 else 0.0
        gpu_bytes = predicted.gpus[gpu].activation_bytes if gpu < len(predicted.gpus) else 0
        activation.append(int(share * gpu_bytes / held[s]))
    static = [g.weights_bytes + g.gradient_bytes + g.optimizer_bytes for g in predicted.gpus]
    notes.append("memory: each GPU's predicted activations shared among its stages by forward time × in flight")
    return PipelineCosts(
        stage_rank=list(stage_device),
        forward_s=forward,
        backward_s=[st.backward_s for st in predicted.stages],
        edges=edges,
        link_latency_s=profile.link_latency_s,
        link_bandwidth_bytes_per_s=profile.link_bandwidth_bytes_per_s,
        static_bytes=static,
        activation_bytes=activation,
        microbatch_size=predicted.microbatch_size,
        notes=notes,
    )


def _chain_from_stage_bytes(stages: Sequence) -> list[StageEdge]:
    return [StageEdge(s, s + 1, st.fwd_out_bytes, st.fwd_out_bytes) for s, st in enumerate(stages[:-1])]
