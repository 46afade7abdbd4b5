"""An evaluation's model outputs (loss, logits, ...), gathered from the ranks that computed them onto every rank.

Every rank returns the same outputs, as one process would: each output's owner broadcasts it per
micro-batch within its pipeline (each replica evaluates the whole batch), and the others receive it
in a buffer of that micro-batch's own shape (`hf_ftpipe.runtime.shapes`), which every rank knows
without a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.messages import value_shape
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.state import MicrobatchState

__all__ = ["ModelOutputs"]


@dataclass(frozen=True)
class _Output:
    value: str
    """The graph value the model returns under this name."""
    rank: int
    """The rank (pipeline position) whose stage produces it."""
    dtype: torch.dtype


class ModelOutputs:
    """Where each model output is produced, and its gathering onto every rank.

    Args:
        graph (`CostGraph`): the traced graph.
        specs (`Sequence[StageSpec]`): every stage (`StageSpec.model_outputs` names the outputs).
        stage_rank (`Sequence[int]`): the rank (position in this rank's pipeline) running each stage.
        autocast_dtypes (`Mapping[str, torch.dtype]`): the dtype autocast gives a value, if any.
        messenger (`Messenger`): this rank's messages.
        device (`torch.device`): where this rank's stages run.
    """

    def __init__(
        self,
        graph: CostGraph,
        specs: Sequence[StageSpec],
        stage_rank: Sequence[int],
        autocast_dtypes: Mapping[str, torch.dtype],
        messenger: Messenger,
        device: torch.device,
    ) -> None:
        self.outputs: dict[str, _Output] = {}
        for spec in specs:
            for name, value in spec.model_outputs.items():
                dtype = value_shape(graph, value, autocast_dtypes)[1]
                self.outputs.setdefault(name, _Output(value, stage_rank[spec.stage_index], dtype))
        self.loss_value = self.outputs["loss"].value if "loss" in self.outputs else None
        self.messenger = messenger
        self.device = device

    def gather(
        self,
        names: Sequence[str],
        state: MicrobatchState,
        losses: Sequence[torch.Tensor],
        num_microbatches: int,
        position: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The outputs in ``names`` the model has, concatenated over the evaluation's ``num_microbatches``
        micro-batches (stacked where each is a scalar), on every rank; with ``position``, of an output with
        a sequence dimension (dimension 1) only that position, as a length of 1.

        ``losses`` are the micro-batches' losses this rank already has (the lowering sends the loss to
        every rank); ``state`` holds the outputs computed here and each micro-batch's shapes.
        """
        gathered: dict[str, torch.Tensor] = {}
        for name in names:
            output = self.outputs.get(name)
            if output is None:
                continue
            if output.value == self.loss_value and len(losses) == num_microbatches:  # already on every rank
                gathered[name] = torch.stack(list(losses))
                continue
            pieces = []
            for m in range(num_microbatches):
                local = state.outputs.get((output.value, m)) if output.rank == self.messenger.position else None
                shape = tuple(state.shapes[m].values[output.value])
                at = position if position is not None and len(shape) > 1 else None
                if local is not None:
                    local = local.detach() if at is None else local.detach()[:, at : at + 1]
                    tensor = local.to(output.dtype, copy=True)
                else:
                    shape = shape if at is None else (shape[0], 1, *shape[2:])
                    tensor = torch.empty(shape, dtype=output.dtype, device=self.device)
                pieces.append(self.messenger.broadcast(tensor, output.rank, name))
            gathered[name] = torch.stack(pieces) if pieces[0].dim() == 0 else torch.cat(pieces)
        return gathered
