"""One rank's programs: a schedule's orders lowered to its actions with their SENDs and RECVs.

The engine runs them (`hf_ftpipe.runtime.engine`) and the simulator replays them in time
(`hf_ftpipe.simulator`): one lowering for both, so what is simulated is what runs. Pure Python.

A flushing step (``gpipe``, ``1f1b``) and an evaluation run the same order every time, so each is
lowered once and kept; a short batch runs the full program less its missing micro-batches (its order
checked first: `hf_ftpipe.schedules.actions.restrict_order`), and a
step with another number of token slices per sequence the program of that number, lowered once
per number. A
streaming step (``async``, ``2bw``) is lowered as it comes, with what the steps before it left
(`hf_ftpipe.schedules.lowering.Lowering` carries it).
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.schedules.actions import Action, restrict_order
from hf_ftpipe.schedules.lowering import Dataflow, Lowering, Op
from hf_ftpipe.schedules.orders import Schedule, ScheduleGPipe, make_schedule

__all__ = ["RankPrograms"]


class RankPrograms:
    """Lowers the schedule's orders into ``rank``'s programs.

    Args:
        schedule (`Schedule`): the step's schedule (its stages' ranks, micro-batches and edges).
        dataflow (`Dataflow`): what the stages exchange (`hf_ftpipe.runtime.messages.dataflow`).
        rank (`int`): the rank whose programs these are.
    """

    def __init__(self, schedule: Schedule, dataflow: Dataflow, rank: int) -> None:
        self.schedule = schedule
        self.dataflow = dataflow
        self.rank = rank
        self._streaming = Lowering(dataflow, schedule.stage_rank)
        """Lowers a streaming schedule's steps, carrying what a step leaves to the next."""
        self._flushing: dict[tuple[bool, int | None], tuple[list[Action], list[Op]]] = {}
        self._short: set[tuple[int | None, int]] = set()
        """The (token slices, micro-batches) of the short training steps whose orders were checked."""

    def reset(self) -> None:
        """Forget what streaming steps carried over (the pipeline is empty)."""
        self._streaming.reset()

    def flushing(self, training: bool, microbatches: int, num_slices: int | None = None) -> list[Op]:
        """The program of one mini-batch of ``microbatches`` micro-batches that flushes (forwards only
        for evaluation), each cut into ``num_slices`` token slices in training (default: the
        schedule's own number).

        The full program is lowered by a `Lowering` of its own: an evaluation must not touch what a
        streaming schedule's steps carry over. A short batch's program is the full one less the
        missing micro-batches' actions and messages, on every rank alike: what remains runs in the
        same relative order, so it cannot deadlock (the order it follows is checked once per size,
        `restrict_order`). Another number of slices is the same schedule
        made for it: every rank derives it from the step's sequence length, so every rank lowers
        the same order.
        """
        num_slices = num_slices if training else None
        order, program = self._full(training, num_slices)
        if microbatches >= self.schedule.num_microbatches:
            return program
        if training and (num_slices, microbatches) not in self._short:  # evaluation: forwards only, in any order
            restrict_order(order, self.schedule.stage_rank, self.schedule.edges, microbatches)
            self._short.add((num_slices, microbatches))
        return [op for op in program if op.microbatch_index < microbatches]

    def streaming(self, order: Sequence[Action]) -> list[Op]:
        """This rank's part of a streaming step (or the drain), lowered with what earlier steps left."""
        return self._streaming.lower(order).get(self.rank, [])

    def _full(self, training: bool, num_slices: int | None) -> tuple[list[Action], list[Op]]:
        key = (training, num_slices)
        if key not in self._flushing:
            if training and num_slices not in (None, self.schedule.num_slices):
                schedule = self.schedule
                order = make_schedule(
                    schedule.name, schedule.stage_rank, schedule.num_microbatches, schedule.edges, num_slices=num_slices
                ).global_order()
            elif training:
                order = self.schedule.global_order()
            else:  # GPipe's forwards: each stage streams its micro-batches on to the next
                stage_rank, edges = self.schedule.stage_rank, self.schedule.edges
                gpipe = ScheduleGPipe(stage_rank, self.schedule.num_microbatches, edges)
                order = [a for a in gpipe.global_order() if a.computation == "F"]
            program = Lowering(self.dataflow, self.schedule.stage_rank).lower(order).get(self.rank, [])
            self._flushing[key] = order, program
        return self._flushing[key]
