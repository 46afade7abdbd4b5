"""Which messages an order of actions sends, in the order they are sent.

Both ends derive the same list from the same global order, so a rank can post its receives
ahead, in exactly the order its peers send (NCCL matches point-to-point messages between two
ranks by order alone; gloo by tag, which the list fixes too). The rules mirror the engine:

- the forward of stage s sends each value it produces to every other rank holding a stage that
  reads it, and the loss to every other rank (``Transfer.target_ranks``), values in
  ``StageSpec.sent`` order;
- a value's gradient goes back to its producer's rank once every stage on the reading rank has
  run its backward for that micro-batch: it is sent by the last of those backwards, values in
  ``StageSpec.received`` order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.schedules.orders import Action

__all__ = ["Message", "Transfer", "plan_messages", "plan_transfers", "value_shape"]


@dataclass
class Transfer:
    """A value that crosses ranks: produced on one rank, read by stages on others."""

    value_id: int
    name: str
    producer_stage: int
    source_rank: int
    target_ranks: list[int]
    """Every rank it is sent to: those in `reader_ranks` and, for the loss, every other rank, so
    that each rank knows a step's loss without a collective that would stop the pipeline."""
    reader_ranks: list[int]
    """The ranks holding a stage that reads it: they send its gradient back."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    carries_gradient: bool
    """Whether its gradient is sent back in training (it requires grad, is floating point and has
    readers on other ranks)."""


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    value: str
    microbatch: int
    backward: bool


def plan_messages(
    order: Sequence[Action],
    specs: Sequence[StageSpec],
    stage_rank: Sequence[int],
    transfers: Mapping[str, Transfer],
    remaining_consumers: dict[tuple[str, int, int], int] | None = None,
) -> list[tuple[int, Message]]:
    """``(position in order, message)`` for every message sent while ``order`` runs, in send order.

    Args:
        remaining_consumers: ``(value, micro-batch, rank)`` → backwards still to run on that rank
            before the value's gradient is sent; carried from one step to the next by streaming
            schedules (filled in as needed when ``None`` or missing).
    """
    remaining = remaining_consumers if remaining_consumers is not None else {}
    messages: list[tuple[int, Message]] = []
    for position, action in enumerate(order):
        spec = specs[action.stage_index]
        rank = stage_rank[action.stage_index]
        m = action.microbatch_index
        if action.computation == "F":
            for value in spec.sent:
                transfer = transfers.get(value)
                if transfer is not None:
                    for dst in transfer.target_ranks:
                        messages.append((position, Message(rank, dst, value, m, backward=False)))
        elif action.computation == "B":
            for value in spec.received:
                transfer = transfers[value] if value in transfers else None
                if transfer is None or transfer.source_rank == rank or not transfer.carries_gradient:
                    continue
                key = (value, m, rank)
                if key not in remaining:
                    consumers = specs[transfer.producer_stage].consumers[value]
                    remaining[key] = sum(1 for s in consumers if stage_rank[s] == rank)
                remaining[key] -= 1
                if remaining[key] == 0:
                    del remaining[key]
                    messages.append((position, Message(rank, transfer.source_rank, value, m, backward=True)))
    return messages


def plan_transfers(
    graph: CostGraph,
    specs: Sequence[StageSpec],
    stage_rank: Sequence[int],
    world_size: int,
    loss_value: str | None,
    autocast_dtypes: Mapping[str, torch.dtype],
) -> dict[str, Transfer]:
    """Every value that crosses ranks, numbered in `StageSpec.sent` order of the stages."""
    transfers: dict[str, Transfer] = {}
    for spec in specs:
        source = stage_rank[spec.stage_index]
        for value in spec.sent:
            readers = sorted({stage_rank[c] for c in spec.consumers[value]} - {source})
            targets = sorted(set(range(world_size)) - {source}) if value == loss_value else readers
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
