"""One rank's stages at every token-slice length, and each sequence's keys and values per stage.

A sliced model has one graph per slice length (`hf_ftpipe.graph.token_slices`). Each is matched op
for op to the whole-sequence graph the partition names, so it gets the same stages, and its
stages are built on the same weights. The values a stage hands on are then named as in the whole
graph: the schedule's lowering, the messages and the executor's bookkeeping are those of the
whole graph, only the shapes are the slice's. Each stage's ``scaled_dot_product_attention`` calls
become `PrefixAttention`, pointed at the sequence and offset the executor is running.

Units: the executor keys what it keeps per (micro-batch, slice) by ``m * num_slices + slice``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.alignment import match_ops, op_rows
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.modes import ModeAwareOp
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS, SlicedModel, cut_slices, sequence_inputs
from hf_ftpipe.runtime.prefix_attention import PrefixAttention, SequenceKV, SliceCursor
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, plan_stages

__all__ = ["TokenSlicing", "match_nodes"]


@dataclass
class _Variant:
    """The stages at one slice length, their values named as in the whole graph."""

    graph: CostGraph
    specs: list[StageSpec]
    to_slice: dict[str, str]
    """Whole-graph value → the same value in this graph."""
    modules: dict[int, fx.GraphModule]


class TokenSlicing:
    """What a rank needs to run token slices: the stages per length and the sequences' keys and values.

    Args:
        sliced (`SlicedModel`): the model captured whole and per slice length.
        specs (`list[StageSpec]`): the whole graph's stages.
        node_stage (`Mapping[str, int]`): the partition, on the whole graph.
        modules (`Mapping[int, fx.GraphModule]`): this rank's whole-sequence stages (their weights
            are the ones the slices use).
        device (`torch.device`): where the stages run.
    """

    def __init__(
        self,
        sliced: SlicedModel,
        specs: Sequence[StageSpec],
        node_stage: Mapping[str, int],
        modules: Mapping[int, fx.GraphModule],
        device: torch.device,
    ) -> None:
        self.slice_lengths = tuple(sliced.slice_lengths)
        self.offsets = tuple(itertools.accumulate((0, *self.slice_lengths[:-1])))
        self.num_slices = len(self.slice_lengths)
        self.cursors = {s: SliceCursor() for s in modules}
        self._sequences: dict[tuple[int, int], SequenceKV] = {}
        self._key_padding: dict[int, torch.Tensor] = {}
        self._variants: dict[int, _Variant] = {}
        for length, traced in sliced.by_length.items():
            self._variants[length] = self._variant(sliced, traced, length, specs, node_stage, modules, device)

    # -- per slice ----------------------------------------------------------------------------

    def unit(self, m: int, slice_index: int | None) -> int:
        return m * self.num_slices + (slice_index or 0)

    def spec(self, stage: int, slice_index: int) -> StageSpec:
        return self._variants[self.slice_lengths[slice_index]].specs[stage]

    def module(self, stage: int, slice_index: int) -> fx.GraphModule:
        return self._variants[self.slice_lengths[slice_index]].modules[stage]

    def shape(self, value: str, slice_index: int) -> tuple[int, ...]:
        variant = self._variants[self.slice_lengths[slice_index]]
        return tuple(variant.graph.node(variant.to_slice[value])["output_shapes"][0])

    def split(self, m: int, microbatch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Micro-batch ``m``'s inputs per slice; remembers its padding mask for the keys."""
        inputs = sequence_inputs(microbatch)
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"]
        self._key_padding[m] = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        return cut_slices(inputs, self.slice_lengths)

    # -- keys and values ----------------------------------------------------------------------

    def point(self, stage: int, m: int, slice_index: int) -> None:
        """Aim ``stage``'s attention at sequence ``m``'s keys and values, at slice ``slice_index``."""
        key = (stage, m)
        if key not in self._sequences:
            self._sequences[key] = SequenceKV(self._key_padding[m])
        self.cursors[stage].point(self._sequences[key], self.offsets[slice_index])

    def release(self, stage: int, m: int) -> None:
        """Sequence ``m`` is done on ``stage`` (its first slice's backward, or its last forward in evaluation)."""
        self._sequences.pop((stage, m), None)
        if not any(key[1] == m for key in self._sequences):
            self._key_padding.pop(m, None)

    def reset(self) -> None:
        self._sequences.clear()
        self._key_padding.clear()

    # -- building -----------------------------------------------------------------------------

    def _variant(
        self,
        sliced: SlicedModel,
        traced: Any,
        length: int,
        specs: Sequence[StageSpec],
        node_stage: Mapping[str, int],
        modules: Mapping[int, fx.GraphModule],
        device: torch.device,
    ) -> _Variant:
        whole, graph = sliced.full.cost_graph, traced.cost_graph
        to_whole = match_nodes(whole, graph)
        slice_stage: dict[str, int] = {}
        for name in graph.topological_order():
            if name in to_whole:
                slice_stage[name] = node_stage[to_whole[name]]
            else:  # an op the whole graph has not (a copy its shape needs): with what it reads
                producers = [slice_stage[p] for p in graph.graph.predecessors(name) if p in slice_stage]
                slice_stage[name] = max(producers, default=0)
        slice_specs = plan_stages(graph, slice_stage)
        renamed = [_renamed(spec, to_whole, length) for spec in slice_specs]
        for mine, theirs in zip(renamed, specs, strict=True):
            _check_same_boundary(mine, theirs, length)
        built = {}
        for stage, whole_module in modules.items():
            # the whole stage's weights: loaded there (`weights_path`) and trained there
            tensors = {**traced.tensors, **dict(whole_module.named_parameters()), **dict(whole_module.named_buffers())}
            spec = slice_specs[stage]
            module = build_stage_module(traced.graph_module, spec, traced.canonical_names, tensors, device)
            _use_prefix_attention(module, self.cursors[stage])
            built[stage] = module.to(device)
        to_slice = {whole_name: name for name, whole_name in to_whole.items()}
        return _Variant(graph=graph, specs=renamed, to_slice=to_slice, modules=built)


def match_nodes(whole: CostGraph, part: CostGraph) -> dict[str, str]:
    """Node of ``part`` → the node of ``whole`` that is the same op of the same module, in order.

    Two exports of one model at different lengths run the same ops but for a few shape-dependent
    copies (``contiguous`` of a one-token slice is a no-op the exporter drops), which shift the
    exporter's name counters (`graph.alignment`).
    """
    return match_ops(op_rows(part), op_rows(whole))


def _renamed(spec: StageSpec, to_whole: Mapping[str, str], length: int) -> StageSpec:
    def name(value: str) -> str:
        if value not in to_whole:
            raise PipelineError(
                f"stage {spec.stage_index} hands on {value!r} at slice length {length}, an op the whole-sequence "
                "graph has not; choose other token slice lengths (at least 2 tokens each)"
            )
        return to_whole[value]

    return StageSpec(
        stage_index=spec.stage_index,
        nodes=[to_whole.get(n, n) for n in spec.nodes],
        batch_inputs=list(spec.batch_inputs),
        received=[name(v) for v in spec.received],
        sent=[name(v) for v in spec.sent],
        consumers={name(v): list(c) for v, c in spec.consumers.items()},
        model_outputs={k: name(v) for k, v in spec.model_outputs.items()},
    )


def _check_same_boundary(mine: StageSpec, whole: StageSpec, length: int) -> None:
    same = (
        set(mine.received) == set(whole.received)
        and set(mine.sent) == set(whole.sent)
        and {v: sorted(c) for v, c in mine.consumers.items()} == {v: sorted(c) for v, c in whole.consumers.items()}
        and set(mine.batch_inputs) <= set(whole.batch_inputs) | DERIVED_INPUTS
    )
    if not same:
        raise PipelineError(
            f"stage {whole.stage_index} at slice length {length} reads {sorted(mine.received)} and sends "
            f"{sorted(mine.sent)}, but the whole sequence's reads {sorted(whole.received)} and sends "
            f"{sorted(whole.sent)}; choose other token slice lengths, or report the model class to hf_ftpipe"
        )


def _use_prefix_attention(module: fx.GraphModule, cursor: SliceCursor) -> None:
    """Replace each traced attention call of ``module`` by one over the sequence's earlier slices."""
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        target = module.get_submodule(node.target)
        if isinstance(target, ModeAwareOp) and target.op is torch.ops.aten.scaled_dot_product_attention.default:
            *path, leaf = node.target.split(".")
            parent = module.get_submodule(".".join(path)) if path else module
            traced = node.meta.get("val")
            stride = tuple(traced.stride()) if isinstance(traced, torch.Tensor) else None
            setattr(parent, leaf, PrefixAttention(node.name, cursor, stride))
