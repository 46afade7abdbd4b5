"""Lowering: a schedule's global order becomes each rank's program, with its SENDs and RECVs.

Every rank lowers the same global order, so both ends of every message derive it from one rule
(in the manner of torch.distributed.pipelining's pass that adds send and receive actions):

- the forward of stage s is followed by a SEND of each value it produces to every other rank
  holding a stage that reads it, and of the loss to every other rank (`Route.target_ranks`),
  values in the stage's ``sent`` order;
- a value's gradient goes back to its producer's rank once every stage on the reading rank has
  run its backward for that micro-batch: a SEND after the last of those backwards, values in the
  stage's ``received`` order;
- a RECV is placed before the first action of the receiving rank that comes after the SEND in
  the global order: receives are posted ahead, in exactly the order the peer sends (NCCL matches
  point-to-point messages between two ranks by order alone; gloo by tag, which this fixes too).

A ``W`` (the weight gradients of a split backward) is local: it has no message. The ``B`` before it
sends the input gradient exactly as a whole backward does. A ``W`` that its rank reaches from its
``B`` without sending anything in between gains nothing from waiting (`whole_backwards`): moving it
up to its ``B`` delays no message, so the runtime runs that ``B`` whole and its ``W`` is empty.

A RECV prints as ``RECV_F0:h<0`` (the forward value ``h`` of micro-batch 0, from rank 0) and a
SEND as ``SEND_B0:h>0`` (its gradient, to rank 0)::

    gpipe, stage 0 on rank 0 sends h to stage 1 on rank 1, whose loss goes to rank 0; 2 micro-batches
    rank 0: 0F0 SEND_F0:h>1 0F1 SEND_F1:h>1 RECV_F0:loss<1 RECV_F1:loss<1 RECV_B0:h<1 RECV_B1:h<1 0B0 0B1
    rank 1: RECV_F0:h<0 RECV_F1:h<0 1F0 SEND_F0:loss>0 1F1 SEND_F1:loss>0 1B0 SEND_B0:h>0 1B1 SEND_B1:h>0

The receives a rank's actions do not read (the loss, copied to every rank) are collected at the end
of its program; receives after the last of them belong to a later step of a streaming schedule and
open that step's program.

Token slices (``1F0.2``) follow the same rules, one message per slice: a slice's forward sends its
hidden states (``SEND_F0.2:h0>1``), its backward sends their gradient back (``SEND_B0.2:h0>0``).
Keys and values never cross stages (a stage keeps those of its own layers), so they have no
messages. The loss too goes per slice: the last stage sends each slice's share of its sequence's
mean loss (its token losses summed, over the whole sequence's token count) to every other rank
(``SEND_F0.2:loss>0``), the rule for whole sequences applied to each forward; a rank adds a
sequence's slices up, which is the unsliced mean whatever the slice lengths (a mean of the
slices' means would weigh short slices too much), and needs no message to wait for the last slice.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hf_ftpipe.schedules.actions import Action

__all__ = ["Comm", "Dataflow", "Lowering", "Op", "Route", "chain_dataflow", "format_program", "whole_backwards"]


@dataclass(frozen=True)
class Route:
    """A value that crosses ranks: produced by one stage, read by stages on other ranks."""

    name: str
    producer_stage: int
    source_rank: int
    target_ranks: list[int]
    """Every rank it is sent to: those in `reader_ranks` and, for the loss, every other rank, so
    that each rank knows a step's loss without a collective that would stop the pipeline."""
    reader_ranks: list[int]
    """The ranks holding a stage that reads it: they send its gradient back."""
    carries_gradient: bool
    """Whether its gradient is sent back in training."""


@dataclass(frozen=True)
class Dataflow:
    """What the stages exchange, as plain data.

    Args:
        sent (`Sequence[Sequence[str]]`): per stage, the values it produces for others, in order.
        received (`Sequence[Sequence[str]]`): per stage, the values it reads from others, in order.
        consumers (`Mapping[str, Sequence[int]]`): value → the stages that read it.
        routes (`Mapping[str, Route]`): the values that cross ranks.
    """

    sent: Sequence[Sequence[str]]
    received: Sequence[Sequence[str]]
    consumers: Mapping[str, Sequence[int]]
    routes: Mapping[str, Route]


@dataclass(frozen=True)
class Comm:
    """One end of a message: a SEND or a RECV of a value (or, ``backward``, its gradient)."""

    kind: Literal["SEND", "RECV"]
    value: str
    microbatch_index: int
    backward: bool
    peer: int
    slice_index: int | None = None
    """The token slice it carries, ``None`` for whole sequences."""

    def __str__(self) -> str:
        arrow = ">" if self.kind == "SEND" else "<"
        unit = str(self.microbatch_index) if self.slice_index is None else f"{self.microbatch_index}.{self.slice_index}"
        return f"{self.kind}_{'B' if self.backward else 'F'}{unit}:{self.value}{arrow}{self.peer}"


Op = Action | Comm


def chain_dataflow(stage_rank: Sequence[int]) -> Dataflow:
    """The data flow of stages that feed each other in order, for a schedule printed without a model.

    Stage s sends one value, ``h<s>``, to stage s + 1 (a message only where they sit on different
    ranks), and the last stage's loss goes to every other rank, as the runtime copies it.
    """
    last = len(stage_rank) - 1
    routes = {
        f"h{s}": Route(f"h{s}", s, stage_rank[s], [stage_rank[s + 1]], [stage_rank[s + 1]], True)
        for s in range(last)
        if stage_rank[s] != stage_rank[s + 1]
    }
    others = sorted(set(stage_rank) - {stage_rank[last]})
    if others:
        routes["loss"] = Route("loss", last, stage_rank[last], others, [], False)
    return Dataflow(
        sent=[[f"h{s}"] for s in range(last)] + [["loss"]],
        received=[[]] + [[f"h{s - 1}"] for s in range(1, last + 1)],
        consumers={**{f"h{s}": [s + 1] for s in range(last)}, "loss": []},
        routes=routes,
    )


def format_program(program: Sequence[Op]) -> str:
    return " ".join(map(str, program))


def whole_backwards(program: Sequence[Op]) -> set[tuple[int, int, int | None]]:
    """``(stage, micro-batch, slice)`` of every ``B`` of ``program`` whose ``W`` follows with no SEND
    between them (the ``B``'s own SENDs included).

    Such a split buys nothing: whatever runs between them sends nothing, so running the ``W`` at once
    makes no message leave later, and no rank wait longer, while it saves what a split costs (the
    deferred products, and what ``W`` keeps until it runs). On the V, the first stage's backwards in
    the cool-down are such: they send nothing, and the rank has only weight gradients left after them.
    """
    whole: set[tuple[int, int, int | None]] = set()
    weights_ahead: set[tuple[int, int, int | None]] = set()
    """The ``W`` of the program after the current position, with no SEND before them."""
    for op in reversed(program):
        if isinstance(op, Comm):
            if op.kind == "SEND":
                weights_ahead.clear()
            continue
        key = (op.stage_index, op.microbatch_index, op.slice_index)
        if op.computation == "W":
            weights_ahead.add(key)
        elif op.computation == "B" and key in weights_ahead:
            whole.add(key)
    return whole


class Lowering:
    """Lowers global orders into per-rank programs, step after step.

    A streaming schedule's step may run some backwards of a value's readers and leave the others
    to the next step, and may send messages that are read in the next step: both carry over, so
    one `Lowering` serves every step until the pipeline is empty (`reset`).
    """

    def __init__(self, dataflow: Dataflow, stage_rank: Sequence[int]) -> None:
        self.dataflow = dataflow
        self.stage_rank = list(stage_rank)
        self.reset()

    def reset(self) -> None:
        self._backwards_left: dict[tuple[str, int, int | None, int], int] = {}
        """(value, micro-batch, slice, reading rank) → backwards still to run there before the gradient goes."""
        self._carried: dict[int, list[Comm]] = {}

    def lower(self, order: Sequence[Action]) -> dict[int, list[Op]]:
        """Each rank's program for ``order``: its actions with their SENDs and RECVs."""
        sends: dict[int, list[Comm]] = defaultdict(list)
        receives: dict[int, deque[tuple[int, Comm]]] = defaultdict(deque)
        for position, src, dst, value, (m, i), backward in self._messages(order):
            sends[position].append(Comm("SEND", value, m, backward, dst, i))
            receives[dst].append((position, Comm("RECV", value, m, backward, src, i)))
        programs: dict[int, list[Op]] = defaultdict(list)
        for rank, carried in self._carried.items():
            programs[rank].extend(carried)
        for position, action in enumerate(order):
            rank = self.stage_rank[action.stage_index]
            waiting = receives[rank]
            while waiting and waiting[0][0] < position:
                programs[rank].append(waiting.popleft()[1])
            programs[rank].append(action)
            programs[rank].extend(sends[position])
        self._carried = {}
        for rank, waiting in receives.items():
            trailing = [comm for _, comm in waiting]
            unread = [i for i, c in enumerate(trailing) if not c.backward and not self._reads(rank, c.value)]
            cut = unread[-1] + 1 if unread else 0
            programs[rank].extend(trailing[:cut])
            if trailing[cut:]:
                self._carried[rank] = trailing[cut:]
        return dict(programs)

    def _reads(self, rank: int, value: str) -> bool:
        return rank in self.dataflow.routes[value].reader_ranks

    def _messages(self, order: Sequence[Action]) -> list[tuple[int, int, int, str, tuple[int, int | None], bool]]:
        """``(position, src, dst, value, (micro-batch, slice), backward)`` of every message, in send order."""
        flow = self.dataflow
        messages = []
        for position, action in enumerate(order):
            s, unit = action.stage_index, (action.microbatch_index, action.slice_index)
            rank = self.stage_rank[s]
            if action.computation == "F":
                for value in flow.sent[s]:
                    route = flow.routes.get(value)
                    if route is not None:
                        messages += [(position, rank, dst, value, unit, False) for dst in route.target_ranks]
            elif action.computation == "B":
                for value in flow.received[s]:
                    route = flow.routes.get(value)
                    if route is None or route.source_rank == rank or not route.carries_gradient:
                        continue
                    key = (value, *unit, rank)
                    if key not in self._backwards_left:
                        readers = flow.consumers[value]
                        self._backwards_left[key] = sum(1 for c in readers if self.stage_rank[c] == rank)
                    self._backwards_left[key] -= 1
                    if self._backwards_left[key] == 0:
                        del self._backwards_left[key]
                        messages.append((position, rank, route.source_rank, value, unit, True))
        return messages
