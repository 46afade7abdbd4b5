"""Actions: the forward, backward or weight update of one micro-batch at one stage.

An action is ``(stage_index, computation, microbatch_index)`` and prints as ``1F0`` (stage 1,
forward, micro-batch 0), ``0B3`` (backward) or ``0U3`` (stage 0 updates its weights, right after
the backward of micro-batch 3); `Action.parse` reads that form back, in the manner of
torch.distributed.pipelining's ``_Action``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Computation", "chain_edges", "check_order", "dependencies", "format_actions"]

Computation = Literal["F", "B", "U"]
_ACTION = re.compile(r"^(\d+)([FBU])(\d+)$")


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


def dependencies(
    action: Action, producers: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]]
) -> list[tuple[int, str, int]]:
    """What ``action`` needs done first: the forwards feeding a forward; a stage's own forward and
    its consumers' backwards for a backward; the backward it follows for an update."""
    s, m = action.stage_index, action.microbatch_index
    if action.computation == "F":
        return [(p, "F", m) for p in producers[s]]
    if action.computation == "B":
        return [(s, "F", m)] + [(c, "B", m) for c in consumers[s]]
    return [(s, "B", m)]
