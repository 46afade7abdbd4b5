"""Predicted memory of each stage and GPU of a plan (the terms of ``memory_rules``).

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hf_ftpipe.costmodel.memory_rules import (
    backward_bytes,
    kept_output_bytes,
    kv_buffer_bytes,
    largest_operand_bytes,
    optimizer_state_bytes,
    saved_bytes,
    sliced_saved_bytes,
    stage_rules,
    weight_gradient_bytes,
    weight_versions_of,
    weights_only_w_computes,
)
from hf_ftpipe.costmodel.options import (
    MemoryOptions,
    Optimizer,
    Schedule,
    TokenSlices,
    check_training,
)
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.schedules.rules import State, held_at_peaks, held_before_backwards, in_flight

__all__ = ["StageMemory", "estimate_memory", "nodes_by_stage"]


class StageMemory:
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
        self.weight_kept: list[int] = []
        """Per stage: what a split backward keeps of one micro-batch from its B to its W."""
        self.per_microbatch: list[int] = []
        """Per stage: what it keeps of one micro-batch from its forward to its backward."""
        only_w = weights_only_w_computes(graph) if options.gradient_accumulation_steps == 1 else set()
        self.deferred_gradients = [_deferred_gradient_bytes(graph, nodes, only_w) for nodes in stage_nodes]
        """Per stage: gradients only its ``W`` creates, charged with the weights but absent before
        its first ``W`` of a step (``Trainer`` frees gradients between steps; with accumulation they persist)."""
        # Under recomputation too: a micro-batch awaiting W keeps W's inputs, which there outweigh
        # the stage's inputs it keeps in flight, so only the walk sees a stage holding W's inputs for
        # every micro-batch (T5-3B's zbv V: 11-16 GiB a GPU where the per-stage rules said 7-9).
        # The partitioners price each stage on the same walk (`schedules.rules.stage_moments`).
        ordered = token_slices is None
        self.states = held_at_peaks(schedule, stage_device, num_microbatches) if ordered else None
        """Per GPU, what it holds after each action of a fixed order (`held_at_peaks`), or ``None``."""
        self.backward_moments = held_before_backwards(schedule, stage_device, num_microbatches) if ordered else None
        """Per GPU, each backward's stage and what the GPU holds as it starts (`held_before_backwards`)."""
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
                self.weight_kept.append(0)  # sliced schedules do not split their backwards
                self.per_microbatch.append(0)
                continue
            saved = sum(saved_bytes(graph, n) for n in nodes)
            kept = kept_output_bytes(graph, nodes, node_stage)
            if options.recompute:
                inputs = {u for v in nodes for u in graph.graph.predecessors(v) if node_stage[u] != s}
                kept += sum(graph.node(u)["output_bytes"] for u in inputs)
            else:
                kept += saved
            self.weight_kept.append(weight_gradient_bytes(graph, nodes))
            self.per_microbatch.append(kept)
            self.held_bytes.append(kept * rules.in_flight + rules.awaiting_weights * self.weight_kept[-1])
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
            weights += info.bytes * weight_versions_of(info.requires_grad, info.is_buffer, versions)
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
        activations = held + backward
        if self.states is not None and self.backward_moments is not None:
            # The order's own peak: its stages' busiest moments need not coincide, and a backward's
            # working memory comes on top of what the GPU holds as that backward starts.
            activations = max(
                max((self._held(state) for state in self.states[g]), default=0),
                max((self._held(state) + self.backward[s] for s, state in self.backward_moments[g]), default=0),
            )
        parts = self._params(versions_of, persist_of)
        parts["activation_bytes"] = activations
        parts["memory_bytes"] = sum(parts.values())
        return parts

    def _held(self, state: State) -> int:
        """What a GPU holds in ``state`` (`held_at_peaks`): activations, what ``W`` reads, less the
        deferred gradients of stages that have run no ``W`` yet."""
        return sum(
            a * kept + w * weight - before_w * grads
            for (a, w, before_w), kept, weight, grads in zip(
                state, self.per_microbatch, self.weight_kept, self.deferred_gradients, strict=True
            )
        )


def _deferred_gradient_bytes(graph: CostGraph, nodes: Sequence[str], only_w: set[str]) -> int:
    """Bytes of the weights of ``only_w`` (`weights_only_w_computes`) that ``nodes`` read and no
    other op does: their gradients come from this stage's ``W`` alone."""
    inside = set(nodes)
    read_here = {name for n in nodes for name in graph.node(n)["params"]}
    read_elsewhere = {name for n in graph.graph.nodes if n not in inside for name in graph.node(n)["params"]}
    return sum(graph.params[name].bytes for name in (read_here & only_w) - read_elsewhere)


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
    check_training(schedule, optimizer, num_microbatches)
    stage_nodes = nodes_by_stage(graph, node_stage, stage_device)
    model = StageMemory(
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
    """A sliced stage's ``(held, backward)`` bytes, the terms `StageMemory` keeps per stage.

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


def nodes_by_stage(graph: CostGraph, node_stage: Mapping[str, int], stage_device: Sequence[int]) -> list[list[str]]:
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
