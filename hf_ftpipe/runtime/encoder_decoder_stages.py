"""A T5-family encoder-decoder's pipeline stages for decoding with a key/value cache kept per stage.

The planned graph itself serves: it takes the encoder's and the decoder's inputs with symbolic
lengths (`hf_ftpipe.graph.dynamic_shapes`), so this rank's planned stages are rebuilt on the same
weights with each ``scaled_dot_product_attention`` call classified by the module it came from:

- the encoder's self-attention is left as is: the first call (prefill) runs the real encoder input,
  later calls a one-token stand-in whose result nothing reads, so the encoder costs one token;
- the decoder's self-attention (`CachedSelfAttention`) appends each call's new keys and values to
  the stage's buffers (`SequenceKV`) and attends over them with T5's relative position bias of the
  new tokens' positions, read from decoder block 0's trained weight once per generation
  (`relative_position_bias`): the graph's own mask, made for a sequence without a prefix, holds only
  the bias among the new tokens;
- the decoder's cross-attention (`CachedCrossAttention`) keeps the keys, values and padding mask
  of the encoder's output at the first call and attends over them at every later one (the ones the
  stand-in makes are not read).

A graph traced on ``labels`` alone makes the decoder's inputs by shifting them right behind the
decoder start token, so a later call feeds the labels ``[token, pad]``: the decoder runs ``[start,
token]``, its first row a filler whose keys and values are not kept (`DecoderCursor.filler`) and
whose logits are not read. A graph traced on ``decoder_input_ids`` takes the new token alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.modes import ModeAwareOp
from hf_ftpipe.runtime.decoding_stages import NO_CACHE, once_per_engine
from hf_ftpipe.runtime.prefix_attention import SliceCursor, laid_out
from hf_ftpipe.runtime.shapes import ShapeBook
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.token_slicing import traced_memory_order

if TYPE_CHECKING:
    from hf_ftpipe.runtime.engine import PipelineEngine

__all__ = [
    "CachedCrossAttention",
    "CachedSelfAttention",
    "DECODER_INPUTS",
    "CrossKV",
    "DecoderCursor",
    "EncoderDecoderStages",
    "encoder_decoder_stages",
    "relative_position_bias",
]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ENCODER_INPUTS = ("input_ids", "attention_mask")
DECODER_INPUTS = ("labels", "decoder_input_ids", "decoder_attention_mask")
"""An encoder-decoder's inputs that feed its decoder (or its loss): the rest feed the encoder."""


@dataclass
class CrossKV:
    """One micro-batch's cross-attention keys, values and encoder padding mask on one stage, per layer."""

    keys: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor | None] = field(default_factory=dict)


class DecoderCursor(SliceCursor):
    """A stage's attention layers' state in a decoding call: the decoder's kept keys and values and
    offset (`SliceCursor`), the encoder's kept ones, the position bias, and how many leading query
    rows are fillers (the start token a graph traced on labels runs before the new one)."""

    def __init__(self) -> None:
        super().__init__()
        self.cross: CrossKV | None = None
        self.bias: torch.Tensor | None = None
        """``(1, heads, max_length, max_length)``: T5's relative position bias, the lower-bound float
        above the diagonal (causal)."""
        self.filler = 0


class CachedSelfAttention(nn.Module):
    """Stands for a decoder self-attention call: keeps the new tokens' keys and values, attends over all."""

    def __init__(self, layer: str, cursor: DecoderCursor, layout: tuple[int, ...] | None) -> None:
        super().__init__()
        self.layer, self.cursor, self.layout = layer, cursor, layout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cursor = self.cursor
        sequence, offset, filler, bias = cursor.sequence, cursor.offset, cursor.filler, cursor.bias
        if sequence is None or bias is None:
            raise RuntimeError("a cached decoder stage ran outside a decoding call (no keys and values pointed at)")
        sequence.write(self.layer, offset, key[..., filler:, :], value[..., filler:, :])
        end = offset + key.shape[-2] - filler
        first = offset - filler  # a filler row sits before the new token; its output is not read
        mask = bias[:, :, first:end, :end].to(query.dtype)
        keys, values = sequence.keys[self.layer][..., :end, :], sequence.values[self.layer][..., :end, :]
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=kwargs.get("scale"))
        return laid_out(output, self.layout)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}"


class CachedCrossAttention(nn.Module):
    """Stands for a decoder cross-attention call: the encoder's keys, values and mask kept at the first call."""

    def __init__(self, layer: str, cursor: DecoderCursor, layout: tuple[int, ...] | None) -> None:
        super().__init__()
        self.layer, self.cursor, self.layout = layer, cursor, layout

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, *args: Any, **kw: Any
    ) -> Any:
        cross = self.cursor.cross
        if cross is None:
            raise RuntimeError("a cached decoder stage ran outside a decoding call (no encoder keys pointed at)")
        rows = query.shape[0]
        if self.cursor.offset == 0:  # the real encoder's output: every query row's mask is the encoder padding's
            cross.keys[self.layer], cross.values[self.layer] = key.detach(), value.detach()
            mask = attn_mask[..., -1:, :].expand(rows, -1, -1, -1) if isinstance(attn_mask, torch.Tensor) else None
            cross.masks[self.layer] = None if mask is None else mask.contiguous()
        keys, values, mask = cross.keys[self.layer], cross.values[self.layer], cross.masks[self.layer]
        if mask is not None:
            mask = mask.expand(-1, -1, query.shape[-2], -1)
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=kw.get("scale"))
        return laid_out(output, self.layout)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}"


@dataclass
class EncoderDecoderStages:
    """This rank's stages for an encoder-decoder's decoding calls, and what a call needs to know to run them."""

    specs: list[StageSpec]
    modules: dict[int, fx.GraphModule]
    """The planned stages rebuilt on their weights, their attention calls cached (see the module docstring)."""
    cursors: dict[int, DecoderCursor]
    book: ShapeBook
    logits: str
    bias_weight: str
    """Canonical name of decoder block 0's relative attention bias (``(buckets, heads)``)."""
    labels_only: bool
    """The graph makes the decoder's inputs from ``labels`` (it takes no ``decoder_input_ids``)."""
    to_variant: dict[str, str]
    """The values crossing ranks, named as themselves: these are the planned graph's own stages."""


def encoder_decoder_stages(engine: PipelineEngine, model: nn.Module) -> EncoderDecoderStages:
    """This rank's stages for decoding ``model`` (a T5-family model), built once per engine.

    Raises:
        `PipelineError`: the model cannot be cached (`check_cacheable`), its graph fixes the encoder's or
            the decoder's length, takes inputs a decoding call cannot make, or has no decoder block 0
            relative position bias.
    """
    return once_per_engine(engine, model, lambda: _build(engine, model))


def _build(engine: PipelineEngine, model: nn.Module) -> EncoderDecoderStages:
    name, inputs = type(model).__name__, engine.graph.inputs
    if "logits" not in engine.model_outputs.outputs:
        raise PipelineError(f"{name}'s graph returns no `logits` to decode from; {NO_CACHE}")
    decoder_input = "decoder_input_ids" if "decoder_input_ids" in inputs else "labels"
    if "input_ids" not in inputs or decoder_input not in inputs:
        raise PipelineError(f"{name}'s graph takes {sorted(inputs)}, without `input_ids` and `labels`; {NO_CACHE}")
    tensors = {input_name for input_name, info in inputs.items() if info.shape is not None}
    unknown = sorted(tensors - {*_ENCODER_INPUTS, *DECODER_INPUTS})
    if unknown:
        raise PipelineError(f"{name}'s graph takes {unknown}, which a cached decoding call cannot make; {NO_CACHE}")
    for input_name in ("input_ids", decoder_input):
        if 1 not in engine.formulas.varying(input_name):
            raise PipelineError(
                f"{name}'s graph fixes the length of `{input_name}`, so a one-token call cannot run on it; {NO_CACHE}"
            )
    bias_weight = _decoder_bias_name(model)
    if bias_weight not in engine.graph.params:
        raise PipelineError(f"{name}'s graph holds no {bias_weight!r} (the decoder's position bias); {NO_CACHE}")
    cursors = {stage: DecoderCursor() for stage in engine.modules}
    modules = {stage: _cached_copy(module, cursors[stage]) for stage, module in engine.modules.items()}
    logits = engine.model_outputs.outputs["logits"].value
    sizes = [size for stage in engine.modules for size in engine.specs[stage].size_inputs]
    book = ShapeBook(engine.formulas, engine.graph, [*engine.transfers, logits], sizes)
    return EncoderDecoderStages(
        specs=list(engine.specs),
        modules=modules,
        cursors=cursors,
        book=book,
        logits=logits,
        bias_weight=bias_weight,
        labels_only=decoder_input == "labels",
        to_variant={value: value for value in [*engine.transfers, logits]},
    )


def _decoder_bias_name(model: nn.Module) -> str:
    """The canonical name of the decoder's relative attention bias (its first block's self-attention)."""
    try:
        attention = model.get_decoder().block[0].layer[0].SelfAttention
        weight = attention.relative_attention_bias.weight
    except (AttributeError, IndexError) as error:
        raise PipelineError(
            f"{type(model).__name__} has no relative attention bias in its decoder's first block, which the "
            f"pipeline's cache applies for a T5-family model; {NO_CACHE}"
        ) from error
    return next(name for name, param in model.named_parameters(remove_duplicate=False) if param is weight)


def _cached_copy(planned: fx.GraphModule, cursor: DecoderCursor) -> fx.GraphModule:
    """``planned`` on the same weights, its attention calls cached and its mode-aware ops in eval mode
    (copies: the planned stage's own stay as training set them)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(planned.graph, {}))
    module = fx.GraphModule(planned, graph)
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        target = module.get_submodule(node.target)
        if not isinstance(target, ModeAwareOp):
            continue
        *path, leaf = node.target.split(".")
        parent = module.get_submodule(".".join(path)) if path else module
        replacement: nn.Module = copy.copy(target)
        if target.op is _SDPA:
            kind = _attention_kind(node)
            traced = node.meta.get("val")
            layout = traced_memory_order(traced) if isinstance(traced, torch.Tensor) else None
            if kind == "decoder":
                replacement = CachedSelfAttention(node.name, cursor, layout)
            elif kind == "cross":
                replacement = CachedCrossAttention(node.name, cursor, layout)
        replacement.training = False
        setattr(parent, leaf, replacement)
    return module


def _attention_kind(node: fx.Node) -> str:
    """``"encoder"``, ``"decoder"`` (self-attention) or ``"cross"``, by the module the call was traced in."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        raise PipelineError(f"the graph does not say which module attention call {node.name!r} is in; {NO_CACHE}")
    path = str(list(stack.values())[-1][0]).split(".")
    if path[-1] == "EncDecAttention":
        return "cross"
    return "decoder" if "decoder" in path else "encoder"


def relative_position_bias(
    engine: PipelineEngine, stages: EncoderDecoderStages, model: nn.Module, length: int
) -> torch.Tensor:
    """``(1, heads, length, length)``: decoder self-attention's bias of query position q over key k,
    ``weight[bucket(k - q), head]``, and the lower-bound float where k > q (causal), as T5 computes it.

    The weight is read from the rank whose stage holds it (its trained value) and broadcast: every
    rank calls this alike."""
    name, info = stages.bias_weight, engine.graph.params[stages.bias_weight]
    owner = engine.weight_sync.owner(name)
    if owner == engine.rank:
        weight = dict(engine.named_parameters())[name].detach().float().clone()
    else:
        weight = torch.empty(tuple(info.shape), dtype=torch.float32, device=engine.device)
    weight = engine.messenger.broadcast(
        weight.contiguous(), engine.layout.position_of(owner), "the decoder's relative position bias"
    )
    config = model.config
    positions = torch.arange(length, device=engine.device)
    relative = positions[None, :] - positions[:, None]  # key - query
    attention = type(model.get_decoder().block[0].layer[0].SelfAttention)
    buckets = attention._relative_position_bucket(
        relative,
        bidirectional=False,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    bias = weight[buckets].permute(2, 0, 1)[None]  # (1, heads, query, key)
    lowest = torch.finfo(bias.dtype).min
    return bias.masked_fill(relative[None, None] > 0, lowest)
