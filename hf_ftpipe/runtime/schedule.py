"""Schedules as data: the ordered list of actions each rank performs in one pipeline step.

An action is ``(stage_index, computation, microbatch_index)`` and prints as ``1F0`` (stage 1,
forward, micro-batch 0) or ``0B3``; `Action.parse` reads that form back. A schedule produces one
*global* order of actions; each rank performs the subsequence that belongs to its stages. Every
rank following one global order that respects the data flow is what makes the step free of
deadlocks, whatever the placement of stages on ranks (non-adjacent stages included).

GPipe, 2 stages on 2 ranks, 3 micro-batches (time flows right)::

    rank 0: 0F0 0F1 0F2                     0B0 0B1 0B2
    rank 1:     1F0 1F1 1F2 1B0 1B1 1B2
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "ScheduleGPipe", "format_actions"]

Computation = Literal["F", "B"]
_ACTION = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward or backward of one micro-batch through one stage."""

    stage_index: int
    computation: Computation
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.computation}{self.microbatch_index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0' or '0B3'")
        return cls(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


class ScheduleGPipe:
    """GPipe (Huang et al., 2019): every forward of the mini-batch, then every backward.

    Forwards run stage by stage in stage order (micro-batches in order within a stage), backwards
    in reverse stage order. One optimizer step follows the step, so the update equals
    single-device training with the micro-batch losses averaged.
    """

    name = "gpipe"

    def __init__(self, stage_rank: Sequence[int], num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        self.stage_rank = list(stage_rank)
        self.num_stages = len(self.stage_rank)
        self.num_microbatches = num_microbatches

    def global_order(self) -> list[Action]:
        stages = range(self.num_stages)
        microbatches = range(self.num_microbatches)
        forwards = [Action(s, "F", m) for s in stages for m in microbatches]
        backwards = [Action(s, "B", m) for s in reversed(stages) for m in microbatches]
        return forwards + backwards

    def actions_of(self, rank: int) -> list[Action]:
        """The actions ``rank`` performs, in order."""
        return [a for a in self.global_order() if self.stage_rank[a.stage_index] == rank]

    def __str__(self) -> str:
        ranks = sorted(set(self.stage_rank))
        return "\n".join(f"rank {r}: {format_actions(self.actions_of(r))}" for r in ranks)


def format_actions(actions: Sequence[Action]) -> str:
    return " ".join(map(str, actions))
