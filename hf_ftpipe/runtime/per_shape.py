"""Batches of shapes the planned graph cannot take, each run on a graph traced at its shape.

A model whose export fixes a batch or sequence size (`hf_ftpipe.graph.shape_capture`) gets one
graph per shape instead of one for all. A micro-batch of another size there is padded up to a
bucket (lengths to a multiple of `PerShapeOptions.multiple_of`, the collator's
``pad_to_multiple_of`` under `PipeTrainer`, at most the planned length; row counts are never
padded, since a loss averaged over rows would change), and runs on a graph traced at that shape,
matched op by op onto the planned one so that every op keeps its stage and every stage its weights
(`hf_ftpipe.runtime.stage_variants`). Each new shape is traced once, with a warning that counts
them and says why. At most `PerShapeOptions.max_shapes` graphs are kept, the planned one included;
after that a micro-batch of a new shape is padded to the traced shape nearest above it (the
planned one always is), or, with no such shape (a row count never traced), refused.

Every rank reads the same batches in the same order, so every rank traces the same shapes and
pads alike, without a message.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from hf_ftpipe.errors import PipelineError, TraceError
from hf_ftpipe.graph.padding import pad_lengths
from hf_ftpipe.runtime.microbatches import check_planned
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook, input_shapes
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.stage_variants import StageVariant, build_variant

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["PerShapeOptions", "PerShapeStages", "bucket_length", "choose_shape"]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
"""The sizes of a micro-batch where the export fixed them, in the order of `ShapeCapture.fixed`."""


@dataclass(frozen=True, kw_only=True)
class PerShapeOptions:
    """How a model whose export fixes sizes runs batches of other sizes (`hf_ftpipe.runtime.per_shape`)."""

    multiple_of: int = 8
    """Lengths are padded up to a multiple of this: fewer graphs, more padding. 8 is the multiple Hugging
    Face suggests for ``pad_to_multiple_of``; `PipeTrainer` takes its collator's where it has one."""
    max_shapes: int = 16
    """The most graphs kept, the planned one included (each costs a trace and host memory)."""
    pad_token_id: int = 0
    """What ``input_ids`` are padded with (masked out, so any token serves)."""

    def __post_init__(self) -> None:
        for name in ("multiple_of", "max_shapes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def bucket_length(length: int, multiple_of: int, planned: int) -> int:
    """``length`` rounded up to a multiple of ``multiple_of``, but not past ``planned`` (a length longer
    than planned, which only evaluation takes, is rounded up)."""
    rounded = -(-length // multiple_of) * multiple_of
    return rounded if length > planned else min(rounded, planned)


def choose_shape(needed: Shape, paddable: Sequence[bool], traced: Collection[Shape], max_shapes: int) -> Shape | None:
    """The shape whose graph runs a micro-batch that needs ``needed``: itself, when traced or while fewer
    than ``max_shapes`` are; else the traced shape that takes it with the least padding (equal sizes
    where not ``paddable``, at least as large where it is); ``None`` if none does."""
    if needed in traced or len(traced) < max_shapes:
        return needed
    covering = [
        shape
        for shape in traced
        if all(size == want or (pad and size >= want) for size, want, pad in zip(shape, needed, paddable, strict=True))
    ]
    return min(covering, key=lambda shape: (sum(shape), shape), default=None)


@dataclass
class _Traced:
    """One shape's stages and the shapes of its micro-batches, named as in the planned graph."""

    variant: StageVariant
    book: ShapeBook
    shapes: dict[tuple, MicrobatchShapes] = field(default_factory=dict)


class PerShapeStages:
    """A rank's stages at every shape traced so far, and the padding of micro-batches to those shapes.

    Args:
        traced (`TracedModel`): the planned capture of a model whose export fixed a size; its
            ``per_shape`` (never ``None`` here) says how to capture others.
        specs (`Sequence[StageSpec]`): the planned graph's stages.
        node_stage (`Mapping[str, int]`): the partition.
        modules (`Mapping[int, fx.GraphModule]`): this rank's planned stages (their weights are used).
        device (`torch.device`): where the stages run.
        values (`Iterable[str]`): the planned values whose shapes a micro-batch needs (`ShapeBook`).
        num_microbatches (`int`): micro-batches per mini-batch (for the planned-size errors).
        options (`PerShapeOptions`, *optional*): buckets, bound and pad token (default: `PerShapeOptions()`).
    """

    def __init__(
        self,
        traced: TracedModel,
        specs: Sequence[StageSpec],
        node_stage: Mapping[str, int],
        modules: Mapping[int, fx.GraphModule],
        device: torch.device,
        values: Iterable[str],
        num_microbatches: int,
        options: PerShapeOptions | None = None,
    ) -> None:
        if traced.per_shape is None:
            raise PipelineError("internal: per-shape graphs for a model whose export fixed no size")
        self.capture, self.planned = traced.per_shape, traced
        self.graph = traced.cost_graph
        self.specs, self.node_stage, self.modules, self.device = list(specs), node_stage, modules, device
        self.values = sorted(set(values))
        self.num_microbatches = num_microbatches
        self.options = options or PerShapeOptions()
        self.fixed = self.capture.fixed
        self.paddable = tuple(dim == 1 for _, dim in self.fixed)
        self.planned_shape: Shape = tuple(self.graph.inputs[name].shape[dim] for name, dim in self.fixed)
        self._traced: dict[Shape, _Traced] = {}
        self._warned_full = False
        self._training = True
        self.padding: dict[int, int] = {}
        """The last split's padded lengths → the lengths they were (to cut evaluation outputs back)."""

    @property
    def traced_shapes(self) -> list[Shape]:
        """Every shape with a graph, the planned one first."""
        return [self.planned_shape, *self._traced]

    # -- splitting ----------------------------------------------------------------------------

    def fit(self, microbatches: list[dict[str, Any]], training: bool) -> list[dict[str, Any]] | None:
        """`hf_ftpipe.runtime.microbatches.Fit`: ``None`` when the planned graph takes every micro-batch
        as it is; else each micro-batch padded to the shape of its graph (traced now if new), checked."""
        self.padding = {}
        if all(self._planned_takes(mb) for mb in microbatches):
            return None
        fitted, lengths = [], None
        for microbatch in microbatches:
            shapes = dict(input_shapes(microbatch))
            check_planned(self.graph, microbatch, self.num_microbatches, training, self.fixed)
            needed = tuple(
                size if lengths is None or dim != 1 else lengths[(name, dim)]
                for (name, dim), size in zip(self.fixed, self._needed(shapes), strict=True)
            )
            shape = choose_shape(needed, self.paddable, self.traced_shapes, self.options.max_shapes)
            if shape is None or (lengths is not None and shape != needed):
                raise self._full_error(needed)
            if shape != needed:
                self._warn_full(needed, shape)
            if lengths is None:  # the batch's micro-batches share their lengths: padded alike
                lengths = {key: size for key, size in zip(self.fixed, shape, strict=True) if key[1] == 1}
            padded = self._pad(microbatch, shapes, shape)
            self._shapes_of(shape, padded)  # traces a new shape here, before anything is sent
            fitted.append(padded)
        return fitted

    def shapes_of(self, microbatch: Mapping[str, Any]) -> MicrobatchShapes | None:
        """The shapes (and stages) of a micro-batch `fit` gave, ``None`` for the planned graph's."""
        shapes = dict(input_shapes(microbatch))
        shape = tuple(shapes[name][dim] for name, dim in self.fixed)
        return None if shape == self.planned_shape else self._shapes_of(shape, microbatch)

    def train(self, mode: bool) -> None:
        """Dropout on or off in every traced shape's stages, as in the planned stages."""
        self._training = mode
        for entry in self._traced.values():
            entry.variant.train(mode)

    def unpad(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An evaluation's outputs cut back to the batch's own lengths where `fit` padded them: the
        dimension 1 of an output that follows the padded sequence (its planned size is a planned length)."""
        if not self.padding:
            return dict(outputs)
        planned_lengths = {self.graph.inputs[name].shape[dim] for name, dim in self.fixed if dim == 1}
        cut = {}
        for name, tensor in outputs.items():
            value = self._output_value(name)
            planned = self.graph.node(value)["output_shapes"][0] if value is not None else ()
            follows = len(planned) > 1 and planned[1] in planned_lengths
            if follows and tensor.dim() > 1 and int(tensor.shape[1]) in self.padding:
                tensor = tensor[:, : self.padding[int(tensor.shape[1])]]
            cut[name] = tensor
        return cut

    # -- helpers ------------------------------------------------------------------------------

    def _planned_takes(self, microbatch: Mapping[str, Any]) -> bool:
        try:
            self.planned.shapes.bind(dict(input_shapes(microbatch)))
        except PipelineError:
            shapes = dict(input_shapes(microbatch))
            # another mismatch than a fixed size (a missing dimension, two lengths that must agree)
            # is the planned check's to name
            return all(shapes[name][dim] == size for (name, dim), size in zip(self.fixed, self.planned_shape))
        return True

    def _needed(self, shapes: Mapping[str, Sequence[int]]) -> Shape:
        sizes = []
        for (name, dim), planned in zip(self.fixed, self.planned_shape, strict=True):
            size = int(shapes[name][dim])
            sizes.append(bucket_length(size, self.options.multiple_of, planned) if dim == 1 else size)
        return tuple(sizes)

    def _pad(self, microbatch: dict[str, Any], shapes: Mapping[str, Sequence[int]], shape: Shape) -> dict[str, Any]:
        """Pad every input of a fixed length to ``shape``'s, and any other of the same length alike
        (labels a causal LM reads beside its ``input_ids``, which export may leave variable)."""
        targets: dict[str, int] = {}
        by_length: dict[int, int] = {}
        for (name, dim), size in zip(self.fixed, shape, strict=True):
            if dim == 1:
                targets[name] = size
                by_length.setdefault(int(shapes[name][1]), size)
        for name, value in shapes.items():
            if name not in targets and len(value) > 1 and value[1] in by_length:
                targets[name] = by_length[value[1]]
        for real, padded in by_length.items():
            if padded != real:  # the first fixed length's wins (``input_ids`` before ``labels``)
                self.padding.setdefault(padded, real)
        return pad_lengths(microbatch, targets, self.options.pad_token_id)

    def _shapes_of(self, shape: Shape, microbatch: Mapping[str, Any]) -> MicrobatchShapes | None:
        if shape == self.planned_shape:
            self.planned.shapes.bind(dict(input_shapes(microbatch)))
            return None
        entry = self._traced.get(shape) or self._trace(shape, microbatch)
        key = input_shapes(microbatch)
        if key not in entry.shapes:
            found = entry.book.of(microbatch)
            values = {value: found.values[entry.variant.to_variant[value]] for value in self.values}
            entry.shapes[key] = MicrobatchShapes(values=values, sizes=found.sizes, stages=entry.variant)
        return entry.shapes[key]

    def _trace(self, shape: Shape, microbatch: Mapping[str, Any]) -> _Traced:
        shapes = dict(input_shapes(microbatch))
        name = self.graph.model_class
        where = f"at input shapes {shapes}"
        try:
            traced = self.capture.capture(shapes)
            variant = build_variant(
                self.graph,
                traced,
                self.specs,
                self.node_stage,
                self.modules,
                self.device,
                where=where,
                fix="pad every batch to the planned length (padding='max_length'), or report the model class to "
                "hf_ftpipe",
                extra_inputs=self.graph.inputs,
            )
        except TraceError as error:
            raise PipelineError(f"{name} cannot be traced {where}: {error}") from error
        variant.train(self._training)
        missing = [value for value in self.values if value not in variant.to_variant]
        if missing:
            raise PipelineError(
                f"{name} {where} computes no counterpart of {missing[:3]}; pad every batch to one length"
            )
        sizes = [size for s in self.modules for size in variant.specs[s].size_inputs]
        book = ShapeBook(traced.shapes, traced.cost_graph, [variant.to_variant[v] for v in self.values], sizes)
        self._traced[shape] = entry = _Traced(variant, book)
        logger.warning(
            "%s: traced a graph for micro-batches of shape %s, %d shapes traced so far (at most %d, lengths padded "
            "to multiples of %d), since %s. Pad batches to one length (padding='max_length') to trace once",
            name,
            shapes,
            len(self.traced_shapes),
            self.options.max_shapes,
            self.options.multiple_of,
            self.capture.reason,
        )
        return entry

    def _output_value(self, name: str) -> str | None:
        for output_name, value in zip(self.graph.output_names, self.graph.outputs, strict=False):
            if output_name == name:
                return value
        return None

    def _warn_full(self, needed: Shape, shape: Shape) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "%s: %d shapes traced, the most kept (PerShapeOptions.max_shapes); micro-batches of a new shape are "
                "padded to the nearest traced one from now on (sizes %s of %s to %s)",
                self.graph.model_class,
                self.options.max_shapes,
                needed,
                list(self.fixed),
                shape,
            )

    def _full_error(self, needed: Shape) -> PipelineError:
        return PipelineError(
            f"{self.graph.model_class} needs a graph for sizes {needed} of {list(self.fixed)}, but "
            f"{self.options.max_shapes} shapes are traced, the most kept (PerShapeOptions.max_shapes), and none "
            f"takes it ({self.traced_shapes}); give batches of the planned rows, or raise `max_shapes`"
        )
