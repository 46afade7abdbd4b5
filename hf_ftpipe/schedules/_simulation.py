"""The list-scheduling simulation that orders the 1F1B-style schedules, whole sequences or token slices."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hf_ftpipe.schedules.actions import Action, stage_neighbours

_FORWARD_COST, _BACKWARD_COST = 1, 2


class Simulation:
    """List scheduling of forwards and backwards on ranks, one action at a time per rank.

    At every moment each idle rank starts its most urgent ready action: that of its deepest stage
    with one ready, the stage's backward before its next forward (a forward only while the stage
    holds fewer than ``limits[s]`` micro-batches: `hf_ftpipe.schedules.rules.in_flight_limits`, so
    the memory the partitioner predicts is the memory the schedule uses). On a Mixed-Pipe placement this keeps a rank
    busier than oldest-micro-batch-first. A forward costs 1/n, a backward 2/n, on a rank running
    n stages: the partitioner balances GPUs, not stages, so a GPU's n stages share its time (one
    stage split in two on one GPU, GPUs [0, 0, 1], then orders like the unsplit [0, 1]: priced
    1 each, GPU 0 looked twice as slow and let its backwards pile up while GPU 1 waited). A stage
    that may hold every micro-batch (``limits[s]`` ≥ ``available``) runs all its forwards first,
    as GPipe does: the memory rules count no gradients beside its activations
    (`hf_ftpipe.schedules.rules.gradients_persist`). The start order is the global order. With
    ``update_every``, a stage updates after every that many backwards (a ``U`` action right
    after the backward).

    With ``num_slices`` = k the units are token slices: a stage's n-th forward is slice n mod k of
    micro-batch n // k, and its backwards take each sequence's slices last-in-first-out (Seq1F1B),
    the last slice first, because a slice's backward needs the dK/dV of the later ones. ``limits``
    then counts slices.
    """

    def __init__(
        self,
        stage_rank: Sequence[int],
        edges: Sequence[tuple[int, int]],
        limits: Sequence[int],
        update_every: int | None = None,
        num_slices: int | None = None,
    ) -> None:
        if num_slices is not None and update_every is not None:
            raise ValueError("streaming schedules version weights by sequence: they do not take token slices")
        self.num_slices = num_slices
        self.stage_rank = list(stage_rank)
        self.limits = list(limits)
        self.update_every = update_every
        self.num_stages = len(self.stage_rank)
        self.producers, self.consumers = stage_neighbours(self.num_stages, edges)
        self.ranks = sorted(set(self.stage_rank))
        self.rank_stages = {r: [s for s in range(self.num_stages) if self.stage_rank[s] == r] for r in self.ranks}
        # A rank's stages share one unit of time (integers: the least common multiple of the counts).
        shares = math.lcm(*(len(stages) for stages in self.rank_stages.values()))
        self.scale = [shares // len(self.rank_stages[self.stage_rank[s]]) for s in range(self.num_stages)]
        self.now = 0
        self.busy_until = dict.fromkeys(self.ranks, 0)
        self.events: list[int] = []  # finish times of started actions (a heap), kept between runs
        self.done: dict[Action, int] = {}  # action → finish time
        self.next_forward = [0] * self.num_stages  # forwards (and backwards) started per stage: units in
        self.next_backward = [0] * self.num_stages  # the order `_forward_unit` (`_backward_unit`) numbers
        self.last_kind = ["B"] * self.num_stages  # a stage's last computation: token slices alternate

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
                cost = (_FORWARD_COST if action.computation == "F" else _BACKWARD_COST) * self.scale[action.stage_index]
                finish = self.now + cost
                self.busy_until[rank] = finish
                self.done[action] = finish
                heapq.heappush(events, finish)
                order.append(action)
                s = action.stage_index
                self.last_kind[s] = action.computation
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

    def _finished(self, action: Action) -> bool:
        finish = self.done.get(action)
        return finish is not None and finish <= self.now

    def _forward_unit(self, n: int) -> tuple[int, int | None]:
        """(micro-batch, slice) of a stage's n-th forward: sequences in order, slices in order."""
        k = self.num_slices
        return (n, None) if k is None else (n // k, n % k)

    def _backward_unit(self, n: int) -> tuple[int, int | None]:
        """(micro-batch, slice) of a stage's n-th backward: sequences in order, slices last first."""
        k = self.num_slices
        return (n, None) if k is None else (n // k, k - 1 - n % k)

    def _most_urgent(self, rank: int, available: int | None) -> Action | None:
        ready = []
        units = None if available is None else available * (self.num_slices or 1)
        for s in self.rank_stages[rank]:
            n = self.next_backward[s]
            forwards_first = units is not None and self.limits[s] >= units and self.next_forward[s] < units
            if n < self.next_forward[s] and not forwards_first:
                m, i = self._backward_unit(n)
                if self._finished(Action(s, "F", m, i)):
                    if all(self._finished(Action(c, "B", m, i)) for c in self.consumers[s]):
                        ready.append(Action(s, "B", m, i))
            n = self.next_forward[s]
            m, i = self._forward_unit(n)
            if (available is None or m < available) and n - self.next_backward[s] < self.limits[s]:
                if all(self._finished(Action(p, "F", m, i)) for p in self.producers[s]):
                    ready.append(Action(s, "F", m, i))
        # The deepest stage first (it frees the micro-batches the earlier stages wait for), then
        # the oldest micro-batch: a stage's backward before its next forward. With token slices the
        # backwards of a sequence are ready one after another, and running them all starves the
        # stages downstream of forwards: a stage alternates instead (Seq1F1B's one forward, one
        # backward), the other kind than its last action first when both are ready.
        if self.num_slices is None:
            return min(ready, key=lambda a: (-a.stage_index, a.microbatch_index), default=None)
        return min(
            ready,
            key=lambda a: (-a.stage_index, a.computation == self.last_kind[a.stage_index], a.microbatch_index),
            default=None,
        )

    def check_finished(self, count: int) -> None:
        """Raise unless every stage ran ``count`` backwards (units: micro-batches or slices)."""
        unfinished = [s for s in range(self.num_stages) if self.next_backward[s] < count]
        if unfinished:
            raise RuntimeError(
                f"the schedule simulation stopped with stages {unfinished} unfinished; this is a bug in "
                "hf_ftpipe, please report it with the plan"
            )
