"""A causal LM's pipeline stages for decoding with a key/value cache, on the planned stages' weights.

The planned graph of a run without token slicing computes its position ids from the length of
the batch it is given: a one-token step would sit at position 0. Decoding runs a second capture
that takes ``position_ids`` (the positions ``model.generate`` computes from the attention mask,
left padding included) with a symbolic length, matched op by op onto the planned partition
(`hf_ftpipe.runtime.stage_variants`, as token slices are), its attention calls made
`PrefixAttention` over each stage's kept keys and values (`hf_ftpipe.runtime.token_slicing`). The
capture is taken with placeholder labels (every one ``-100``) so the loss stage hands on what its
planned stage does; the loss it computes is not read.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import fx, nn

from hf_ftpipe.errors import PipelineError, TraceError
from hf_ftpipe.graph.padding import IGNORE_INDEX
from hf_ftpipe.graph.prefix_attention_rules import prefix_attention_problem
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS, capture_token_slices, sequence_inputs
from hf_ftpipe.graph.trace import TracedModel, capture_model
from hf_ftpipe.runtime.prefix_attention import SliceCursor
from hf_ftpipe.runtime.shapes import ShapeBook
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.stage_variants import StageVariant, build_variant
from hf_ftpipe.runtime.token_slicing import use_prefix_attention

if TYPE_CHECKING:
    from hf_ftpipe.runtime.engine import PipelineEngine

__all__ = ["NO_CACHE", "DecodingStages", "check_cacheable", "decoding_inputs", "decoding_stages", "once_per_engine"]

NO_CACHE = "generate without the pipeline's key/value cache (every new token then runs the whole prefix again)"
_CACHED_ENCODER_DECODERS = ("t5", "mt5")
"""Encoder-decoders whose decoder's positions are one relative bias (decoder block 0's) over its
self-attention, which a cached step can apply (`hf_ftpipe.runtime.encoder_decoder_stages`)."""


@dataclass
class DecodingStages:
    """This rank's stages for decoding steps, and what a step needs to know to run them."""

    variant: StageVariant
    """The decoding capture's stages, on the planned stages' weights; values named as in the planned graph."""
    cursors: dict[int, SliceCursor]
    """Per own stage: the keys and values (and offset) its attention layers work on."""
    book: ShapeBook
    """Shapes of the values that cross ranks and the sizes the stages read, per step shape (decoding graph's names)."""
    logits: str
    """The planned graph's value the model returns as ``logits``."""
    sliced: bool
    """Whether the planned graph was captured for token slices, which take their labels shifted and
    counted (`hf_ftpipe.graph.token_slices.sequence_inputs`); the decoding graph then takes them too."""

    @property
    def specs(self) -> list[StageSpec]:
        return self.variant.specs

    @property
    def modules(self) -> dict[int, fx.GraphModule]:
        return self.variant.modules

    @property
    def to_variant(self) -> dict[str, str]:
        return self.variant.to_variant

    def inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """A step's inputs for the decoding graph."""
        inputs = decoding_inputs(input_ids, attention_mask, position_ids)
        return sequence_inputs(inputs) if self.sliced else inputs


_BUILT: weakref.WeakKeyDictionary[PipelineEngine, Any] = weakref.WeakKeyDictionary()
"""One capture per engine, or the reason it cannot be cached: ``model.generate`` makes a decoder per
call, and an export takes seconds."""
_CAPTURED: weakref.WeakKeyDictionary[nn.Module, dict[bool, TracedModel]] = weakref.WeakKeyDictionary()
"""The decoding capture per model (and whether its labels are shifted): it reads no weight."""


def check_cacheable(model: nn.Module) -> None:
    """Refuse a model whose keys and values the pipeline cannot keep, naming why.

    Causal LMs (GPT-2-, Llama-style) and T5-family encoder-decoders (T5, mT5: their decoder's
    positions are one relative bias, which a cached step can apply) are cached.

    Raises:
        `PipelineError`: another encoder-decoder (BART's learned positions, UMT5's per-layer bias, ...)
            or a model that is neither; attention that is not ``scaled_dot_product_attention``;
            dynamic-NTK RoPE or a sliding window (which attention over the kept keys does not apply).
    """
    config, name = getattr(model, "config", None), type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        model_type = getattr(config, "model_type", None)
        if model_type not in _CACHED_ENCODER_DECODERS:
            raise PipelineError(
                f"{name} is an encoder-decoder of type {model_type!r}: the pipeline keeps an encoder-decoder's keys "
                f"and values for T5-family models ({', '.join(_CACHED_ENCODER_DECODERS)}) only, whose decoder's "
                f"positions are one relative bias it applies to each new token; {NO_CACHE}"
            )
    elif not name.endswith(("ForCausalLM", "LMHeadModel")):
        raise PipelineError(
            f"{name} is not a causal LM (…ForCausalLM, …LMHeadModel) or a T5-family encoder-decoder; {NO_CACHE}"
        )
    problem = prefix_attention_problem(config, name, piece="a cached step", replacer="the pipeline's key/value cache")
    if problem is not None:
        raise PipelineError(
            f"{problem[1]}, or {NO_CACHE}" if problem[0] == "attention" else f"{problem[1]}; {NO_CACHE}"
        )


def decoding_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What the decoding graph takes for ``input_ids`` (``attention_mask`` at their length):
    labels that are all ``-100``, so no label is read."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}


_Stages = TypeVar("_Stages")


def once_per_engine(engine: PipelineEngine, model: nn.Module, build: Callable[[], _Stages]) -> _Stages:
    """``build()`` once per engine after `check_cacheable` (``model.generate`` makes a decoder per call,
    and building takes a while); a refusal is kept too and raised again each time.

    Raises:
        `PipelineError`: the model cannot be cached, with the reason.
    """
    built = _BUILT.get(engine)
    if built is None:
        try:
            check_cacheable(model)
            built = build()
        except PipelineError as error:
            built = error
        _BUILT[engine] = built
    if isinstance(built, PipelineError):
        raise PipelineError(str(built))
    return built


def decoding_stages(engine: PipelineEngine, model: nn.Module) -> DecodingStages:
    """A causal LM's stages for decoding, captured from ``model`` on first use and kept per engine.

    Raises:
        `PipelineError`: the model cannot be cached (`check_cacheable`; an encoder-decoder decodes with
            `hf_ftpipe.runtime.encoder_decoder_decoding.EncoderDecoderKV`), cannot be exported with a
            symbolic length, or its decoding graph does not map onto the planned stages.
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise PipelineError(
            f"{type(model).__name__} is an encoder-decoder: decode it with EncoderDecoderKV "
            "(hf_ftpipe.runtime.encoder_decoder_decoding), not KVDecoder"
        )
    return once_per_engine(engine, model, lambda: _build(engine, model))


def _build(engine: PipelineEngine, model: nn.Module) -> DecodingStages:
    name = type(model).__name__
    sliced = "shift_labels" in engine.graph.inputs  # trained with token slices: the loss is computed as theirs
    if "logits" not in engine.model_outputs.outputs:
        raise PipelineError(f"{name}'s graph returns no `logits` to decode from; {NO_CACHE}")
    traced = _capture(model, engine, sliced)
    cursors = {stage: SliceCursor() for stage in engine.modules}
    node_stage = {node: spec.stage_index for spec in engine.specs for node in spec.nodes}
    variant = build_variant(
        engine.graph,
        traced,
        engine.specs,
        node_stage,
        engine.modules,
        engine.device,
        where="in cached decoding",
        fix=NO_CACHE,
        extra_inputs=DERIVED_INPUTS,
    )
    for stage, module in variant.modules.items():
        use_prefix_attention(module, cursors[stage])
        module.train(False)
    logits = engine.model_outputs.outputs["logits"].value
    values = {*engine.transfers, logits}
    sizes = [size for stage in engine.modules for size in variant.specs[stage].size_inputs]
    book = ShapeBook(traced.shapes, traced.cost_graph, [variant.to_variant[v] for v in values], sizes)
    return DecodingStages(variant, cursors, book, logits, sliced)


def _has_attention(traced: TracedModel) -> bool:
    return any(
        getattr(module, "op", None) is torch.ops.aten.scaled_dot_product_attention.default
        for module in traced.graph_module.modules()
    )


def _capture(model: nn.Module, engine: PipelineEngine, sliced: bool) -> TracedModel:
    """``model`` captured with ``position_ids`` and a symbolic length (once per model and kind of labels)."""
    name = type(model).__name__
    captures = _CAPTURED.setdefault(model, {})
    if sliced in captures:
        return captures[sliced]
    planned = engine.graph.inputs["input_ids"].shape or (2, 4)
    rows, length = max(2, int(planned[0])), max(3, int(planned[1]))
    ids = torch.zeros(rows, length, dtype=torch.long)
    sample = decoding_inputs(ids, torch.ones_like(ids), torch.arange(length).expand(rows, length))
    try:
        with warnings.catch_warnings():  # decoding runs without dropout: token slicing's warning on it is not ours
            warnings.filterwarnings("ignore", message=".*token slices draw their dropout masks")
            traced = capture_token_slices(model, sample, [length]).full if sliced else capture_model(model, sample)
    except TraceError as error:
        raise PipelineError(f"{name} could not be captured for cached decoding: {error}; {NO_CACHE}") from error
    if 1 not in traced.shapes.varying("input_ids"):
        raise PipelineError(
            f"{name} cannot be exported with a symbolic sequence length, so a one-token step cannot run on its "
            f"graph; {NO_CACHE}"
        )
    if not _has_attention(traced):
        raise PipelineError(
            f"{name}'s graph has no scaled_dot_product_attention call to keep keys and values for; {NO_CACHE}"
        )
    captures[sliced] = traced = replace(traced, per_shape=None)  # it would hold the model: never run per shape
    return traced
