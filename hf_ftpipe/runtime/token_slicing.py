"""One rank's stages for token slices, each step's slicing, and each sequence's keys and values per stage.

A sliced model captured with a symbolic sequence length (`hf_ftpipe.graph.token_slices`) runs
every slice on the whole graph's own stages, rebuilt on the same weights with each
``scaled_dot_product_attention`` call made `PrefixAttention`, pointed at the sequence and offset
the executor is running; a slice's shapes and sizes come from the graph's shape formulas like a
micro-batch's (`hf_ftpipe.runtime.shapes`). A model captured with fixed shapes has one graph per
slice length instead, each matched op for op to the whole-sequence graph the partition names
(`hf_ftpipe.runtime.stage_variants`), so it gets the same stages on the same weights, its values
named as in the whole graph.

Each training step cuts its sequences by ``SlicedModel.slices_for`` of the step's length
(`begin_step`): the number of slices k may differ from step to step. Units: the executor keys what
it keeps per (micro-batch, slice) by ``m * k + slice`` with the step's k; a flushing step ends
with every unit finished, so no key outlives its step.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.modes import ModeAwareOp
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS, SlicedModel, cut_slices, sequence_inputs
from hf_ftpipe.runtime.prefix_attention import PrefixAttention, SequenceKV, SliceCursor
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module
from hf_ftpipe.runtime.stage_variants import StageVariant, build_variant

__all__ = ["TokenSlicing", "traced_memory_order", "use_prefix_attention"]


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
        self.full = sliced.full
        """The whole-sequence capture: its shape formulas give a slice's shapes when it is dynamic."""
        self.slice_lengths: tuple[int, ...] = ()
        self.offsets: tuple[int, ...] = ()
        self.num_slices = 0
        self.cursors = {s: SliceCursor() for s in modules}
        self._sequences: dict[tuple[int, int], SequenceKV] = {}
        self._key_padding: dict[int, torch.Tensor] = {}
        self._dynamic: StageVariant | None = None
        """The whole graph's stages with prefix attention: every slice length, if the graph is dynamic."""
        self._variants: dict[int, StageVariant] = {}
        if sliced.dynamic:
            self._dynamic = self._whole_variant(sliced, specs, modules, device)
        fix = "choose other token slice lengths (at least 2 tokens each), or report the model class to hf_ftpipe"
        for length, traced in sliced.by_length.items():  # a fixed-shape capture per slice length
            variant = build_variant(
                sliced.full.cost_graph,
                traced,
                specs,
                node_stage,
                modules,
                device,
                where=f"at slice length {length}",
                fix=fix,
                extra_inputs=DERIVED_INPUTS,
            )
            for stage, module in variant.modules.items():
                use_prefix_attention(module, self.cursors[stage])
            self._variants[length] = variant
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

    def begin_batches(self, microbatches: Sequence[Mapping[str, Any]]) -> int:
        """`begin_step` at the length of a training step's sequences, which must share it."""
        lengths = sorted({int(torch.as_tensor(mb["input_ids"]).shape[1]) for mb in microbatches})
        if len(lengths) > 1:  # one flush cuts every sequence alike: only gradient accumulation mixes lengths
            raise PipelineError(
                f"token slicing cuts every sequence of a step alike, but this step's batches have {lengths} "
                "tokens (gradient accumulation over batches padded apart); pad the batches of an accumulation "
                "window to one length (padding='max_length'), or set gradient_accumulation_steps=1"
            )
        return self.begin_step(lengths[0])

    # -- per slice (`hf_ftpipe.runtime.slicing.Slicing`; ``slice_index`` None: a whole sequence) ----

    def unit(self, m: int, slice_index: int | None) -> int:
        return m if slice_index is None else m * self.num_slices + slice_index

    def variant(self, slice_index: int | None) -> StageVariant | None:
        return None if slice_index is None else self._variant_of(slice_index)

    def _variant_of(self, slice_index: int) -> StageVariant:
        return self._dynamic or self._variants[self.slice_lengths[slice_index]]

    def spec(self, stage: int, slice_index: int) -> StageSpec:
        return self._variant_of(slice_index).specs[stage]

    def module(self, stage: int, slice_index: int) -> fx.GraphModule:
        return self._variant_of(slice_index).modules[stage]

    def shape(self, value: str, slice_index: int) -> tuple[int, ...]:
        """A fixed-shape capture's shape of ``value`` at slice ``slice_index`` (`shapes` in general)."""
        variant = self._variant_of(slice_index)
        return tuple(variant.graph.node(variant.to_variant[value])["output_shapes"][0])

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

    def evaluation_inputs(self, microbatch: dict[str, Any]) -> dict[str, Any]:
        """An evaluation runs whole sequences: no backward, so no bubble to fill."""
        return sequence_inputs(microbatch)

    def point(self, stage: int, m: int, slice_index: int | None) -> None:
        """Aim ``stage``'s attention at sequence ``m``'s keys and values, at slice ``slice_index``."""
        if slice_index is None:  # a whole sequence: its stages attend within it
            return
        key = (stage, m)
        if key not in self._sequences:
            self._sequences[key] = SequenceKV(self._key_padding[m])
        self.cursors[stage].point(self._sequences[key], self.offsets[slice_index])

    def forward_done(self, stage: int, m: int, slice_index: int | None, training: bool) -> None:
        if not training and slice_index == self.num_slices - 1:
            self.release(stage, m)

    def backward_done(self, stage: int, m: int, slice_index: int | None) -> None:
        if slice_index == 0:  # the backward runs the slices last to first: the sequence is done here
            self.release(stage, m)

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
    ) -> StageVariant:
        """The whole graph's own stages, rebuilt on the same weights with prefix attention."""
        whole = sliced.full
        built = {}
        for stage, whole_module in modules.items():
            tensors = {**whole.tensors, **dict(whole_module.named_parameters()), **dict(whole_module.named_buffers())}
            module = build_stage_module(whole.graph_module, specs[stage], whole.canonical_names, tensors, device)
            use_prefix_attention(module, self.cursors[stage])
            built[stage] = module.to(device)
        names = {name: name for name in whole.cost_graph.graph.nodes}
        return StageVariant(traced=whole, specs=list(specs), to_variant=names, modules=built)


def use_prefix_attention(module: fx.GraphModule, cursor: SliceCursor) -> None:
    """Replace each traced attention call of ``module`` by one over the sequence's earlier slices."""
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        target = module.get_submodule(node.target)
        if isinstance(target, ModeAwareOp) and target.op is torch.ops.aten.scaled_dot_product_attention.default:
            *path, leaf = node.target.split(".")
            parent = module.get_submodule(".".join(path)) if path else module
            traced = node.meta.get("val")
            layout = traced_memory_order(traced) if isinstance(traced, torch.Tensor) else None
            setattr(parent, leaf, PrefixAttention(node.name, cursor, layout))


def traced_memory_order(traced: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``traced`` from outermost to innermost in memory (its strides may be
    symbolic: ordered by their values at the export's sample sizes, all at least 2)."""
    strides = [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in traced.stride()]
    return tuple(sorted(range(len(strides)), key=lambda dim: -strides[dim]))
