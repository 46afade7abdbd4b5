"""A second capture of the model run as the planned pipeline: its ops on their counterparts' stages.

Token slices (`hf_ftpipe.runtime.token_slicing`) and batches of a shape the planned graph cannot
take (`hf_ftpipe.runtime.per_shape`) run on graphs captured at other shapes. Each such graph is
matched op by op to the planned one (`hf_ftpipe.graph.alignment`), so each op goes to the stage
its counterpart has (an op without one, a copy its shape needs, goes with its producers, or with
no producer before its first consumer), and its stages are built on the weights the planned
stages hold. The values a stage hands on are then named as in the planned graph: the schedule's
lowering, the messages and the executor's bookkeeping are the planned graph's, only the shapes
differ. A graph whose stages would hand on other values than the planned ones is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.alignment import match_ops, op_rows
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, loss_reads_of, plan_stages

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["StageVariant", "build_variant", "match_nodes"]


@dataclass
class StageVariant:
    """One rank's stages on another capture of the model, their values named as in the planned graph."""

    traced: TracedModel
    specs: list[StageSpec]
    """Every stage's data flow, named as in the planned graph (size inputs keep this graph's names)."""
    to_variant: dict[str, str]
    """Planned-graph value → the same value in this graph."""
    modules: dict[int, fx.GraphModule]
    """This rank's stages, on the planned stages' weights."""

    @property
    def graph(self) -> CostGraph:
        return self.traced.cost_graph

    def train(self, mode: bool) -> None:
        """Dropout on or off, as the planned stages (the modules are not theirs to switch)."""
        for module in self.modules.values():
            if module.training != mode:
                module.train(mode)


def match_nodes(whole: CostGraph, part: CostGraph) -> dict[str, str]:
    """Node of ``part`` → the node of ``whole`` that is the same op of the same module, in order.

    Two exports of one model at different lengths run the same ops but for a few shape-dependent
    copies (``contiguous`` of a one-token slice is a no-op the exporter drops), which shift the
    exporter's name counters (`graph.alignment`).
    """
    return match_ops(op_rows(part), op_rows(whole))


def build_variant(
    planned: CostGraph,
    traced: TracedModel,
    specs: Sequence[StageSpec],
    node_stage: Mapping[str, int],
    modules: Mapping[int, fx.GraphModule],
    device: torch.device,
    *,
    where: str,
    fix: str,
    extra_inputs: Collection[str] = (),
) -> StageVariant:
    """``traced`` as the planned pipeline: ``specs`` and ``node_stage`` are the planned graph's
    stages and partition, ``modules`` this rank's planned stages (their weights are the ones used).

    ``where`` says which capture this is in errors (``"at slice length 4"``), ``fix`` what to do;
    a stage may read the batch inputs its planned stage reads and ``extra_inputs``.

    Raises:
        `PipelineError`: a stage would hand on a value the planned graph has not, or other values than
            its planned stage, or read weights its planned stage does not hold.
    """
    graph = traced.cost_graph
    to_planned = match_nodes(planned, graph)
    stage_of = _stages(graph, to_planned, node_stage)
    variant_specs = plan_stages(graph, stage_of, loss_reads_of(planned, specs))
    renamed = [_renamed(spec, to_planned, where, fix) for spec in variant_specs]
    for mine, theirs in zip(renamed, specs, strict=True):
        _check_same_boundary(mine, theirs, where, fix, extra_inputs)
    built = {}
    for stage, planned_module in modules.items():
        own = {**dict(planned_module.named_parameters()), **dict(planned_module.named_buffers())}
        module = build_stage_module(
            traced.graph_module, variant_specs[stage], traced.canonical_names, {**traced.tensors, **own}, device
        )
        foreign = sorted(name for name, _ in module.named_parameters() if name not in own)
        if foreign:
            raise PipelineError(
                f"stage {stage} {where} reads weights {foreign[:3]} that its planned stage does not hold; {fix}"
            )
        built[stage] = module.to(device)
    to_variant = {planned_name: name for name, planned_name in to_planned.items()}
    return StageVariant(traced=traced, specs=renamed, to_variant=to_variant, modules=built)


def _stages(graph: CostGraph, to_planned: Mapping[str, str], node_stage: Mapping[str, int]) -> dict[str, int]:
    """Each op's stage: its counterpart's; else its producers' latest, or before its first consumer."""
    order = graph.topological_order()
    stage: dict[str, int | None] = {}
    for name in order:
        if name in to_planned:
            stage[name] = node_stage[to_planned[name]]
        else:  # an op the planned graph has not (a copy its shape needs): with what it reads
            producers = [stage[p] for p in graph.graph.predecessors(name) if stage.get(p) is not None]
            stage[name] = max(producers, default=None)  # type: ignore[type-var]
    for name in reversed(order):
        if stage[name] is None:
            consumers = [stage[c] for c in graph.graph.successors(name) if stage[c] is not None]
            stage[name] = min(consumers, default=0)  # type: ignore[type-var]
    return stage  # type: ignore[return-value]


def _renamed(spec: StageSpec, to_planned: Mapping[str, str], where: str, fix: str) -> StageSpec:
    def name(value: str) -> str:
        if value not in to_planned:
            raise PipelineError(
                f"stage {spec.stage_index} {where} hands on {value!r}, an op the planned graph has not; {fix}"
            )
        return to_planned[value]

    return StageSpec(
        stage_index=spec.stage_index,
        nodes=[to_planned.get(n, n) for n in spec.nodes],
        batch_inputs=list(spec.batch_inputs),
        received=[name(v) for v in spec.received],
        sent=[name(v) for v in spec.sent],
        consumers={name(v): list(c) for v, c in spec.consumers.items()},
        model_outputs={k: name(v) for k, v in spec.model_outputs.items()},
        size_inputs=list(spec.size_inputs),
    )


def _check_same_boundary(mine: StageSpec, planned: StageSpec, where: str, fix: str, extra: Collection[str]) -> None:
    same = (
        set(mine.received) == set(planned.received)
        and set(mine.sent) == set(planned.sent)
        and {v: sorted(c) for v, c in mine.consumers.items()} == {v: sorted(c) for v, c in planned.consumers.items()}
        and set(mine.batch_inputs) <= set(planned.batch_inputs) | set(extra)
    )
    if not same:
        raise PipelineError(
            f"stage {planned.stage_index} {where} reads {sorted(mine.received)} and sends {sorted(mine.sent)}, but "
            f"the planned graph's reads {sorted(planned.received)} and sends {sorted(planned.sent)}; {fix}"
        )
