"""The replay: each rank's lowered program run as events in time, as the executor runs it.

What the executor does (`hf_ftpipe.runtime.executor`) and the replay copies:

- A rank runs its actions one at a time, in program order.
- A RECV only posts a receive (``irecv``): it takes no time. The action that reads the value
  waits for it: a forward for every activation it reads from another rank, a backward for the
  gradient of every value it sent, from each rank that read it.
- A SEND starts right after the action it follows and does not hold the rank (``isend``): the
  next action starts at once, the message travels meanwhile. Messages between two ranks share
  one link in each direction, in the order sent: a message waits for the link to be free, holds
  it for ``bytes / bandwidth``, and arrives ``latency`` later (`PipelineCosts.transfer_s`).
- The receives of values a rank does not read (the loss, copied to every rank) are waited for at
  the end of its step, as `Executor._run` does; the rank's next step starts after that.

Memory per rank: its static bytes all along; a stage's activations for one micro-batch from the
start of its forward to the end of its backward; what a backward adds, while it runs. A split
backward (``split_backward``: ``B`` then a later ``W``) is priced apart, ``B`` the input-gradient
share of the stage's backward and ``W`` the weight-gradient share (`PipelineCosts.split_s`), and
its ``B`` keeps what the ``W`` reads (`PipelineCosts.weight_kept_bytes`) until the ``W`` ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.schedules.actions import Action
from hf_ftpipe.schedules.lowering import Comm, Dataflow, Op, Route
from hf_ftpipe.simulator.costs import LOSS_BYTES, PipelineCosts

__all__ = ["Event", "Message", "Replay", "stage_dataflow"]

LOSS = "loss"


@dataclass(frozen=True)
class Event:
    """One action on one rank: ``kind`` ``F``, ``B``, ``W`` or ``U`` of ``stage`` for ``microbatch``
    (and token ``slice``), from ``start_s`` to ``end_s``, in ``step``."""

    rank: int
    step: int
    kind: str
    stage: int
    microbatch: int
    slice: int | None
    start_s: float
    end_s: float

    @property
    def label(self) -> str:
        return str(Action(self.stage, self.kind, self.microbatch, self.slice))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Message:
    """One message: ``value`` (its gradient if ``backward``) of ``microbatch`` from ``source`` to
    ``target``, sent at ``send_s`` (the end of the action that produced it), arrived at ``arrive_s``."""

    source: int
    target: int
    value: str
    microbatch: int
    slice: int | None
    backward: bool
    bytes: int
    send_s: float
    arrive_s: float


def stage_dataflow(costs: PipelineCosts) -> Dataflow:
    """The lowering's `Dataflow` of ``costs``: one value per pair of stages, ``h<s>to<t>``, sent
    wherever the two stages sit on different ranks, and the loss copied to every other rank (the
    runtime's rule, `hf_ftpipe.runtime.messages.plan_transfers`), per micro-batch."""
    rank = costs.stage_rank
    sent: list[list[str]] = [[] for _ in rank]
    received: list[list[str]] = [[] for _ in rank]
    consumers: dict[str, list[int]] = {}
    routes: dict[str, Route] = {}
    for edge in costs.edges:
        name = f"h{edge.source}to{edge.target}"
        sent[edge.source].append(name)
        received[edge.target].append(name)
        consumers[name] = [edge.target]
        if rank[edge.source] != rank[edge.target]:
            target = rank[edge.target]
            routes[name] = Route(name, edge.source, rank[edge.source], [target], [target], edge.grad_bytes > 0)
    sent[costs.loss].append(LOSS)
    consumers[LOSS] = []
    others = sorted(set(rank) - {rank[costs.loss]})
    if others:
        routes[LOSS] = Route(LOSS, costs.loss, rank[costs.loss], others, [], False)
    return Dataflow(sent=sent, received=received, consumers=consumers, routes=routes)


class Replay:
    """Runs the programs of successive steps on every rank; read `events`, `messages`, `memory`
    and `step_ends_s` afterwards.

    Args:
        costs (`PipelineCosts`): the times and bytes.
        dataflow (`Dataflow`): the lowering's data flow (`stage_dataflow(costs)`).
        num_slices (`int`, *optional*): token slices per sequence; each slice takes 1/k of its
            stage's time and memory.
        split_backward (`bool`, defaults to `False`): the schedule splits its backwards (B, then W).
    """

    def __init__(
        self, costs: PipelineCosts, dataflow: Dataflow, num_slices: int | None = None, *, split_backward: bool = False
    ) -> None:
        self.costs, self.flow = costs, dataflow
        self.split_backward = split_backward
        self.share = 1.0 / (num_slices or 1)
        self.bytes_of = {f"h{e.source}to{e.target}": (e.bytes, e.grad_bytes) for e in costs.edges}
        self.bytes_of[LOSS] = (LOSS_BYTES, 0)
        ranks = range(costs.num_ranks)
        self.clock = [0.0 for _ in ranks]
        self.events: list[Event] = []
        self.messages: list[Message] = []
        self.step_ends_s: list[list[float]] = []
        """Per step, when each rank finished it."""
        static = costs.static_bytes or [0] * costs.num_ranks
        self.memory: list[list[tuple[float, int]]] = [[(0.0, static[r])] for r in ranks]
        """Per rank, ``(time, bytes)`` at every change, a step function."""
        self._link_free: dict[tuple[int, int], float] = {}
        self._arrivals: dict[tuple[str, int, int | None, bool, int, int], float] = {}

    def run_step(self, programs: Mapping[int, Sequence[Op]]) -> None:
        """Run one step's program on every rank (ranks without one idle), after the steps before."""
        step = len(self.step_ends_s)
        ranks = range(self.costs.num_ranks)
        position = {r: 0 for r in ranks}
        waits: dict[int, list[Comm]] = {r: [] for r in ranks}
        left = set(ranks)
        while left:
            progressed = False
            for r in sorted(left):
                program = programs.get(r, [])
                while position[r] < len(program):
                    taken = self._try(r, step, program, position[r], waits[r])
                    if taken == 0:
                        break
                    position[r] += taken
                    progressed = True
                if position[r] == len(program):
                    ready = [self._arrivals.get(self._key(c, r)) for c in waits[r]]
                    if all(t is not None for t in ready):
                        self.clock[r] = max([self.clock[r], *ready])  # type: ignore[list-item]
                        left.discard(r)
                        progressed = True
            if not progressed:
                stuck = {
                    r: str(programs[r][position[r]]) for r in sorted(left) if position[r] < len(programs.get(r, []))
                }
                raise PipelineError(f"the simulated step {step} cannot go on: ranks wait at {stuck} (a lowering bug)")
        self.step_ends_s.append(list(self.clock))

    def _try(self, rank: int, step: int, program: Sequence[Op], i: int, waits: list[Comm]) -> int:
        """Run ``program[i]`` (an action with the SENDs after it) if what it reads has arrived;
        returns how many ops it took, 0 when it must wait."""
        op = program[i]
        if isinstance(op, Comm):  # a RECV posts; the loss, read by no action here, is waited for at the end
            if op.kind == "RECV" and not op.backward and rank not in self.flow.routes[op.value].reader_ranks:
                waits.append(op)
            return 1
        needed = [self._arrivals.get(key) for key in self._reads(op, rank)]
        if any(t is None for t in needed):
            return 0
        start = max([self.clock[rank], *needed])  # type: ignore[list-item]
        end = start + self._duration(op)
        self.clock[rank] = end
        self.events.append(
            Event(rank, step, op.computation, op.stage_index, op.microbatch_index, op.slice_index, start, end)
        )
        self._account(rank, op, start, end)
        taken = 1
        while i + taken < len(program) and isinstance(program[i + taken], Comm) and program[i + taken].kind == "SEND":  # type: ignore[union-attr]
            self._send(rank, program[i + taken], end)  # type: ignore[arg-type]
            taken += 1
        return taken

    def _reads(self, action: Action, rank: int) -> list[tuple[str, int, int | None, bool, int, int]]:
        """The messages ``action`` waits for (`Executor._incoming`, `Executor._output_grad`)."""
        m, i, s = action.microbatch_index, action.slice_index, action.stage_index
        keys = []
        if action.computation == "F":
            for value in self.flow.received[s]:
                route = self.flow.routes.get(value)
                if route is not None and route.source_rank != rank:
                    keys.append((value, m, i, False, route.source_rank, rank))
        elif action.computation == "B":
            for value in self.flow.sent[s]:
                route = self.flow.routes.get(value)
                if route is not None and route.carries_gradient:
                    keys += [(value, m, i, True, reader, rank) for reader in route.reader_ranks]
        return keys

    def _duration(self, action: Action) -> float:
        s = action.stage_index
        if action.computation == "F":
            return self.costs.forward_s[s] * self.share
        if action.computation == "B":
            whole = self.costs.backward_s[s]
            return (self.costs.split_s(s)[0] if self.split_backward else whole) * self.share
        if action.computation == "W":
            return self.costs.split_s(s)[1] * self.share
        return self.costs.update_s[s] if self.costs.update_s is not None else 0.0

    def _send(self, rank: int, comm: Comm, at: float) -> None:
        forward_bytes, grad_bytes = self.bytes_of[comm.value]
        num_bytes = int((grad_bytes if comm.backward else forward_bytes) * (1 if comm.value == LOSS else self.share))
        on_link, latency = self.costs.transfer_s(num_bytes)
        link = (rank, comm.peer)
        depart = max(at, self._link_free.get(link, 0.0))
        self._link_free[link] = depart + on_link
        arrive = depart + on_link + latency
        key = (comm.value, comm.microbatch_index, comm.slice_index, comm.backward, rank, comm.peer)
        self._arrivals[key] = arrive
        self.messages.append(
            Message(
                rank,
                comm.peer,
                comm.value,
                comm.microbatch_index,
                comm.slice_index,
                comm.backward,
                num_bytes,
                at,
                arrive,
            )
        )

    def _key(self, comm: Comm, rank: int) -> tuple[str, int, int | None, bool, int, int]:
        return (comm.value, comm.microbatch_index, comm.slice_index, comm.backward, comm.peer, rank)

    def _account(self, rank: int, action: Action, start: float, end: float) -> None:
        activation = self.costs.activation_bytes
        if activation is None or action.computation == "U":
            return
        held = int(activation[action.stage_index] * self.share)
        kept = int((self.costs.weight_kept_bytes or [0] * self.costs.num_stages)[action.stage_index] * self.share)
        points = self.memory[rank]
        now = points[-1][1]
        if action.computation == "F":
            points.append((start, now + held))
            return
        if action.computation == "W":
            points.append((end, now - kept))
            return
        extra = int((self.costs.backward_bytes or [0] * self.costs.num_stages)[action.stage_index] * self.share)
        if extra:
            points.append((start, now + extra))
        points.append((end, now - held + (kept if self.split_backward else 0)))
