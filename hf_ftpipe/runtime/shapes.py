"""The shape of every value a micro-batch sends, and the sizes its stages read, known before it runs.

Every rank reads the same whole batch, so every rank knows every micro-batch's input shapes. From
them the traced graph's shape formulas (`hf_ftpipe.graph.dynamic_shapes`) give the shape of each
value that crosses ranks, which sizes a receive's buffer, and each size a stage reads (a
sequence length to reshape to) without holding the tensor it was measured on. Nothing about
shapes is ever sent. Micro-batches of one shape share one evaluation (`ShapeBook` caches them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas

if TYPE_CHECKING:
    from hf_ftpipe.runtime.stage_variants import StageVariant

__all__ = ["MicrobatchShapes", "ShapeBook", "input_shapes"]


@dataclass(frozen=True)
class MicrobatchShapes:
    """The shapes of the values that travel, and the sizes the stages read, for one micro-batch shape."""

    values: dict[str, tuple[int, ...]]
    sizes: dict[str, Any]
    stages: StageVariant | None = None
    """The stages that run a micro-batch of this shape where the planned graph cannot (a model whose
    export fixes a size: `hf_ftpipe.runtime.per_shape`); ``None``: the planned stages."""


def input_shapes(microbatch: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The micro-batch's tensor inputs and their shapes, sorted by name: the key of its shapes."""
    return tuple(
        sorted((name, tuple(value.shape)) for name, value in microbatch.items() if isinstance(value, torch.Tensor))
    )


class ShapeBook:
    """Evaluates and caches `MicrobatchShapes` per input shape.

    Args:
        formulas (`ShapeFormulas`): the traced graph's.
        graph (`CostGraph`): its planned shapes stand in where a value has no formula.
        values (`Iterable[str]`): the values whose shapes are needed (those that cross ranks, the
            model's outputs).
        sizes (`Iterable[str]`): the size nodes some stage reads.
    """

    def __init__(self, formulas: ShapeFormulas, graph: CostGraph, values: Iterable[str], sizes: Iterable[str]) -> None:
        self.formulas = formulas
        self.graph = graph
        self.values = sorted(set(values))
        self.sizes = sorted(set(sizes))
        self._cache: dict[tuple, MicrobatchShapes] = {}

    def of(self, microbatch: Mapping[str, Any]) -> MicrobatchShapes:
        key = input_shapes(microbatch)
        shapes = self._cache.get(key)
        if shapes is None:
            bound = self.formulas.bind(dict(key))
            shapes = MicrobatchShapes(
                values={
                    value: self.formulas.shape_of(value, bound, self.graph.node(value)["output_shapes"][0])
                    for value in self.values
                },
                sizes={node: self.formulas.size_of(node, bound) for node in self.sizes},
            )
            self._cache[key] = shapes
        return shapes

    @property
    def cached(self) -> int:
        """How many micro-batch shapes were evaluated so far."""
        return len(self._cache)
