"""A model whose export fixes sizes that batches vary, and how to capture it again at another shape.

Every Hugging Face model tried exports with symbolic batch and sequence sizes
(`hf_ftpipe.graph.dynamic_shapes`), but a model's own code may fix one: a Python ``int`` made of
the sequence length, a loop over it, a ``view`` to a constant row count. ``torch.export`` then
keeps that size at the traced value (``Dim.AUTO``), or, where the code refuses symbolic sizes
outright, the model is exported with every size fixed. Such a model records a `ShapeCapture`:
which sizes are fixed, why, and what it takes to export it again at other sizes. The runtime then
runs a batch of another shape on a graph captured at that shape (`hf_ftpipe.runtime.per_shape`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["ShapeCapture", "fixed_sizes"]

SizeKey = tuple[str, int]
"""(input name, dimension)."""


@dataclass
class ShapeCapture:
    """What it takes to export ``model`` again at other input shapes (on its meta twin, as every capture)."""

    model: nn.Module
    inputs: dict[str, Any]
    """The inputs it was exported on (meta tensors: only their dtypes matter) and its constant inputs."""
    dynamic: bool
    """Whether the export kept the other sizes symbolic (``False``: every size was fixed)."""
    fixed: tuple[SizeKey, ...]
    """The batch and sequence sizes (dimensions 0 and 1) the export fixed, which a batch may vary."""
    reason: str
    """Why, for the warning: what torch.export found or the error it gave."""

    def capture(self, shapes: Mapping[str, Sequence[int]]) -> TracedModel:
        """The model captured on inputs of ``shapes`` (the others as before), in the same mode."""
        from hf_ftpipe.graph.trace import capture_model  # trace records a ShapeCapture: imported late

        inputs = {
            name: torch.empty(tuple(shapes[name]), dtype=value.dtype, device="meta")
            if isinstance(value, torch.Tensor) and name in shapes
            else value
            for name, value in self.inputs.items()
        }
        return capture_model(self.model, inputs, dynamic=self.dynamic)


def fixed_sizes(formulas: ShapeFormulas, inputs: Mapping[str, Any]) -> tuple[SizeKey, ...]:
    """The dimensions 0 and 1 of tensor ``inputs`` that the export fixed (an ``int`` in ``formulas``)."""
    fixed = []
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor) or name not in formulas.inputs:
            continue
        sizes = formulas.inputs[name]
        fixed += [(name, dim) for dim in range(min(value.dim(), 2)) if isinstance(sizes[dim], int)]
    return tuple(fixed)
