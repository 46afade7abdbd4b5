"""Synchronous schedules that shrink the bubble: ``zb-h1``, ``zbv`` and ``interleaved-1f1b``.

All three flush: one optimizer step per mini-batch, the same update as one process.

- ``zb-h1`` and ``zbv`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split each
  backward in two (`ScheduleTraits.split_backward`): ``B``, the input gradients the stage before
  waits for, and a later ``W``, the weight gradients nothing waits for. The orders come from a
  list-scheduling simulation (`SplitSimulation`): every idle rank starts its most urgent ready
  ``F`` or ``B`` (deepest stage first, then the oldest micro-batch, 1F1B's `in_flight` limit on
  forwards), and a ``W`` only when nothing else is ready or when a forward waits for a ``W`` to
  free memory — so the weight gradients fill what would be the bubble (1F1B's cool-down). F, B
  and W cost one unit each (the paper's T_F = T_B = T_W), a rank's stages sharing its time.
  A stage keeps at most min(M, S + 1) micro-batches between F and W (S stages, M micro-batches):
  at most 1F1B's `in_flight` = min(M, S − s) holding activations and the rest holding only what W
  needs (`hf_ftpipe.schedules.rules.awaiting_weight_gradients`), so a stage's memory passes that
  of 1F1B's first stage by one micro-batch's W inputs at most (ZB-H1's memory). With S alone the
  first stage cannot defer a single W and 4 stages × 8 micro-batches take 29 units, not ZB-H1's
  M·3 + (P − 1) = 27; with S + 1 they take 27, as unbounded deferral does.
  ``zb-h1`` runs on any placement (designed for one stage per GPU); ``zbv`` is the same rules on
  the V placement they were designed for (2 stages per GPU, stage s on GPU min(s, 2P − 1 − s)),
  where the V puts the first and last stage on one GPU so the cool-down bubble has W's to fill,
  and refuses any other placement. Two ranks, four micro-batches::

      zb-h1, 2 stages on 2 ranks                         (F, B, W = 1 unit: 13 units, 1f1b 15)
      rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3
      rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3

      zbv, stages 0-3 on ranks [0, 1, 1, 0]            (12.5 units of a GPU's F + B + W = 3; 1f1b 15)
      rank 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 0F3 0B1 3W0 3F2 3B2 3F3 3B3 0B2 3W1 0B3 3W2 3W3 0W0 0W1 0W2 0W3
      rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 1F3 2F3 2B2 1B2 2B3 1B3 2W0 2W1 2W2 2W3 1W0 1W1 1W2 1W3

- ``interleaved-1f1b`` (Narayanan et al., SC 2021, Megatron-LM's interleaved schedule) runs a
  looped placement, stage s on rank s mod P (v stages per rank), with whole backwards (the
  runtime's B, as torch's ``ScheduleInterleaved1F1B``): each rank takes the micro-batches in groups
  of P, a group through each of its stages in turn (backwards through them in reverse), after a
  warm-up of 2·(P − r − 1) + (v − 1)·P forwards on the rank at position r, then one forward, one
  backward. Where P does not divide M the groups are ⌊M / P⌋, the larger first (M < P: one). One
  stage per rank (v = 1) is exactly 1F1B (P − r − 1 forwards of warm-up). Other placements are
  refused, naming those that fit::

      interleaved-1f1b, stages 0-3 on ranks [0, 1, 0, 1], 4 micro-batches
      rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
      rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from hf_ftpipe.schedules.actions import Action, dependencies, stage_neighbours
from hf_ftpipe.schedules.orders import Schedule
from hf_ftpipe.schedules.rules import awaiting_weight_gradients, in_flight_limits

__all__ = [
    "ScheduleInterleaved1F1B",
    "ScheduleZBV",
    "ScheduleZeroBubbleAuto",
    "ScheduleZeroBubbleH1",
    "SplitSimulation",
    "is_looped",
    "is_v_shape",
    "replay_orders",
    "v_placement",
    "zero_bubble_order",
]


def v_placement(num_gpus: int) -> list[int]:
    """The V placement: 2·P stages on P GPUs, stage s on GPU min(s, 2P − 1 − s) ([0, 1, 1, 0] for P = 2)."""
    return [min(s, 2 * num_gpus - 1 - s) for s in range(2 * num_gpus)]


def is_v_shape(stage_rank: Sequence[int]) -> bool:
    """Whether stage s runs on rank min(s, 2P − 1 − s), P = the number of ranks (ranks named 0..P − 1)."""
    return len(stage_rank) % 2 == 0 and list(stage_rank) == v_placement(len(stage_rank) // 2)


def is_looped(stage_rank: Sequence[int]) -> bool:
    """Whether stage s runs on the rank of stage s mod P, P distinct ranks each holding as many stages."""
    num_ranks = len(set(stage_rank))
    return (
        len(stage_rank) % num_ranks == 0
        and len(set(stage_rank[:num_ranks])) == num_ranks
        and all(rank == stage_rank[s % num_ranks] for s, rank in enumerate(stage_rank))
    )


class SplitSimulation:
    """List scheduling of F, B and W on ranks, one action at a time per rank (see the module).

    Args:
        stage_rank (`Sequence[int]`): the rank of each stage.
        edges (`Sequence[tuple[int, int]]`): ``(producer, consumer)`` stage pairs.
        held (`Sequence[int]`): per stage, micro-batches at most between F and B (activations).
        kept (`Sequence[int]`): per stage, micro-batches at most between F and W (anything).
        costs (`Sequence[Mapping[str, float]]`, *optional*): per stage, the time of its ``F``,
            ``B`` and ``W``; one unit each by default, a rank's stages sharing its time.
    """

    def __init__(
        self,
        stage_rank: Sequence[int],
        edges: Sequence[tuple[int, int]],
        held: Sequence[int],
        kept: Sequence[int],
        costs: Sequence[Mapping[str, float]] | None = None,
    ) -> None:
        self.stage_rank = list(stage_rank)
        self.held, self.kept = list(held), list(kept)
        self.producers, self.consumers = stage_neighbours(len(self.stage_rank), edges)
        self.rank_stages: dict[int, list[int]] = {}
        for s, rank in enumerate(self.stage_rank):
            self.rank_stages.setdefault(rank, []).append(s)
        shares = math.lcm(*(len(stages) for stages in self.rank_stages.values()))
        unit = [shares // len(self.rank_stages[rank]) for rank in self.stage_rank]
        self.costs = [dict.fromkeys("FBW", u) for u in unit] if costs is None else [dict(c) for c in costs]

    def run(self, num_microbatches: int) -> list[Action]:
        """The global order (actions in start order) of one flushed mini-batch."""
        num_stages, total = len(self.stage_rank), 3 * len(self.stage_rank) * num_microbatches
        self._count = {c: [0] * num_stages for c in "FBW"}  # started, per computation and stage
        self._done: dict[Action, float] = {}  # action → finish time
        self._now: float = 0
        busy_until: dict[int, float] = dict.fromkeys(self.rank_stages, 0)
        events: list[float] = []
        order: list[Action] = []
        while len(order) < total:
            for rank, stages in self.rank_stages.items():
                if busy_until[rank] > self._now:
                    continue
                action = self._most_urgent(stages, num_microbatches)
                if action is None:
                    continue
                finish = self._now + self.costs[action.stage_index][action.computation]
                busy_until[rank] = self._done[action] = finish
                heapq.heappush(events, finish)
                self._count[action.computation][action.stage_index] += 1
                order.append(action)
            while events and events[0] <= self._now:
                heapq.heappop(events)
            if not events and len(order) < total:
                raise RuntimeError(
                    f"the zero-bubble simulation stalled on placement {self.stage_rank}; this is a bug in "
                    "hf_ftpipe, please report it with the plan"
                )
            if events:
                self._now = events[0]
        return order

    def _finished(self, action: Action) -> bool:
        return self._done.get(action, self._now + 1) <= self._now

    def _most_urgent(self, stages: Sequence[int], num_microbatches: int) -> Action | None:
        """The action a rank running ``stages`` starts now, if any (see the module)."""
        finished, count = self._finished, self._count
        ready: list[Action] = []
        weights: list[Action] = []
        wanted: list[Action] = []  # W's that a forward waits for
        for s in stages:
            f, b, w = count["F"][s], count["B"][s], count["W"][s]
            if b < f and finished(Action(s, "F", b)) and all(finished(Action(c, "B", b)) for c in self.consumers[s]):
                ready.append(Action(s, "B", b))
            forward_ready = (
                f < num_microbatches
                and f - b < self.held[s]
                and all(finished(Action(p, "F", f)) for p in self.producers[s])
            )
            if forward_ready and f - w < self.kept[s]:
                ready.append(Action(s, "F", f))
            if w < b and finished(Action(s, "B", w)):
                weights.append(Action(s, "W", w))
                if forward_ready and f - w >= self.kept[s]:
                    wanted.append(Action(s, "W", w))
        # The deepest stage first (it frees what the earlier stages wait for), its oldest
        # micro-batch first (a backward before the next forward); a W only for a waiting
        # forward or when nothing else is ready.
        if ready:
            return min(ready, key=_urgency)
        return min(wanted or weights, key=_urgency, default=None)


def _urgency(action: Action) -> tuple[int, int]:
    return -action.stage_index, action.microbatch_index


def replay_orders(
    rank_orders: dict[int, list[Action]], stage_rank: Sequence[int], edges: Sequence[tuple[int, int]]
) -> list[Action]:
    """One global order from each rank's own order: every rank runs its next action once what it
    depends on has finished (F 1 unit, a whole B 2; split, B and W 1 each), in start order;
    `ValueError` naming each rank's waiting action where they wait on each other (a deadlock)."""
    producers, consumers = stage_neighbours(len(stage_rank), edges)
    split = any(a.computation == "W" for actions in rank_orders.values() for a in actions)
    costs = {"F": 1, "B": 1, "W": 1} if split else {"F": 1, "B": 2}
    position = dict.fromkeys(rank_orders, 0)
    busy_until = dict.fromkeys(rank_orders, 0)
    done: dict[Action, int] = {}
    events: list[int] = []
    order: list[Action] = []
    now = 0
    total = sum(map(len, rank_orders.values()))
    while len(order) < total:
        for rank, actions in rank_orders.items():
            if busy_until[rank] > now or position[rank] == len(actions):
                continue
            action = actions[position[rank]]
            if all(done.get(need, now + 1) <= now for need in dependencies(action, producers, consumers)):
                finish = now + costs[action.computation]
                busy_until[rank] = done[action] = finish
                heapq.heappush(events, finish)
                position[rank] += 1
                order.append(action)
        while events and events[0] <= now:
            heapq.heappop(events)
        if not events and len(order) < total:
            waiting = {rank: str(a[position[rank]]) for rank, a in rank_orders.items() if position[rank] < len(a)}
            raise ValueError(f"the ranks' orders deadlock: each waits on another, next actions {waiting}")
        if events:
            now = events[0]
    return order


class ScheduleZeroBubbleH1(Schedule):
    """ZB-H1: 1F1B's warm-up and memory, backwards split, W's filling the cool-down (see the module)."""

    name = "zb-h1"

    def global_order(self) -> list[Action]:
        return zero_bubble_order(self.stage_rank, self.num_microbatches, self.edges)


def zero_bubble_order(
    stage_rank: Sequence[int],
    num_microbatches: int,
    edges: Sequence[tuple[int, int]],
    stage_costs: Sequence[Mapping[str, float]] | None = None,
) -> list[Action]:
    """The zero-bubble order within ``zb-h1``'s memory bounds (`SplitSimulation`), its actions
    timed by ``stage_costs`` (per stage, ``F``, ``B`` and ``W`` seconds; one unit each by default:
    ``zb-h1`` and ``zbv``, the same order on every rank whatever the plan's times)."""
    held = in_flight_limits("zb-h1", stage_rank, num_microbatches)
    awaiting = [awaiting_weight_gradients("zb-h1", s, stage_rank, num_microbatches) for s in range(len(stage_rank))]
    kept = [h + a for h, a in zip(held, awaiting, strict=True)]
    return SplitSimulation(stage_rank, edges, held, kept, stage_costs).run(num_microbatches)


class ScheduleZeroBubbleAuto(ScheduleZeroBubbleH1):
    """``zb-auto`` where no stage times are known: zb-h1's order, which bounds its memory.

    The partitioners and the memory rules price ``zb-auto`` as this order; the order that runs is
    built once the plan is (`hf_ftpipe.simulator.auto_schedule`), from the plan's stage times.
    """

    name = "zb-auto"


class ScheduleZBV(ScheduleZeroBubbleH1):
    """ZB-V: the zero-bubble rules on a V placement, 2 stages per GPU (see the module)."""

    name = "zbv"

    def check_placement(self) -> None:
        if not is_v_shape(self.stage_rank):
            num_gpus = len(set(self.stage_rank))
            raise ValueError(
                f"the 'zbv' schedule runs a V placement (stage s on GPU min(s, 2P - 1 - s), 2 stages per GPU: "
                f"{v_placement(num_gpus)} on {num_gpus} GPUs); placement {self.stage_rank} is not one. Ask the "
                "partitioner for a V placement, or use 'zb-h1', which runs any placement"
            )


class ScheduleInterleaved1F1B(Schedule):
    """Megatron-LM's interleaved 1F1B on a looped placement, whole backwards (see the module)."""

    name = "interleaved-1f1b"

    def check_placement(self) -> None:
        if not is_looped(self.stage_rank):
            raise ValueError(
                f"the 'interleaved-1f1b' schedule runs a looped placement (stage s on the GPU of stage s mod P, "
                f"every GPU the same number of stages, e.g. [0, 1, 0, 1]); placement {self.stage_rank} is not "
                "one. Use 'zbv' for a V placement, or '1f1b' or 'zb-h1', which run any placement"
            )

    def global_order(self) -> list[Action]:
        ranks = list(dict.fromkeys(self.stage_rank))  # in the order of their first stage
        num_ranks, per_rank, total = len(ranks), self.num_stages // len(ranks), self.num_microbatches
        # Groups of at least P micro-batches (one group if M < P), the larger first: with M = 5 on
        # P = 4, groups of 4 and 1 deadlock under Megatron's warm-up, one group of 5 does not.
        count = max(1, total // num_ranks)
        sizes = [total // count + (1 if g < total % count else 0) for g in range(count)]
        groups = [range(sum(sizes[:g]), sum(sizes[: g + 1])) for g in range(count)]
        chunks = range(per_rank)
        forwards = [(c, m) for group in groups for c in chunks for m in group]
        backwards = [(c, m) for group in groups for c in reversed(chunks) for m in group]
        rank_orders: dict[int, list[Action]] = {}
        for r, rank in enumerate(ranks):
            fs = [Action(c * num_ranks + r, "F", m) for c, m in forwards]
            bs = [Action(c * num_ranks + r, "B", m) for c, m in backwards]
            later = num_ranks - r - 1  # ranks after this one: one forward each (1F1B), two when interleaved
            warmup = min(later if per_rank == 1 else 2 * later + (per_rank - 1) * sizes[0], len(fs))
            steady = [a for pair in zip(fs[warmup:], bs, strict=False) for a in pair]
            rank_orders[rank] = fs[:warmup] + steady + bs[len(fs) - warmup :]
        return replay_orders(rank_orders, self.stage_rank, self.edges)
