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
from hf_ftpipe.graph.token_slices import DERIVED_INPUTS, sequence_inputs
from hf_ftpipe.runtime.microbatches import split_batch
from hf_ftpipe.runtime.per_shape import PerShapeStages
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
from hf_ftpipe.runtime.state import MicrobatchState
from hf_ftpipe.runtime.token_slicing import TokenSlicing

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
        token_slicing (`TokenSlicing`, *optional*): trains each micro-batch as token slices.
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
        token_slicing: TokenSlicing | None = None,
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
        self.token_slicing = token_slicing
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
            if self.token_slicing is None:
                state.data[m], state.loss_weight[m] = microbatch, weights[offset]
                state.shapes[m] = self._shapes_of(microbatch)
                continue
            for i, piece in enumerate(self.token_slicing.split(m, microbatch)):
                unit = self.token_slicing.unit(m, i)
                state.data[unit], state.loss_weight[unit] = piece, weights[offset]
                state.shapes[unit] = self.token_slicing.shapes(i, piece, self.shape_book)
        return len(microbatches) * (1 if self.token_slicing is None else self.token_slicing.num_slices)

    def begin_slices(self, microbatches: Sequence[Mapping[str, Any]]) -> int | None:
        """Token slicing: cut this step's sequences by their length (`TokenSlicing.begin_step`);
        returns how many slices each has (``None`` without token slicing)."""
        if self.token_slicing is None:
            return None
        lengths = sorted({int(torch.as_tensor(mb["input_ids"]).shape[1]) for mb in microbatches})
        if len(lengths) > 1:  # one flush cuts every sequence alike: only gradient accumulation mixes lengths
            raise PipelineError(
                f"token slicing cuts every sequence of a step alike, but this step's batches have {lengths} "
                "tokens (gradient accumulation over batches padded apart); pad the batches of an accumulation "
                "window to one length (padding='max_length'), or set gradient_accumulation_steps=1"
            )
        return self.token_slicing.begin_step(lengths[0])

    def store_for_evaluation(self, state: MicrobatchState, microbatches: Sequence[dict[str, Any]]) -> None:
        """Store an evaluation's micro-batches, numbered from 0. A sliced model evaluates whole
        sequences: no backward, so no bubble to fill."""
        if self.per_shape is not None:
            self.per_shape.train(False)
        for m, microbatch in enumerate(microbatches):
            state.data[m] = microbatch if self.token_slicing is None else sequence_inputs(microbatch)
            state.shapes[m] = self._shapes_of(state.data[m])

    def unpad(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An evaluation's outputs at the batch's own lengths (`PerShapeStages.unpad`)."""
        return dict(outputs) if self.per_shape is None else self.per_shape.unpad(outputs)

    def _shapes_of(self, microbatch: Mapping[str, Any]) -> MicrobatchShapes:
        found = self.per_shape.shapes_of(microbatch) if self.per_shape is not None else None
        return found if found is not None else self.shape_book.of(microbatch)
