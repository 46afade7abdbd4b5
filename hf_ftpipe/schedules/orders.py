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
forwards and a rank's stages sharing its time. With one stage per rank it yields the textbook
orders::

    1f1b, 2 stages on 2 ranks, 4 micro-batches
    rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

``gpipe`` and ``1f1b`` also run token slices (TeraPipe, Li et al., 2021; ``num_slices``): the unit
of work is one slice of one micro-batch's sequences (``1F0.2``), a stage's forwards take the
sequences in order and their slices in order, and a sequence's backwards run from its last slice
to its first. Under ``1f1b`` (Seq1F1B's order, Sun et al., 2024) a stage holds up to
S − stage_index + k − 1 slices (`in_flight`): 2 stages, 1 micro-batch of 3 slices::

    rank 0: 0F0.0 0F0.1 0F0.2 0B0.2 0B0.1 0B0.0
    rank 1: 1F0.0 1F0.1 1F0.2 1B0.2 1B0.1 1B0.0
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.schedules._simulation import Simulation
from hf_ftpipe.schedules.actions import Action, chain_edges, check_order, dependencies, format_actions, stage_runs
from hf_ftpipe.schedules.registry import SCHEDULES, ScheduleName, ScheduleTraits, schedule_traits
from hf_ftpipe.schedules.rules import in_flight_limits

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


class Schedule:
    """A flushing schedule: the global order of one mini-batch's actions.

    Args:
        stage_rank (`Sequence[int]`): the rank running each stage.
        num_microbatches (`int`): micro-batches per mini-batch.
        edges (`Sequence[tuple[int, int]]`, *optional*): ``(producer, consumer)`` stage pairs; a chain
            by default. The engine passes the real data flow of the plan.
        num_slices (`int`, *optional*): token slices per sequence (schedules whose traits have
            ``token_slices``); ``None``, the default, runs whole sequences.
    """

    name: ScheduleName

    @property
    def traits(self) -> ScheduleTraits:
        """What the schedule does (`hf_ftpipe.schedules.registry`): the runtime acts on these."""
        return schedule_traits(self.name)

    def __init__(
        self,
        stage_rank: Sequence[int],
        num_microbatches: int,
        edges: Sequence[tuple[int, int]] | None = None,
        num_slices: int | None = None,
    ) -> None:
        if num_slices is not None:
            _check_slices(self.name, num_slices)
        self.num_slices = num_slices
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
        self.check_placement()

    def check_placement(self) -> None:
        """Raise `ValueError`, naming the placements that fit, where the schedule does not run
        ``stage_rank`` (``zbv``: a V; ``interleaved-1f1b``: a loop); the others run any."""

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
    then backwards in reverse stage order; consecutive stages that one rank runs back to back
    (`stage_runs`) take each micro-batch through all of them at once. One optimizer step
    follows; the update equals single-device training with the micro-batch losses averaged.

    GPipe, 2 stages on 2 ranks, 3 micro-batches (time flows right)::

        rank 0: 0F0 0F1 0F2                     0B0 0B1 0B2
        rank 1:     1F0 1F1 1F2 1B0 1B1 1B2
    """

    name = "gpipe"

    def global_order(self) -> list[Action]:
        # A run of stages on one rank (`stage_runs`, one stage split in two) goes as one stage: a
        # micro-batch through all of it, first stage to last forward, last to first backward.
        runs = stage_runs(self.stage_rank, self.edges)
        microbatches = range(self.num_microbatches)
        # Token slices: the units (micro-batch, slice) in order, backward in exact reverse, since a
        # slice's backward waits for the dK/dV of the later slices of its sequence.
        units: list[tuple[int, int | None]] = [(m, None) for m in microbatches]
        backward_units = units
        if self.num_slices is not None:
            units = [(m, i) for m in microbatches for i in range(self.num_slices)]
            backward_units = units[::-1]
        forwards = [Action(s, "F", m, i) for run in runs for m, i in units for s in run]
        backwards = [Action(s, "B", m, i) for run in reversed(runs) for m, i in backward_units for s in reversed(run)]
        return forwards + backwards


class Schedule1F1B(Schedule):
    """PipeDream-Flush: one backward as soon as it is ready, at most `in_flight` micro-batches
    held per stage, flushed at the end of the mini-batch (same update as GPipe, less memory)."""

    name = "1f1b"

    def global_order(self) -> list[Action]:
        held = in_flight_limits("1f1b", self.stage_rank, self.num_microbatches, num_slices=self.num_slices)
        simulation = Simulation(self.stage_rank, self.edges, held, num_slices=self.num_slices)
        order = simulation.run(available=self.num_microbatches)
        simulation.check_finished(self.num_microbatches * (self.num_slices or 1))
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
        name: ScheduleName,
        stage_rank: Sequence[int],
        num_microbatches: int,
        edges: Sequence[tuple[int, int]] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        super().__init__(stage_rank, num_microbatches, edges)
        streaming = [n for n, traits in SCHEDULES.items() if not traits.flushes]
        if name not in streaming:
            raise ValueError(f"a streaming schedule is one of {streaming}, got {name!r}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be at least 1, got {gradient_accumulation_steps}")
        self.name = name
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.update_every = self.traits.update_every(num_microbatches, gradient_accumulation_steps)
        self.reset()

    def reset(self) -> None:
        """Start again from an empty pipeline."""
        held = in_flight_limits(self.name, self.stage_rank, self.num_microbatches)
        self._simulation = Simulation(self.stage_rank, self.edges, held, update_every=self.update_every)
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
        held: set[Action] = set()
        taken, kept = [], []
        for action in pending:
            rank = self.stage_rank[action.stage_index]
            hold = rank in blocked_ranks or (action.computation == "F" and action.microbatch_index >= limit)
            if not hold:
                hold = any(
                    dep in held for dep in dependencies(action, self._simulation.producers, self._simulation.consumers)
                )
            if hold:
                held.add(action)
                blocked_ranks.add(rank)
                kept.append(action)
            else:
                taken.append(action)
        return taken, kept

    def global_order(self) -> list[Action]:
        """One mini-batch from an empty pipeline, drained: what `__str__` prints."""
        probe = StreamingSchedule(
            self.name,
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
    num_slices: int | None = None,
) -> Schedule:
    """The schedule called ``name`` (one of `ScheduleName`, or a file of per-rank orders:
    `hf_ftpipe.schedules.from_file`), chosen by its traits; with ``num_slices``, over that many
    token slices per sequence (``gpipe`` and ``1f1b`` only)."""
    traits = schedule_traits(name)
    if num_slices is not None:
        _check_slices(name, num_slices)
    from hf_ftpipe.schedules import from_file, zero_bubble  # they build on `Schedule`

    if name not in SCHEDULES:  # a file (`schedule_traits` refused any other name)
        return from_file.FileSchedule(name, stage_rank, num_microbatches, edges)

    ordered = {
        c.name: c
        for c in (
            zero_bubble.ScheduleZeroBubbleH1,
            zero_bubble.ScheduleZeroBubbleAuto,
            zero_bubble.ScheduleZBV,
            zero_bubble.ScheduleInterleaved1F1B,
        )
    }
    if name in ordered:
        return ordered[name](stage_rank, num_microbatches, edges)
    if not traits.flushes:
        return StreamingSchedule(
            traits.name, stage_rank, num_microbatches, edges, gradient_accumulation_steps=gradient_accumulation_steps
        )
    if traits.holds_every_microbatch:
        return ScheduleGPipe(stage_rank, num_microbatches, edges, num_slices)
    return Schedule1F1B(stage_rank, num_microbatches, edges, num_slices)


def _check_slices(name: str, num_slices: int) -> None:
    if not schedule_traits(name).token_slices:
        takers = [n for n, traits in SCHEDULES.items() if traits.token_slices]
        raise ValueError(
            f"schedule {name!r} does not take token slices (streaming schedules version weights by sequence, "
            f"not by slice); schedules that do: {takers}"
        )
    if num_slices < 1:
        raise ValueError(f"num_slices must be at least 1, got {num_slices}")
