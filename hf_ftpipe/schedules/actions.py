"""Actions: the forward, backward or weight update of one micro-batch (or one token slice of it) at one stage.

An action is ``(stage_index, computation, microbatch_index)`` and prints as ``1F0`` (stage 1,
forward, micro-batch 0), ``0B3`` (backward) or ``0U3`` (stage 0 updates its weights, right after
the backward of micro-batch 3); `Action.parse` reads that form back, in the manner of
torch.distributed.pipelining's ``_Action``.

A split-backward schedule (``zb-h1``, ``zbv``; Qi et al., ICLR 2024) cuts a backward in two: ``B``
computes only the input gradients, which the stage before waits for, and a later ``W`` of the same
stage and micro-batch (``1W3``) the weight gradients, which nothing downstream waits for — so W can
fill the time a rank would otherwise idle. Under such a schedule every ``sBm`` is followed, later on
the same rank, by exactly one ``sWm``; under the others ``B`` is the whole backward and no ``W`` appears.

Token-level pipelining (TeraPipe, Li et al., 2021) cuts each sequence of a causal LM into slices
along its tokens: ``1F0.2`` is stage 1's forward of slice 2 of micro-batch 0. Token t at a layer
reads only tokens <= t at the layer below, so a slice's forward needs that slice's hidden states
from the stage before and the stage's own keys/values of the earlier slices of the sequence; its
backward needs the gradient from the stage after and the dK/dV that the later slices of the same
sequence accumulated, so a sequence's backwards run from its last slice to its first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Action",
    "Computation",
    "chain_edges",
    "check_order",
    "dependencies",
    "format_actions",
    "restrict_order",
    "stage_neighbours",
    "stage_runs",
]

Computation = Literal["F", "B", "W", "U"]
_ACTION = re.compile(r"^(\d+)([FBWU])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward or backward of one micro-batch through one stage, the weight
    gradients of a split backward (``W``), or a stage's weight update (``U``, numbered by the
    micro-batch whose backward it follows).

    ``slice_index`` is the token slice of the micro-batch's sequences, ``None`` for the whole
    sequence: one more index on the same action, so the checks, the lowering and the printing
    treat a slice as a unit of work like any other.
    """

    stage_index: int
    computation: Computation
    microbatch_index: int
    slice_index: int | None = None

    def __str__(self) -> str:
        text = f"{self.stage_index}{self.computation}{self.microbatch_index}"
        return text if self.slice_index is None else f"{text}.{self.slice_index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0', '0B3', '0W3', '0U3' or '1F0.2'")
        slice_index = None if match[4] is None else int(match[4])
        return cls(int(match[1]), match[2], int(match[3]), slice_index)  # type: ignore[arg-type]


def format_actions(actions: Sequence[Action]) -> str:
    return " ".join(map(str, actions))


def chain_edges(num_stages: int) -> list[tuple[int, int]]:
    """Stage s feeds stage s + 1: the data flow of a plain pipeline."""
    return [(s, s + 1) for s in range(num_stages - 1)]


def stage_neighbours(num_stages: int, edges: Sequence[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """``(producers, consumers)``: per stage, the stages that feed it and those it feeds."""
    producers: list[list[int]] = [[] for _ in range(num_stages)]
    consumers: list[list[int]] = [[] for _ in range(num_stages)]
    for producer, consumer in edges:
        producers[consumer].append(producer)
        consumers[producer].append(consumer)
    return producers, consumers


def stage_runs(stage_rank: Sequence[int], edges: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The stages in runs that a rank can take one micro-batch through back to back: stage s + 1
    joins s's run when both sit on one rank, s feeds only s + 1 and s + 1 reads only s.

    Such a run is one stage split in two on one GPU (a Mixed-Pipe plan does this to balance the
    GPUs). GPipe takes each micro-batch through a whole run, forwards first stage to last and
    backwards last to first: the next GPU gets micro-batch m as soon as the run's GPU can give
    it, where all of stage s's forwards before any of s + 1's hold the next GPU back for a whole
    stage's worth of micro-batches (GPUs [0, 0, 1], forward 0.5/0.5/1, backward 1/1/2, 8
    micro-batches: 27 s, as GPUs [0, 1] with forward 1 and backward 2, instead of 37.5 s)."""
    producers, consumers = stage_neighbours(len(stage_rank), edges)
    runs: list[list[int]] = []
    for s in range(len(stage_rank)):
        p = s - 1
        if runs and stage_rank[p] == stage_rank[s] and consumers[p] == [s] and producers[s] == [p]:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def check_order(
    order: Sequence[Action],
    stage_rank: Sequence[int],
    edges: Sequence[tuple[int, int]],
    microbatches: range,
    num_slices: int | None = None,
    *,
    split_backward: bool = False,
) -> None:
    """Raise `ValueError` unless ``order`` runs every forward and backward of ``microbatches`` (of
    each of their ``num_slices`` token slices, if given) once, each after what it depends on
    (`dependencies`) — a schedule checked without starting any process. With ``split_backward``
    every backward is also followed by its ``W`` (once); without, a ``W`` is an error."""
    num_stages = len(stage_rank)
    producers, consumers = stage_neighbours(num_stages, edges)
    slices: list[int | None] = [None] if num_slices is None else list(range(num_slices))
    done: set[Action] = set()
    for action in order:
        if action.slice_index not in slices:
            expected = "unsliced actions" if num_slices is None else f"slices 0..{num_slices - 1}"
            raise ValueError(f"{action} does not belong to this order, which has {expected}")
        if action.computation == "U":
            continue
        if action.computation == "W" and not split_backward:
            raise ValueError(f"{action} is a weight-gradient action, but this schedule does not split its backwards")
        if action in done:
            raise ValueError(f"{action} appears twice")
        missing = [str(need) for need in dependencies(action, producers, consumers, num_slices) if need not in done]
        if missing:
            raise ValueError(f"{action} comes before {', '.join(missing)}, which it depends on")
        done.add(action)
    expected_actions = {
        Action(s, c, m, i)
        for s in range(num_stages)
        for c in ("FBW" if split_backward else "FB")
        for m in microbatches
        for i in slices  # type: ignore[arg-type]
    }
    if done != expected_actions:
        left = sorted(map(str, expected_actions - done))
        raise ValueError(f"the order misses {len(left)} actions, e.g. {left[:5]}")


def restrict_order(
    order: Sequence[Action], stage_rank: Sequence[int], edges: Sequence[tuple[int, int]], microbatches: int
) -> list[Action]:
    """``order`` less every action of micro-batch ``microbatches`` and later: a short mini-batch's
    order (the last of an epoch), checked (`check_order`) rather than assumed valid.

    It is, for a valid ``order``: every action depends only on actions of its own micro-batch
    (`dependencies`), so dropping whole micro-batches leaves each remaining action after all it
    needs, and a stage never holds more micro-batches at a point of the order than before.
    """
    kept = [a for a in order if a.microbatch_index < microbatches]
    split_backward = any(a.computation == "W" for a in kept)
    sliced = [a.slice_index for a in kept if a.slice_index is not None]
    num_slices = 1 + max(sliced) if sliced else None  # token slices: every slice of a kept micro-batch
    try:
        check_order(kept, stage_rank, edges, range(microbatches), num_slices, split_backward=split_backward)
    except ValueError as error:
        raise ValueError(f"the order of the first {microbatches} micro-batches is not valid: {error}") from None
    return kept


def dependencies(
    action: Action,
    producers: Sequence[Sequence[int]],
    consumers: Sequence[Sequence[int]],
    num_slices: int | None = None,
) -> list[Action]:
    """What ``action`` needs done first: the forwards feeding a forward; a stage's own forward and
    its consumers' backwards for a backward; the backward it follows for a ``W`` or an update.

    A token slice i of micro-batch m also needs, at its own stage, the forward of slice i − 1 (the
    keys/values of the earlier tokens) for its forward, and the backward of slice i + 1 (the dK/dV
    that the later tokens accumulated) for its backward: ``num_slices`` tells which slice is last.
    """
    s, m, i = action.stage_index, action.microbatch_index, action.slice_index
    if i is not None and num_slices is None:
        raise ValueError(f"{action} is a token slice: pass `num_slices` to know which slice is the last")
    if action.computation == "F":
        needs = [Action(p, "F", m, i) for p in producers[s]]
        if i is not None and i > 0:
            needs.append(Action(s, "F", m, i - 1))
        return needs
    if action.computation == "B":
        needs = [Action(s, "F", m, i)] + [Action(c, "B", m, i) for c in consumers[s]]
        if i is not None and num_slices is not None and i + 1 < num_slices:
            needs.append(Action(s, "B", m, i + 1))
        return needs
    return [Action(s, "B", m, i)]
