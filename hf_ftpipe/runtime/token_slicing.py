"""One rank's stages at every token-slice length, and each sequence's keys and values per stage.

A sliced model has one graph per slice length (`hf_ftpipe.graph.token_slices`). Each is matched op
for op to the whole-sequence graph the partition names, so it gets the same stages, built on the
same weights, its values named as in the whole graph (`hf_ftpipe.runtime.stage_variants`): the
schedule's lowering, the messages and the executor's bookkeeping are those of the whole graph,
only the shapes are the slice's. Each stage's ``scaled_dot_product_attention`` calls
become `PrefixAttention`, pointed at the sequence and offset the executor is running.

Units: the executor keys what it keeps per (micro-batch, slice) by ``m * num_slices + slice``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from hf_ftpipe.graph.modes import ModeAwareOp
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS, SlicedModel, cut_slices, sequence_inputs
from hf_ftpipe.runtime.prefix_attention import PrefixAttention, SequenceKV, SliceCursor
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.stage_variants import StageVariant, build_variant

__all__ = ["TokenSlicing"]


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
        self._variants: dict[int, StageVariant] = {}
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
        return tuple(variant.graph.node(variant.to_variant[value])["output_shapes"][0])

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
    ) -> StageVariant:
        variant = build_variant(
            sliced.full.cost_graph,
            traced,
            specs,
            node_stage,
            modules,
            device,
            where=f"at slice length {length}",
            fix="choose other token slice lengths (at least 2 tokens each), or report the model class to hf_ftpipe",
            extra_inputs=DERIVED_INPUTS,
        )
        for stage, module in variant.modules.items():
            _use_prefix_attention(module, self.cursors[stage])
        return variant


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
