"""T5-3B's units for `wic_bound.py`: half-layers of the encoder, decoder layers, the head, and what
any contiguous run of them costs as one stage.

A unit is a run of the traced graph in execution order: one encoder half-layer (self-attention or
feed-forward; the first also holds the embedding, the last the encoder's final norm), one decoder
layer (the first also holds the decoder's embedding), or the head (final norm, ``lm_head``,
loss): 48 + 24 + 1 = 73. Between two units only hidden states, the encoder's output and the small
position biases and masks cross, so every cut in this space is one the cost model prices cheaply.

The per-stage terms are the rules of `hf_ftpipe.costmodel.memory_rules` (``saved_bytes``,
``operand_bytes``, ``optimizer_state_bytes``, ``backward_bytes``; kept bytes as
``kept_output_bytes`` plus the inputs a stage receives, as `StageMemory` counts them under
recomputation), tabulated per interval so that a search can price millions of plans. They are an
index, not the judge: `check_tables` asserts that they give `estimate`'s bytes exactly on random
plans, and every plan `wic_bound.py` reports is priced by `estimate` itself.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_ftpipe.costmodel.estimate import estimate
from hf_ftpipe.costmodel.memory_rules import backward_bytes, operand_bytes, optimizer_state_bytes, saved_bytes
from hf_ftpipe.costmodel.op_time import node_costs
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.schedules.rules import in_flight, weight_versions

Stage = tuple[int, int, int]
"""``(first unit, last unit, GPU)``: a stage is a contiguous run of units on one GPU."""

_ENCODER = re.compile(r"encoder\.block\.(\d+)\.layer\.(\d+)")
_DECODER = re.compile(r"decoder\.block\.(\d+)")


def unit_of_scope(scope: str) -> str | None:
    """The unit a node whose module path is ``scope`` starts, or None when it joins the current one."""
    if m := _ENCODER.match(scope):
        return f"enc{m.group(1)}.{'attn' if m.group(2) == '0' else 'ff'}"
    if scope.startswith("decoder.embed_tokens"):
        return "dec0"
    if (m := _DECODER.match(scope)) and m.group(1) != "0":
        return f"dec{m.group(1)}"
    if scope.startswith("decoder.final_layer_norm"):
        return "head"
    return None


@dataclass
class UnitTables:
    """Per unit (lists) and per interval of units (``kept``) what the memory rules and the
    roofline say, for a plan request's schedule options (async, recomputation)."""

    graph: CostGraph
    names: list[str]
    nodes: list[list[str]]
    compute: list[float]
    """Forward + backward (+ the recomputed forward) per micro-batch, in units of the ideal."""
    weights: list[int]
    optimizer: list[int]
    saved: list[int]
    gradients: list[int]
    operand: list[int]
    shared: list[bool]
    """Whether the unit reads a weight other units read too (T5's tied embedding)."""
    kept: list[list[int]]
    """``kept[a][b]``: bytes a stage of units a..b keeps per micro-batch in flight."""
    shared_bytes: int
    shared_optimizer: int
    ideal_s: float

    @property
    def num_units(self) -> int:
        return len(self.names)

    def node_stage(self, stages: Sequence[Stage]) -> dict[str, int]:
        return {n: s for s, (a, b, _) in enumerate(stages) for u in range(a, b + 1) for n in self.nodes[u]}

    def gpu_memory(self, stages: Sequence[Stage], schedule: str, num_microbatches: int) -> list[int]:
        """Bytes each GPU needs: `StageMemory.of_gpu`'s terms, summed from the tables."""
        stage_device = [d for _, _, d in stages]
        num_gpus = max(stage_device) + 1
        held, backward, shared_versions = [0] * num_gpus, [0] * num_gpus, [0] * num_gpus
        for s, (a, b, d) in enumerate(stages):
            versions = weight_versions(schedule, s, stage_device, num_microbatches=num_microbatches)
            count = in_flight(schedule, s, stage_device, num_microbatches)
            units = range(a, b + 1)
            shared = any(self.shared[u] for u in units)
            held[d] += sum(self.weights[u] for u in units) * versions + self.kept[a][b] * count
            held[d] += sum(self.optimizer[u] for u in units)
            if shared:
                shared_versions[d] = max(shared_versions[d], versions)
            saved = sum(self.saved[u] for u in units)
            grads = sum(self.gradients[u] for u in units) + (self.shared_bytes if shared else 0)
            largest = max(self.operand[u] for u in units)
            stage_backward = backward_bytes(
                persist=False, largest_operand=largest, gradients=grads, saved=saved, recomputed=saved
            )
            backward[d] = max(backward[d], stage_backward)
        shared_total = [v * self.shared_bytes + self.shared_optimizer if v else 0 for v in shared_versions]
        return [h + b + s for h, b, s in zip(held, backward, shared_total, strict=True)]

    def gpu_compute(self, stages: Sequence[Stage]) -> list[float]:
        """Each GPU's compute per micro-batch, in units of the ideal."""
        loads = [0.0] * (max(d for _, _, d in stages) + 1)
        for a, b, d in stages:
            loads[d] += math.fsum(self.compute[a : b + 1])
        return loads


def unit_tables(graph: CostGraph, profile: Any, optimizer: str, num_gpus: int) -> UnitTables:
    """The tables for ``graph`` (T5 traced as `hf_ftpipe.graph` traces it), recomputation on."""
    order = graph.topological_order()
    names, nodes = ["enc0.attn"], [[]]
    for n in order:
        name = unit_of_scope(graph.node(n)["scope"])
        if name is not None and name != names[-1] and nodes[-1]:
            names.append(name)
            nodes.append([])
        nodes[-1].append(n)
    unit = {n: u for u, members in enumerate(nodes) for n in members}
    costs = node_costs(graph, profile)
    total = math.fsum(c.total_s + c.forward_s for c in costs.values())  # recomputation runs the forward twice
    ideal_s = total / num_gpus
    shared = {p for p, count in _param_counts(graph, nodes).items() if count > 1}
    tables = UnitTables(
        graph=graph,
        names=names,
        nodes=nodes,
        compute=[math.fsum(costs[n].total_s + costs[n].forward_s for n in members) / ideal_s for members in nodes],
        weights=[],
        optimizer=[],
        saved=[sum(saved_bytes(graph, n) for n in members) for members in nodes],
        gradients=[],
        operand=[max((operand_bytes(graph, n) for n in members), default=0) for members in nodes],
        shared=[bool(graph.params_of(members) & shared) for members in nodes],
        kept=_kept_bytes(graph, order, unit, len(nodes)),
        shared_bytes=sum(graph.params[p].bytes for p in shared),
        shared_optimizer=sum(_optimizer(graph, p, optimizer) for p in shared),
        ideal_s=ideal_s,
    )
    for members in nodes:
        own = graph.params_of(members) - shared
        tables.weights.append(sum(graph.params[p].bytes for p in own))
        tables.optimizer.append(sum(_optimizer(graph, p, optimizer) for p in own))
        tables.gradients.append(sum(graph.params[p].bytes for p in own if graph.params[p].requires_grad))
    return tables


def _optimizer(graph: CostGraph, name: str, optimizer: str) -> int:
    info = graph.params[name]
    return optimizer_state_bytes(optimizer, info.shape, info.bytes) if info.requires_grad else 0


def _param_counts(graph: CostGraph, nodes: list[list[str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for members in nodes:
        for p in graph.params_of(members):
            counts[p] = counts.get(p, 0) + 1
    return counts


def _kept_bytes(graph: CostGraph, order: list[str], unit: dict[str, int], num_units: int) -> list[list[int]]:
    """``kept[a][b]``: what leaves a stage of units a..b (read by a later unit or a model output)
    plus what it receives from earlier units, each value once."""
    kept = [[0] * num_units for _ in range(num_units)]
    outputs = set(graph.outputs)
    for n in order:
        u, size = unit[n], graph.node(n)["output_bytes"]
        readers = sorted({unit[v] for v in graph.graph.successors(n)})
        last = num_units if n in outputs else max(readers, default=u)
        for a in range(u + 1):
            for b in range(u, min(last, num_units)):  # the stage ends before the last reader
                kept[a][b] += size
        for a in range(u + 1, num_units):  # an input of stages starting after u that reach a reader
            first = next((r for r in readers if r >= a), None)
            if first is not None:
                for b in range(first, num_units):
                    kept[a][b] += size
    return kept


def check_tables(tables: UnitTables, profile: Any, options: dict[str, Any], *, trials: int, seed: int = 0) -> float:
    """Assert that the tables give `estimate`'s bytes on ``trials`` random plans (8 to 30 stages,
    any placement); return the largest compute difference (in units of the ideal) and comm excess."""
    rng = random.Random(seed)
    n, worst = tables.num_units, 0.0
    for _ in range(trials):
        k = rng.randint(8, 30)
        edges = [0, *sorted(rng.sample(range(1, n), k - 1)), n]
        devices = list(range(8)) + [rng.randrange(8) for _ in range(k - 8)]
        rng.shuffle(devices)
        stages = [(edges[i], edges[i + 1] - 1, devices[i]) for i in range(k)]
        predicted = estimate(tables.graph, tables.node_stage(stages), devices, profile, **options)
        memory = tables.gpu_memory(stages, options["schedule"], options["num_microbatches"])
        compute = tables.gpu_compute(stages)
        for d, gpu in enumerate(predicted.gpus):
            if gpu.memory_bytes != memory[d]:
                raise AssertionError(f"GPU {d} of {stages}: estimate {gpu.memory_bytes} B, tables {memory[d]} B")
            ideal = predicted.ideal_step_time_s
            worst = max(worst, abs(gpu.compute_s / ideal - compute[d]), (gpu.cost_s - gpu.compute_s) / ideal)
    return worst
