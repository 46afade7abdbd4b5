"""How a rank cuts its micro-batches along the sequence: `WholeSequences`, or token slices (`TokenSlicing`).

The executor and `StepInputs` ask a `Slicing` what a micro-batch's units are, which stages run
them and when a sequence is done, instead of branching on whether the model was captured in token
slices (TeraPipe). An action or message of a whole micro-batch has ``slice_index`` ``None``; both
answer for it as for the micro-batch itself (a sliced model evaluates whole sequences).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
from hf_ftpipe.runtime.stage_variants import StageVariant

__all__ = ["Slicing", "WholeSequences"]


class Slicing(Protocol):
    """What the executor and the step's inputs ask of a micro-batch's cut along the sequence."""

    num_slices: int
    """Units per micro-batch in this step: the period of the message tags (1 for whole sequences)."""

    def unit(self, m: int, slice_index: int | None) -> int:
        """The key of what a rank keeps for micro-batch ``m``'s slice (``None``: the whole micro-batch)."""

    def variant(self, slice_index: int | None) -> StageVariant | None:
        """The stages that run the slice; ``None``: the micro-batch's own (planned or per-shape)."""

    def point(self, stage: int, m: int, slice_index: int | None) -> None:
        """Aim ``stage``'s attention at sequence ``m``'s keys and values before it runs the slice."""

    def forward_done(self, stage: int, m: int, slice_index: int | None, training: bool) -> None:
        """A forward of the slice ran on ``stage``."""

    def backward_done(self, stage: int, m: int, slice_index: int | None) -> None:
        """A backward of the slice ran on ``stage``."""

    def begin_batches(self, microbatches: Sequence[Mapping[str, Any]]) -> int | None:
        """Cut a training step's micro-batches; returns the slices each has (``None``: whole sequences)."""

    def split(self, m: int, microbatch: dict[str, Any]) -> list[dict[str, Any]]:
        """Micro-batch ``m``'s inputs per unit, in order."""

    def shapes(self, slice_index: int, piece: Mapping[str, Any], book: ShapeBook) -> MicrobatchShapes | None:
        """The shapes unit ``slice_index`` (inputs ``piece``) sends; ``None``: the micro-batch's own."""

    def evaluation_inputs(self, microbatch: dict[str, Any]) -> dict[str, Any]:
        """The inputs an evaluation runs a micro-batch on (whole sequences)."""

    def reset(self) -> None:
        """Forget every sequence (a new pipeline: after a drain or an evaluation)."""


class WholeSequences:
    """Micro-batches run whole: one unit each, the micro-batch's own stages and shapes, nothing to keep."""

    num_slices = 1

    def unit(self, m: int, slice_index: int | None) -> int:
        return m

    def variant(self, slice_index: int | None) -> StageVariant | None:
        return None

    def point(self, stage: int, m: int, slice_index: int | None) -> None:
        pass

    def forward_done(self, stage: int, m: int, slice_index: int | None, training: bool) -> None:
        pass

    def backward_done(self, stage: int, m: int, slice_index: int | None) -> None:
        pass

    def begin_batches(self, microbatches: Sequence[Mapping[str, Any]]) -> int | None:
        return None

    def split(self, m: int, microbatch: dict[str, Any]) -> list[dict[str, Any]]:
        return [microbatch]

    def shapes(self, slice_index: int, piece: Mapping[str, Any], book: ShapeBook) -> MicrobatchShapes | None:
        return None

    def evaluation_inputs(self, microbatch: dict[str, Any]) -> dict[str, Any]:
        return microbatch

    def reset(self) -> None:
        pass
