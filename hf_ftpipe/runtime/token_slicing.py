"""One rank's stages for token slices, each step's slicing, and each sequence's keys and values per stage.

A sliced model captured with a symbolic sequence length (`hf_ftpipe.graph.token_slices`) runs
every slice on the whole graph's own stages, rebuilt on the same weights with each
``scaled_dot_product_attention`` call made `PrefixAttention`, pointed at the sequence and offset
the executor is running; a slice's shapes and sizes come from the graph's shape formulas like a
micro-batch's (`hf_ftpipe.runtime.shapes`). A model captured with fixed shapes has one graph per
slice length instead; each is matched op for op to the whole-sequence graph the partition names, so
it gets the same stages, and the values a stage hands on are named as in the whole graph.

Each training step cuts its sequences by ``SlicedModel.slices_for`` of the step's length
(`begin_step`): the number of slices k may differ from step to step. Units: the executor keys what
it keeps per (micro-batch, slice) by ``m * k + slice`` with the step's k; a flushing step ends
with every unit finished, so no key outlives its step.
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
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
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
        self.slices_for = sliced.slices_for
        self.slice_lengths: tuple[int, ...] = ()
        self.offsets: tuple[int, ...] = ()
        self.num_slices = 0
        self.cursors = {s: SliceCursor() for s in modules}
        self._sequences: dict[tuple[int, int], SequenceKV] = {}
        self._key_padding: dict[int, torch.Tensor] = {}
        self._dynamic: _Variant | None = None
        """The whole graph's stages with prefix attention: every slice length, if the graph is dynamic."""
        self._variants: dict[int, _Variant] = {}
        if sliced.dynamic:
            self._dynamic = self._whole_variant(sliced, specs, modules, device)
        for length, traced in sliced.by_length.items():
            self._variants[length] = self._variant(sliced, traced, length, specs, node_stage, modules, device)
        self.begin_step(sliced.seq_len)

    @property
    def dynamic(self) -> bool:
        """Whether one graph runs every slice length (else one fixed-shape graph per length)."""
        return self._dynamic is not None

    # -- per step -----------------------------------------------------------------------------

    def begin_step(self, seq_len: int) -> int:
        """Cut this step's sequences of ``seq_len`` tokens by ``slices_for``; returns how many slices.

        Raises:
            `PipelineError`: the slicing's lengths do not add up to ``seq_len``, or a fixed-shape
                capture has no graph for one of them.
        """
        lengths = tuple(int(length) for length in self.slices_for(seq_len))
        if sum(lengths) != seq_len or not lengths or min(lengths) < 1:
            raise PipelineError(f"token slices {list(lengths)} for sequences of {seq_len} tokens do not add up to them")
        if self._dynamic is None and not set(lengths) <= set(self._variants):
            raise PipelineError(
                f"the model was captured with fixed shapes for token slices {sorted(self._variants)}, so sequences "
                f"of {seq_len} tokens cannot be cut into {list(lengths)}; pad every batch to one length"
            )
        self.slice_lengths = lengths
        self.offsets = tuple(itertools.accumulate((0, *lengths[:-1])))
        self.num_slices = len(lengths)
        return self.num_slices

    # -- per slice ----------------------------------------------------------------------------

    def unit(self, m: int, slice_index: int | None) -> int:
        return m * self.num_slices + (slice_index or 0)

    def _variant_of(self, slice_index: int) -> _Variant:
        return self._dynamic or self._variants[self.slice_lengths[slice_index]]

    def spec(self, stage: int, slice_index: int) -> StageSpec:
        return self._variant_of(slice_index).specs[stage]

    def module(self, stage: int, slice_index: int) -> fx.GraphModule:
        return self._variant_of(slice_index).modules[stage]

    def shape(self, value: str, slice_index: int) -> tuple[int, ...]:
        """A fixed-shape capture's shape of ``value`` at slice ``slice_index`` (`shapes` in general)."""
        variant = self._variant_of(slice_index)
        return tuple(variant.graph.node(variant.to_slice[value])["output_shapes"][0])

    def shapes(self, slice_index: int, piece: Mapping[str, Any], book: ShapeBook) -> MicrobatchShapes:
        """The shapes slice ``slice_index`` (inputs ``piece``) sends and the sizes its stages read:
        the whole graph's formulas at the slice's shape, or a fixed-shape capture's own shapes."""
        if self._dynamic is not None:
            return book.of(piece)
        return MicrobatchShapes(values={v: self.shape(v, slice_index) for v in book.values}, sizes={})

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

    def _whole_variant(
        self,
        sliced: SlicedModel,
        specs: Sequence[StageSpec],
        modules: Mapping[int, fx.GraphModule],
        device: torch.device,
    ) -> _Variant:
        """The whole graph's own stages, rebuilt on the same weights with prefix attention."""
        whole = sliced.full
        built = {}
        for stage, whole_module in modules.items():
            tensors = {**whole.tensors, **dict(whole_module.named_parameters()), **dict(whole_module.named_buffers())}
            module = build_stage_module(whole.graph_module, specs[stage], whole.canonical_names, tensors, device)
            _use_prefix_attention(module, self.cursors[stage])
            built[stage] = module.to(device)
        names = {name: name for name in whole.cost_graph.graph.nodes}
        return _Variant(graph=whole.cost_graph, specs=list(specs), to_slice=names, modules=built)

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
            layout = _traced_memory_order(traced) if isinstance(traced, torch.Tensor) else None
            setattr(parent, leaf, PrefixAttention(node.name, cursor, layout))


def _traced_memory_order(traced: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``traced`` from outermost to innermost in memory (its strides may be
    symbolic: ordered by their values at the export's sample sizes, all at least 2)."""
    strides = [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in traced.stride()]
    return tuple(sorted(range(len(strides)), key=lambda dim: -strides[dim]))
