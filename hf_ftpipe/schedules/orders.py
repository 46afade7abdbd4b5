"""Schedules as data: the ordered list of actions each rank performs.

An action is ``(stage_index, computation, microbatch_index)`` and prints as ``1F0`` (stage 1,
forward, micro-batch 0), ``0B3`` (backward) or ``0U3`` (stage 0 updates its weights, right after
the backward of micro-batch 3); `Action.parse` reads that form back. A schedule produces one
*global* order of actions; each rank performs the subsequence that belongs to its stages. Every
rank following one global order that respects the data flow is what makes a step free of
deadlocks, whatever the placement of stages on ranks (non-adjacent stages included), and it fixes
the order of the messages between every pair of ranks (NCCL matches them in order).

Four schedules:

- ``gpipe`` (Huang et al., 2019): every forward of the mini-batch, then every backward.
- ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021): a stage runs a backward as soon as one is
  ready and keeps at most `in_flight` micro-batches between forward and backward; the pipeline
  is flushed at the end of the mini-batch, so the update equals GPipe's.
- ``async`` (PipeDream, Narayanan et al., 2019): 1F1B without the flush. Micro-batches stream
  from one mini-batch into the next; each stage updates its weights after every
  ``gradient_accumulation_steps`` backwards (``U`` actions) and a micro-batch's backward uses the
  weights its forward used (weight stashing, done by the engine).
- ``2bw`` (PipeDream-2BW, Narayanan et al., 2021): the same stream, one update per stage after the
  last backward of each mini-batch; mini-batch b runs on the weights from before the previous
  update, so W(t+1) = W(t) − ν·∇f(W(t−1)) with two weight buffers.

The 1F1B-style orders come from a small list-scheduling simulation: every rank repeatedly starts
its most urgent ready action (that of its deepest stage, a backward before a forward, a forward
only while the stage holds fewer than `in_flight` micro-batches), a backward costing two
forwards. With one stage per rank it yields the textbook orders::

    1f1b, 2 stages on 2 ranks, 4 micro-batches
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from hf_ftpipe.costmodel.memory_rules import in_flight

__all__ = [
    "Action",
    "ScheduleName",
    "Schedule",
    "ScheduleGPipe",
    "Schedule1F1B",
    "StreamingSchedule",
    "chain_edges",
    "check_order",
    "format_actions",
    "make_schedule",
]

Computation = Literal["F", "B", "U"]
ScheduleName = Literal["gpipe", "1f1b", "async", "2bw"]
_ACTION = re.compile(r"^(\d+)([FBU])(\d+)$")
_FORWARD_COST, _BACKWARD_COST = 1, 2


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward or backward of one micro-batch through one stage, or a
    stage's weight update (``U``, numbered by the micro-batch whose backward it follows)."""

    stage_index: int
    computation: Computation
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.computation}{self.microbatch_index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0', '0B3' or '0U3'")
        return cls(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


def format_actions(actions: Sequence[Action]) -> str:
    return " ".join(map(str, actions))


def chain_edges(num_stages: int) -> list[tuple[int, int]]:
    """Stage s feeds stage s + 1: the data flow of a plain pipeline."""
    return [(s, s + 1) for s in range(num_stages - 1)]


class Schedule:
    """A flushing schedule: the global order of one mini-batch's actions.

    Args:
        stage_rank (`Sequence[int]`): the rank running each stage.
        num_microbatches (`int`): micro-batches per mini-batch.
        edges (`Sequence[tuple[int, int]]`, *optional*): ``(producer, consumer)`` stage pairs; a chain
            by default. The engine passes the real data flow of the plan.
    """

    name: str = ""

    def __init__(
        self, stage_rank: Sequence[int], num_microbatches: int, edges: Sequence[tuple[int, int]] | None = None
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        if not stage_rank:
            raise ValueError("a schedule needs at least one stage")
        self.stage_rank = list(stage_rank)
        self.num_stages = len(self.stage_rank)
        self.num_microbatches = num_microbatches
        self.edges = list(chain_edges(self.num_stages) if edges is None else edges)
        for producer, consumer in self.edges:
            if not 0 <= producer < consumer < self.num_stages:
                raise ValueError(
                    f"stage edge {producer}->{consumer} does not go forward in stage order; "
                    f"stages are numbered 0..{self.num_stages - 1} in topological order"
                )

    def global_order(self) -> list[Action]:
        raise NotImplementedError

    def actions_of(self, rank: int) -> list[Action]:
        """The actions ``rank`` performs, in order."""
        return [a for a in self.global_order() if self.stage_rank[a.stage_index] == rank]

    def __str__(self) -> str:
        order = self.global_order()
        ranks = sorted(set(self.stage_rank))
        return "\n".join(
            f"rank {r}: {format_actions([a for a in order if self.stage_rank[a.stage_index] == r])}" for r in ranks
        )


class ScheduleGPipe(Schedule):
    """GPipe: forwards stage by stage in stage order (micro-batches in order within a stage),
    then backwards in reverse stage order. One optimizer step follows; the update equals
    single-device training with the micro-batch losses averaged.

    GPipe, 2 stages on 2 ranks, 3 micro-batches (time flows right)::

        rank 0: 0F0 0F1 0F2                     0B0 0B1 0B2
        rank 1:     1F0 1F1 1F2 1B0 1B1 1B2
    """

    name = "gpipe"

    def global_order(self) -> list[Action]:
        stages = range(self.num_stages)
        microbatches = range(self.num_microbatches)
        forwards = [Action(s, "F", m) for s in stages for m in microbatches]
        backwards = [Action(s, "B", m) for s in reversed(stages) for m in microbatches]
        return forwards + backwards


class Schedule1F1B(Schedule):
    """PipeDream-Flush: one backward as soon as it is ready, at most `in_flight` micro-batches
    held per stage, flushed at the end of the mini-batch (same update as GPipe, less memory)."""

    name = "1f1b"

    def global_order(self) -> list[Action]:
        simulation = _Simulation(self.stage_rank, self.edges, _limits("1f1b", self.stage_rank, self.num_microbatches))
        order = simulation.run(available=self.num_microbatches)
        simulation.check_finished(self.num_microbatches)
        return order


class StreamingSchedule(Schedule):
    """``async`` and ``2bw``: micro-batches stream across mini-batches without a flush.

    The order is that of an endless stream of micro-batches (indices keep counting across
    mini-batches). `next_step` hands out the part of it that the micro-batches given so far allow:
    every action up to the first that needs a later micro-batch, on each rank, and nothing that
    depends on a held-back action, so every message sent within a step is received within that
    step or a later one and no rank waits on work that is not scheduled. What stays in flight at
    the end of a step (the forwards and backwards a flush would have waited for) runs in the next
    step, overlapped with its new micro-batches. `drain` finishes everything started so far and
    empties the pipeline (before evaluation, saving, or the end of training). Every rank calls them
    in the same sequence, so every rank holds the same order.

    Args:
        name (`str`): ``"async"`` or ``"2bw"``.
        gradient_accumulation_steps (`int`, defaults to 1): for ``async``, backwards per update.
    """

    def __init__(
        self,
        name: Literal["async", "2bw"],
        stage_rank: Sequence[int],
        num_microbatches: int,
        edges: Sequence[tuple[int, int]] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        super().__init__(stage_rank, num_microbatches, edges)
        if name not in ("async", "2bw"):
            raise ValueError(f"a streaming schedule is 'async' or '2bw', got {name!r}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be at least 1, got {gradient_accumulation_steps}")
        self.name = name
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.update_every = gradient_accumulation_steps if name == "async" else num_microbatches
        self.reset()

    def reset(self) -> None:
        """Start again from an empty pipeline."""
        limits = _limits(self.name, self.stage_rank, self.num_microbatches)
        self._simulation = _Simulation(self.stage_rank, self.edges, limits, update_every=self.update_every)
        self._pending: list[Action] = []
        self.given = 0  # micro-batches handed to the schedule so far

    @property
    def in_flight(self) -> bool:
        """Whether some micro-batch has started but not finished."""
        return any(a.microbatch_index < self.given for a in self._pending)

    def next_step(self) -> list[Action]:
        """The actions to run once micro-batches ``given .. given + num_microbatches - 1`` exist."""
        self.given += self.num_microbatches
        self._pending += self._simulation.run(until_finished=self.given)
        step, self._pending = self._closed_prefix(self._pending, self.given)
        return step

    def drain(self) -> list[Action]:
        """Every remaining action of the micro-batches given so far, then a final update of the
        stages holding gradients not yet applied; the pipeline is then empty."""
        step = [a for a in self._pending if a.microbatch_index < self.given]
        if self.given % self.update_every:  # every stage has backwards no update has applied yet
            for s in range(self.num_stages):
                backwards = [i for i, a in enumerate(step) if a.stage_index == s and a.computation == "B"]
                position = backwards[-1] + 1 if backwards else len(step)
                step.insert(position, Action(s, "U", self.given - 1))
        self.reset()
        return step

    def _closed_prefix(self, pending: list[Action], limit: int) -> tuple[list[Action], list[Action]]:
        blocked_ranks: set[int] = set()
        held: set[tuple[int, str, int]] = set()
        taken, kept = [], []
        for action in pending:
            s, m = action.stage_index, action.microbatch_index
            rank = self.stage_rank[s]
            hold = rank in blocked_ranks or (action.computation == "F" and m >= limit)
            if not hold:
                hold = any(dep in held for dep in _dependencies(action, self._simulation))
            if hold:
                held.add((s, action.computation, m))
                blocked_ranks.add(rank)
                kept.append(action)
            else:
                taken.append(action)
        return taken, kept

    def global_order(self) -> list[Action]:
        """One mini-batch from an empty pipeline, drained: what `__str__` prints."""
        probe = StreamingSchedule(
            self.name,  # type: ignore[arg-type]
            self.stage_rank,
            self.num_microbatches,
            self.edges,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        return probe.next_step() + probe.drain()


def make_schedule(
    name: str,
    stage_rank: Sequence[int],
    num_microbatches: int,
    edges: Sequence[tuple[int, int]] | None = None,
    *,
    gradient_accumulation_steps: int = 1,
) -> Schedule:
    """The schedule called ``name`` (one of `ScheduleName`)."""
    if name == "gpipe":
        return ScheduleGPipe(stage_rank, num_microbatches, edges)
    if name == "1f1b":
        return Schedule1F1B(stage_rank, num_microbatches, edges)
    if name in ("async", "2bw"):
        return StreamingSchedule(
            name,  # type: ignore[arg-type]
            stage_rank,
            num_microbatches,
            edges,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {list(get_args(ScheduleName))}")


def check_order(
    order: Sequence[Action], stage_rank: Sequence[int], edges: Sequence[tuple[int, int]], microbatches: range
) -> None:
    """Raise `ValueError` unless ``order`` runs every forward and backward of ``microbatches`` once,
    each after what it depends on — a schedule checked without starting any process."""
    num_stages = len(stage_rank)
    consumers: dict[int, list[int]] = defaultdict(list)
    producers: dict[int, list[int]] = defaultdict(list)
    for producer, consumer in edges:
        consumers[producer].append(consumer)
        producers[consumer].append(producer)
    done: set[tuple[int, str, int]] = set()
    for action in order:
        key = (action.stage_index, action.computation, action.microbatch_index)
        if action.computation == "U":
            continue
        if key in done:
            raise ValueError(f"{action} appears twice")
        s, m = action.stage_index, action.microbatch_index
        needs = [(p, "F", m) for p in producers[s]] if action.computation == "F" else [(s, "F", m)]
        if action.computation == "B":
            needs += [(c, "B", m) for c in consumers[s]]
        missing = [f"{a}{c}{b}" for a, c, b in needs if (a, c, b) not in done]
        if missing:
            raise ValueError(f"{action} comes before {', '.join(missing)}, which it depends on")
        done.add(key)
    expected = {(s, c, m) for s in range(num_stages) for c in "FB" for m in microbatches}
    if done != expected:
        missing = sorted(expected - done)[:5]
        raise ValueError(f"the order misses {len(expected - done)} actions, e.g. {missing}")


def _dependencies(action: Action, simulation: _Simulation) -> list[tuple[int, str, int]]:
    """What ``action`` needs done first: the forwards feeding a forward; a stage's own forward and
    its consumers' backwards for a backward; the backward it follows for an update."""
    s, m = action.stage_index, action.microbatch_index
    if action.computation == "F":
        return [(p, "F", m) for p in simulation.producers[s]]
    if action.computation == "B":
        return [(s, "F", m)] + [(c, "B", m) for c in simulation.consumers[s]]
    return [(s, "B", m)]


def _limits(name: str, stage_rank: Sequence[int], num_microbatches: int) -> list[int]:
    """Micro-batches each stage may hold between forward and backward — the partitioner's
    `in_flight`, so the memory it predicts is the memory the schedule uses."""
    schedule = "1f1b" if name == "gpipe" else name
    return [in_flight(schedule, s, stage_rank, num_microbatches) for s in range(len(stage_rank))]


class _Simulation:
    """List scheduling of forwards and backwards on ranks, one action at a time per rank.

    At every moment each idle rank starts its most urgent ready action: that of its deepest stage
    with one ready, the stage's backward before its next forward (a forward only while the stage
    holds fewer than ``limits[s]`` micro-batches). On a Mixed-Pipe placement this keeps a rank
    busier than oldest-micro-batch-first. Forwards cost 1, backwards 2. The start
    order is the global order. With ``update_every``, a stage updates after every that many
    backwards (a ``U`` action right after the backward).
    """

    def __init__(
        self,
        stage_rank: Sequence[int],
        edges: Sequence[tuple[int, int]],
        limits: Sequence[int],
        update_every: int | None = None,
    ) -> None:
        self.stage_rank = list(stage_rank)
        self.limits = list(limits)
        self.update_every = update_every
        self.num_stages = len(self.stage_rank)
        self.producers: list[list[int]] = [[] for _ in range(self.num_stages)]
        self.consumers: list[list[int]] = [[] for _ in range(self.num_stages)]
        for producer, consumer in edges:
            self.producers[consumer].append(producer)
            self.consumers[producer].append(consumer)
        self.ranks = sorted(set(self.stage_rank))
        self.rank_stages = {r: [s for s in range(self.num_stages) if self.stage_rank[s] == r] for r in self.ranks}
        self.now = 0
        self.busy_until = dict.fromkeys(self.ranks, 0)
        self.events: list[int] = []  # finish times of started actions (a heap), kept between runs
        self.done: dict[tuple[int, str, int], int] = {}  # action → finish time
        self.next_forward = [0] * self.num_stages  # forwards run in micro-batch order per stage
        self.next_backward = [0] * self.num_stages

    def run(self, available: int | None = None, until_finished: int | None = None) -> list[Action]:
        """Simulate, returning the actions in start order: with ``available``, until nothing more
        can start using micro-batches ``0..available-1``; with ``until_finished``, on an endless
        stream until every stage finished the backwards of micro-batches ``0..until_finished-1``."""
        limit = available if available is not None else None
        order: list[Action] = []
        events = self.events
        while until_finished is None or min(self.next_backward) < until_finished:
            started = False
            for rank in self.ranks:
                if self.busy_until[rank] > self.now:
                    continue
                action = self._most_urgent(rank, limit)
                if action is None:
                    continue
                cost = _FORWARD_COST if action.computation == "F" else _BACKWARD_COST
                finish = self.now + cost
                self.busy_until[rank] = finish
                self.done[(action.stage_index, action.computation, action.microbatch_index)] = finish
                heapq.heappush(events, finish)
                order.append(action)
                s = action.stage_index
                if action.computation == "F":
                    self.next_forward[s] += 1
                else:
                    self.next_backward[s] += 1
                    if self.update_every is not None and self.next_backward[s] % self.update_every == 0:
                        order.append(Action(s, "U", action.microbatch_index))
                started = True
            while events and events[0] <= self.now:
                heapq.heappop(events)
            if not events:
                if started:
                    continue
                break
            self.now = events[0]
        return order

    def _finished(self, key: tuple[int, str, int]) -> bool:
        finish = self.done.get(key)
        return finish is not None and finish <= self.now

    def _most_urgent(self, rank: int, available: int | None) -> Action | None:
        ready = []
        for s in self.rank_stages[rank]:
            m = self.next_backward[s]
            if m < self.next_forward[s] and self._finished((s, "F", m)):
                if all(self._finished((c, "B", m)) for c in self.consumers[s]):
                    ready.append(Action(s, "B", m))
            m = self.next_forward[s]
            if (available is None or m < available) and m - self.next_backward[s] < self.limits[s]:
                if all(self._finished((p, "F", m)) for p in self.producers[s]):
                    ready.append(Action(s, "F", m))
        # The deepest stage first (it frees the micro-batches the earlier stages wait for), then
        # the oldest micro-batch: a stage's backward before its next forward.
        return min(ready, key=lambda a: (-a.stage_index, a.microbatch_index), default=None)

    def check_finished(self, count: int) -> None:
        unfinished = [s for s in range(self.num_stages) if self.next_backward[s] < count]
        if unfinished:
            raise RuntimeError(
                f"the schedule simulation stopped with stages {unfinished} unfinished; this is a bug in "
                "hf_ftpipe, please report it with the plan"
            )
