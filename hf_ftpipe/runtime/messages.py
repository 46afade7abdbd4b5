"""The values that cross ranks, with the shape and dtype they travel in.

Which messages a step sends, and when, is the lowering's (`hf_ftpipe.schedules.lowering`): a
`Transfer` is its `Route` plus what the transport needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.schedules.lowering import Dataflow, Route

__all__ = ["Transfer", "dataflow", "plan_transfers", "value_shape"]


@dataclass(frozen=True)
class Transfer(Route):
    """A `Route` with the tensor that travels it."""

    value_id: int
    """Numbers the values in `StageSpec.sent` order of the stages; messages are tagged by it."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def dataflow(specs: Sequence[StageSpec], transfers: Mapping[str, Transfer]) -> Dataflow:
    """The plan's data flow as plain data, for the lowering."""
    return Dataflow(
        sent=[spec.sent for spec in specs],
        received=[spec.received for spec in specs],
        consumers={value: consumers for spec in specs for value, consumers in spec.consumers.items()},
        routes=transfers,
    )


def plan_transfers(
    graph: CostGraph,
    specs: Sequence[StageSpec],
    stage_rank: Sequence[int],
    num_ranks: int,
    loss_value: str | None,
    autocast_dtypes: Mapping[str, torch.dtype],
) -> dict[str, Transfer]:
    """Every value that crosses ranks, numbered in `StageSpec.sent` order of the stages; ranks are the
    ``num_ranks`` positions of one pipeline (the loss goes to each of them)."""
    transfers: dict[str, Transfer] = {}
    for spec in specs:
        source = stage_rank[spec.stage_index]
        for value in spec.sent:
            readers = sorted({stage_rank[c] for c in spec.consumers[value]} - {source})
            targets = sorted(set(range(num_ranks)) - {source}) if value == loss_value else readers
            if not targets:
                continue
            shape, dtype = value_shape(graph, value, autocast_dtypes)
            transfers[value] = Transfer(
                value_id=len(transfers),
                name=value,
                producer_stage=spec.stage_index,
                source_rank=source,
                target_ranks=targets,
                reader_ranks=readers,
                shape=shape,
                dtype=dtype,
                carries_gradient=bool(readers) and bool(graph.node(value)["requires_grad"]) and dtype.is_floating_point,
            )
    return transfers


def value_shape(
    graph: CostGraph, value: str, autocast_dtypes: Mapping[str, torch.dtype]
) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``value`` as it travels: under autocast, the dtype autocast gives it."""
    attrs = graph.node(value)
    dtype = getattr(torch, attrs["output_dtypes"][0])
    if dtype.is_floating_point:
        dtype = autocast_dtypes.get(value, dtype)
    return tuple(attrs["output_shapes"][0]), dtype
