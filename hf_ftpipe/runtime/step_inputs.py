"""A step's inputs: the caller's mini-batch as the micro-batches (or token slices) a rank keeps.

Each micro-batch goes into the rank's `MicrobatchState` with the shapes its values will travel in
(`hf_ftpipe.runtime.shapes`) and, in training, the weight its loss takes in the step's loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS
from hf_ftpipe.runtime.microbatches import split_batch
from hf_ftpipe.runtime.per_shape import PerShapeStages
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
from hf_ftpipe.runtime.slicing import Slicing, WholeSequences
from hf_ftpipe.runtime.state import MicrobatchState

__all__ = ["StepInputs"]


class StepInputs:
    """Splits mini-batches and stores their micro-batches in a rank's state.

    Args:
        graph (`CostGraph`): the traced graph (its inputs, their planned shapes).
        formulas (`ShapeFormulas`, *optional*): its shape formulas, which check a micro-batch's sizes;
            ``None`` for a graph traced at fixed shapes (its input shapes are then the only ones).
        values (`Iterable[str]`): the values whose shapes a micro-batch needs (those that cross
            ranks, the model's outputs).
        sizes (`Iterable[str]`): the size nodes this rank's stages read.
        num_microbatches (`int`): micro-batches per mini-batch.
        device (`torch.device`): where the stages run.
        slicing (`Slicing`, defaults to `WholeSequences`): how micro-batches are cut along the sequence
            (`hf_ftpipe.runtime.token_slicing.TokenSlicing` trains each as token slices).
        per_shape (`PerShapeStages`, *optional*): runs micro-batches of sizes the model's export fixed
            on graphs traced at their shape.
    """

    def __init__(
        self,
        graph: CostGraph,
        formulas: ShapeFormulas | None,
        values: Iterable[str],
        sizes: Iterable[str],
        num_microbatches: int,
        device: torch.device,
        slicing: Slicing | None = None,
        per_shape: PerShapeStages | None = None,
    ) -> None:
        self.graph = graph
        self.formulas = formulas or ShapeFormulas.fixed(
            {n: i.shape for n, i in graph.inputs.items() if i.shape is not None}, graph.model_class
        )
        self.shape_book = ShapeBook(self.formulas, graph, values, sizes)
        """Each micro-batch shape's value shapes and sizes (`hf_ftpipe.runtime.shapes`), cached."""
        self.num_microbatches = num_microbatches
        self.device = device
        self.slicing = slicing or WholeSequences()
        self.per_shape = per_shape

    def split(
        self, batch: Mapping[str, Any], streaming: str | None = None, training: bool = True
    ) -> list[dict[str, Any]]:
        """``batch`` as micro-batches (fewer than ``num_microbatches`` if it has fewer rows).

        ``streaming`` names a streaming schedule the batch trains under: those stream whole
        mini-batches only (`hf_ftpipe.schedules.orders.StreamingSchedule`), so a batch with fewer
        rows than ``num_microbatches`` is refused. Evaluation (``training=False``) may be longer
        than planned (see `split_batch`).
        """
        fit = self.per_shape.fit if self.per_shape is not None else None
        microbatches = split_batch(
            self.graph, self.formulas, batch, self.num_microbatches, self.device, DERIVED_INPUTS, training, fit
        )
        if streaming is not None and len(microbatches) < self.num_microbatches:
            rows = len(microbatches)
            raise PipelineError(
                f"the {streaming!r} schedule streams whole mini-batches of num_microbatches={self.num_microbatches} "
                f"micro-batches, but this batch has only {rows} row{'s' if rows > 1 else ''}, too few for one per "
                "micro-batch; drop the short last batch (dataloader_drop_last=True) or use gpipe or 1f1b, which "
                "train it"
            )
        return microbatches

    def split_batches(
        self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]], limit: int, streaming: str | None = None
    ) -> list[list[dict[str, Any]]]:
        """Each mini-batch of a training step as its micro-batches (`split`): ``batch``, or a list of up to
        ``limit`` mini-batches whose micro-batches run as one flush (gradient accumulation)."""
        batches = [batch] if isinstance(batch, Mapping) else list(batch)
        if not 1 <= len(batches) <= limit:
            raise PipelineError(f"a training step takes 1 to {limit} mini-batches, got {len(batches)}")
        return [self.split(one, streaming=streaming) for one in batches]

    def store(
        self, state: MicrobatchState, microbatches: Sequence[dict[str, Any]], first: int, weights: Sequence[float]
    ) -> int:
        """Store a training step's micro-batches (or their token slices), numbered from ``first``,
        with their shapes and loss weights; returns how many units.

        A slice's loss is its share of its sequence's mean (`hf_ftpipe.graph.token_slices`), so every
        slice of micro-batch m takes m's weight and the slices' weighted losses add up to m's.
        """
        if self.per_shape is not None:
            self.per_shape.train(True)
        for offset, microbatch in enumerate(microbatches):
            m = first + offset
            for i, piece in enumerate(self.slicing.split(m, microbatch)):
                unit = self.slicing.unit(m, i)
                state.data[unit], state.loss_weight[unit] = piece, weights[offset]
                state.shapes[unit] = self.slicing.shapes(i, piece, self.shape_book) or self._shapes_of(piece)
        return len(microbatches) * self.slicing.num_slices

    def begin_slices(self, microbatches: Sequence[Mapping[str, Any]]) -> int | None:
        """Token slicing: cut this step's sequences by their length (`TokenSlicing.begin_batches`);
        returns how many slices each has (``None`` for whole sequences)."""
        return self.slicing.begin_batches(microbatches)

    def store_for_evaluation(self, state: MicrobatchState, microbatches: Sequence[dict[str, Any]]) -> None:
        """Store an evaluation's micro-batches, numbered from 0. A sliced model evaluates whole
        sequences: no backward, so no bubble to fill."""
        if self.per_shape is not None:
            self.per_shape.train(False)
        for m, microbatch in enumerate(microbatches):
            state.data[m] = self.slicing.evaluation_inputs(microbatch)
            state.shapes[m] = self._shapes_of(state.data[m])

    def unpad(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An evaluation's outputs at the batch's own lengths (`PerShapeStages.unpad`)."""
        return dict(outputs) if self.per_shape is None else self.per_shape.unpad(outputs)

    def _shapes_of(self, microbatch: Mapping[str, Any]) -> MicrobatchShapes:
        found = self.per_shape.shapes_of(microbatch) if self.per_shape is not None else None
        return found if found is not None else self.shape_book.of(microbatch)
