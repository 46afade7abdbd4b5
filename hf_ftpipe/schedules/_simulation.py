"""The list-scheduling simulation that orders the 1F1B-style schedules."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hf_ftpipe.schedules.actions import Action
from hf_ftpipe.schedules.rules import in_flight

_FORWARD_COST, _BACKWARD_COST = 1, 2


def limits(name: str, stage_rank: Sequence[int], num_microbatches: int) -> list[int]:
    """Micro-batches each stage may hold between forward and backward — the partitioner's
    `in_flight`, so the memory it predicts is the memory the schedule uses."""
    schedule = "1f1b" if name == "gpipe" else name
    return [in_flight(schedule, s, stage_rank, num_microbatches) for s in range(len(stage_rank))]


class Simulation:
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
