"""The schedule's rules for memory: micro-batches in flight, weight versions kept, and whether gradients persist.

They are traits of the schedule (`hf_ftpipe.schedules.registry`), read by both the cost model,
which prices a plan with them, and the runtime, whose orders and weight stashing follow them: one
rule, so the memory a plan predicts is the memory the schedule uses.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.schedules.registry import schedule_traits

__all__ = [
    "Moments",
    "State",
    "awaiting_weight_gradients",
    "gradients_persist",
    "held_at_peaks",
    "held_before_backwards",
    "in_flight",
    "in_flight_limits",
    "proof_limits",
    "stage_moments",
    "weight_versions",
]


def in_flight(
    schedule: str,
    stage_index: int,
    stage_device: Sequence[int],
    num_microbatches: int,
    *,
    num_slices: int | None = None,
) -> int:
    """Micro-batches whose activations a stage holds at once (token slices, with ``num_slices``).

    GPipe runs every forward before any backward: all M = ``num_microbatches``. The 1F1B-style
    schedules (``1f1b``, ``async``, ``2bw``) run a backward as soon as one is ready and hold
    min(M, S − ``stage_index``) at a stage, S = ``len(stage_device)``: one micro-batch per stage
    from this one to the end of the pipeline, its depth in stages, whichever GPUs run them.

    Stages, not GPUs: a GPU that runs several stages runs one action at a time, so a micro-batch's
    round trip from a stage to the end and back waits in the queue of every stage it passes, the
    stages that share a GPU included. To keep every GPU busy a stage needs one micro-batch in
    flight per stage downstream. ``hf_ftpipe.schedules.orders`` follows this rule: each rank runs
    its deepest ready stage's action, a backward before a forward, a forward only while the stage
    holds fewer than ``in_flight`` micro-batches. Simulated in that schedule (forward 1, backward
    2, a chain of stages), limits counting each GPU once (the distinct GPUs from the stage on)
    keep the ranks of Mixed placements only 67–80% busy — GPUs [0, 1, 1, 0]: 67%, [0, 1, 2, 2, 1,
    0]: 71%, [0, 1, 2, 3, 3, 2, 1, 0]: 72% — where the depth in stages keeps them 88–97% busy
    (97%, 89%, 88%); a chain of one stage per GPU is 99% busy either way. Stages 0-3 on GPUs
    [0, 1, 1, 0], M ≥ 4::

        stage           0   1   2   3
        GPU             0   1   1   0
        in flight       4   3   2   1

    Token slices (TeraPipe; Seq1F1B's 1F1B): a stage holds k = ``num_slices`` slices per sequence,
    all M·k under GPipe, min(M·k, S − ``stage_index`` + k − 1) under ``1f1b``. A sequence's first
    backward is that of its last slice, so a stage runs all k of its forwards, and then keeps the
    pipeline busy for the round trip to the end, one slice per stage downstream, S − stage_index − 1
    more: a warm-up of S − stage_index + k − 2 forwards, then one forward per backward. Fewer leave
    the stage idle while the last stage works through the sequence (k = 1 is the rule above).

    ``interleaved-1f1b`` (`ScheduleTraits.held_by_order`) holds what its order holds, counted from
    it: Megatron's warm-up runs 2·(P − r − 1) + (v − 1)·P forwards on the rank at position r, more
    than the depth rule on some stages (looped [0, 1, 2, 0, 1, 2], M = 6: 6 6 4 3 3 1, not 6 5 4 3 2 1).

    Args:
        stage_device (`Sequence[int]`): stage index → GPU index, for every stage of the plan.
        num_slices (`int`, *optional*): token slices per sequence; the count is then in slices.
    """
    if not 0 <= stage_index < len(stage_device):
        raise PartitionError(
            f"`stage_index` {stage_index} is outside the plan's stages 0..{len(stage_device) - 1} "
            f"(`stage_device` has {len(stage_device)} entries)"
        )
    k = 1 if num_slices is None else num_slices
    traits = schedule_traits(schedule)
    if traits.holds_every_microbatch:
        return num_microbatches * k
    if traits.held_by_order:
        return _counted(schedule, stage_device, num_microbatches)[0][stage_index]
    return min(num_microbatches * k, len(stage_device) - stage_index + k - 1)


def in_flight_limits(
    schedule: str, stage_device: Sequence[int], num_microbatches: int, *, num_slices: int | None = None
) -> list[int]:
    """`in_flight` of every stage: what the orders (`hf_ftpipe.schedules.orders`) keep to, the
    engine bounds its deliveries by, and the memory rules price."""
    return [
        in_flight(schedule, s, stage_device, num_microbatches, num_slices=num_slices) for s in range(len(stage_device))
    ]


def proof_limits(schedule: str, stage_device: Sequence[int], num_microbatches: int, *, sliced: bool) -> list[int]:
    """Per stage, how far a forward of micro-batch m proves its backwards done: those up to m − the
    limit (`hf_ftpipe.runtime.deliveries`; a stage runs its forwards and backwards in micro-batch
    order and holds at most `in_flight` between them). Token slices go backward last-first, so a
    slice's forward proves nothing of older units' backwards, whatever the slices per step: no
    limit (``sys.maxsize``)."""
    if sliced:
        return [sys.maxsize] * len(stage_device)
    return in_flight_limits(schedule, stage_device, num_microbatches)


def awaiting_weight_gradients(
    schedule: str, stage_index: int, stage_device: Sequence[int], num_microbatches: int
) -> int:
    """Micro-batches whose weight gradients (``W``) a stage may still owe beside the `in_flight`
    ones holding activations: 0 unless the schedule splits its backwards.

    A split backward's ``B`` frees a micro-batch's activations except what its ``W`` reads (for a
    linear layer its input and the gradient of its output), kept until ``W``. ``zb-h1`` and
    ``zbv`` let a stage keep min(M, S + 1) micro-batches between F and W (S stages, M
    micro-batches; `hf_ftpipe.schedules.zero_bubble`), at most `in_flight` of them between F and B:
    the memory peaks with `in_flight` holding activations and the rest, min(M, S + 1) −
    `in_flight`, holding W's inputs (those are smaller than the activations). Stages 0-1 on GPUs
    [0, 1], M = 4: in flight 2 and 1, awaiting W 1 and 2. A schedule from a file
    (`ScheduleTraits.held_by_order`) keeps what its order keeps, counted from it.
    """
    traits = schedule_traits(schedule)
    if not traits.split_backward:
        return 0
    if traits.held_by_order:
        held, kept, *_ = _counted(schedule, stage_device, num_microbatches)
        return kept[stage_index] - held[stage_index]
    kept_at_most = min(num_microbatches, len(stage_device) + 1)
    return kept_at_most - in_flight(schedule, stage_index, stage_device, num_microbatches)


State = tuple[tuple[int, int, int], ...]
"""Per stage of the plan: (micro-batches holding activations, awaiting ``W``, 1 before its first ``W``)."""


def held_at_peaks(schedule: str, stage_device: Sequence[int], num_microbatches: int) -> list[list[State]] | None:
    """What each GPU holds after each of its actions in the schedule's order: per GPU, the
    distinct states it passes through, each a triple (micro-batches holding activations, micro-batches
    holding only what ``W`` reads, 1 while the stage has run no ``W`` yet in the step, so that its
    products' weight gradients do not exist yet) for every stage of the plan (0, 0, 0 for another
    GPU's stages).
    ``None`` for a schedule priced by the per-stage rules alone (`in_flight`,
    `awaiting_weight_gradients`).

    The per-stage rules bound each stage by its own busiest moment; a GPU with several stages
    (a V, a looped placement) holds the sum of those only if they coincide, and in a fixed order
    they do not: ``interleaved-1f1b`` on [0, 1, 0, 1], M = 4, holds at most 4 and 2 micro-batches
    on stages 0 and 2 but 5 at once, not 6 (stage 0 reaches 4 once stage 2 is down to 1); ``zbv``'s
    first stage holds at most 3, its depth rule says 4. A GPU holds what the actions it runs leave,
    whatever the others' timing, so the states of its own order are exact. Counted for the
    schedules whose order is fixed by the plan alone: those with a split backward and those held
    by their order (`ScheduleTraits.held_by_order`).
    """
    traits = schedule_traits(schedule)
    if not (traits.split_backward or traits.held_by_order):
        return None
    return _counted(schedule, stage_device, num_microbatches)[2]


def held_before_backwards(
    schedule: str, stage_device: Sequence[int], num_microbatches: int
) -> list[list[tuple[int, State]]] | None:
    """The moments a backward runs: per GPU, for each of its ``B`` actions, the stage and what the
    GPU holds just before it (`held_at_peaks`'s states). ``None`` where `held_at_peaks` is.

    A backward's working memory sits on the state before it, not after: the state after ``B`` has
    let the micro-batch's activations go and, for a recomputed stage, counts what ``W`` reads, which
    ``B`` builds from the activations it rebuilds. zb-h1 on [0, 1], M = 4: GPU 1 runs 1B2 holding one
    micro-batch and two awaiting ``W``.
    """
    if held_at_peaks(schedule, stage_device, num_microbatches) is None:
        return None
    return _counted(schedule, stage_device, num_microbatches)[3]


Moments = tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]
"""A stage's `State` triples at the moments that can be its busiest, and as its backwards start."""


def stage_moments(schedule: str, stage_device: Sequence[int], num_microbatches: int) -> list[Moments] | None:
    """Per stage, the walk's moments that can be its busiest, each stage on its own: its triples
    (`State`) in its GPU's states (`held_at_peaks`), and as each of its backwards starts
    (`held_before_backwards`), less those another triple of the list beats in every place (more
    activations, more awaiting ``W``, no later first ``W``). ``None`` where `held_at_peaks` is.

    What a partitioner prices a candidate stage with (`hf_ftpipe.partitioners.chain`), before it
    knows its GPU's other stages: a stage at its own busiest moment of the order bounds what it
    adds to its GPU at any moment, so a GPU whose stages each fit their share fits the walk, and a
    stage alone on its GPU is priced as the walk prices the GPU. The per-stage rules (`in_flight`,
    `awaiting_weight_gradients`) bound a stage only while a micro-batch's activations outweigh what
    its ``W`` reads; under recomputation they keep only the stage's inputs, and a stage holding
    W's inputs for every micro-batch passes the rules' figure (T5-3B's ``zbv`` V by 3-9 GiB a GPU).
    zb-h1 on [0, 1], M = 4: stage 0 holds at most 2 micro-batches' activations and 1 awaiting
    ``W`` before its first ``W``, or 1 and 2 after it: ``[(1, 2, 0), (2, 1, 1)]``.
    """
    states = held_at_peaks(schedule, stage_device, num_microbatches)
    moments = held_before_backwards(schedule, stage_device, num_microbatches)
    if states is None or moments is None:
        return None
    return [
        (
            _maximal({state[s] for state in states[gpu]}),
            _maximal({state[s] for t, state in moments[gpu] if t == s}),
        )
        for s, gpu in enumerate(stage_device)
    ]


def _maximal(triples: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The triples of ``triples`` that no other one beats in every place, in order."""

    def beats(o: tuple[int, int, int], c: tuple[int, int, int]) -> bool:
        return o != c and o[0] >= c[0] and o[1] >= c[1] and o[2] <= c[2]

    return sorted(c for c in triples if not any(beats(o, c) for o in triples))


def _counted(
    schedule: str, stage_device: Sequence[int], num_microbatches: int
) -> tuple[list[int], list[int], list[list[State]], list[list[tuple[int, State]]]]:
    """Per stage, the most micro-batches between F and B, and between F and W, in the schedule's
    order; per GPU the states of `held_at_peaks` and the moments of `held_before_backwards` (a
    schedule file is read again when it changes)."""
    version = os.stat(schedule).st_mtime_ns if os.path.isfile(schedule) else 0
    return _held_by_order(schedule, tuple(stage_device), num_microbatches, version)


@functools.lru_cache(maxsize=64)
def _held_by_order(
    schedule: str, stage_device: tuple[int, ...], num_microbatches: int, version: int
) -> tuple[list[int], list[int], list[list[State]], list[list[tuple[int, State]]]]:
    from hf_ftpipe.schedules.orders import make_schedule  # the orders build on these rules

    try:
        order = make_schedule(schedule, stage_device, num_microbatches).global_order()
    except ValueError as error:
        raise PartitionError(str(error)) from error
    num_stages = len(stage_device)
    split = schedule_traits(schedule).split_backward
    count = {c: [0] * num_stages for c in "FBW"}
    held, kept = [0] * num_stages, [0] * num_stages
    num_gpus = max(stage_device, default=-1) + 1
    states: list[dict[State, None]] = [{} for _ in range(num_gpus)]
    before_backward: list[dict[tuple[int, State], None]] = [{} for _ in range(num_gpus)]

    def state_of(gpu: int) -> State:
        return tuple(
            (
                count["F"][t] - count["B"][t],
                count["B"][t] - count["W"][t] if split else 0,
                int(split and count["W"][t] == 0),
            )
            if stage_device[t] == gpu
            else (0, 0, 0)
            for t in range(num_stages)
        )

    for action in order:
        s = action.stage_index
        gpu = stage_device[s]
        if action.computation == "B":
            before_backward[gpu][s, state_of(gpu)] = None
        if action.computation in count:
            count[action.computation][s] += 1
        held[s] = max(held[s], count["F"][s] - count["B"][s])
        kept[s] = max(kept[s], count["F"][s] - count["W"][s])
        states[gpu][state_of(gpu)] = None
    return held, kept, [list(gpu_states) for gpu_states in states], [list(moments) for moments in before_backward]


def weight_versions(
    schedule: str,
    stage_index: int,
    stage_device: Sequence[int],
    *,
    num_microbatches: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> int:
    """Copies of its weights a stage keeps: flushing schedules (``gpipe``, ``1f1b``) one, 2BW two,
    ``async`` (PipeDream's weight stashing) one per weight version still in flight.

    Under ``async`` the forward and backward of a micro-batch use the same version. A stage has
    k = ``in_flight(...)`` micro-batches between their forward and backward (S − ``stage_index``
    in the steady state, S = ``len(stage_device)``, stages sharing a GPU counted separately;
    ``num_microbatches`` caps it when given). They are k consecutive micro-batches, and the
    weights change once every G = ``gradient_accumulation_steps`` of them, so they span at most
    ⌈(k − 1) / G⌉ + 1 versions; the newest of those is the current weights. G = 1 gives k:
    PipeDream's "depth d from the end keeps d + 1 versions"::

        k = 4, G = 1: micro-batches 5 6 7 8 → versions 5 6 7 8    (4 copies)
        k = 4, G = 2: micro-batches 5 6 7 8 → versions 2 3 3 4    (⌈3/2⌉ + 1 = 3 copies)

    Args:
        stage_device (`Sequence[int]`): stage index → GPU index, for every stage of the plan.
        num_microbatches (`int`, *optional*): caps k; the steady state's k when not given.
    """
    weights = schedule_traits(schedule).weights
    if weights == "double-buffered":
        return 2
    if weights == "single":
        return 1
    # No cap given: S − stage_index, which never exceeds len(stage_device).
    cap = len(stage_device) if num_microbatches is None else num_microbatches
    k = in_flight(schedule, stage_index, stage_device, cap)
    return -(-(k - 1) // gradient_accumulation_steps) + 1


def gradients_persist(
    schedule: str,
    stage_index: int,
    stage_device: Sequence[int],
    num_microbatches: int,
    *,
    gradient_accumulation_steps: int = 1,
    recompute: bool = False,
) -> bool:
    """Whether a stage's weight gradients stay in memory beside a full micro-batch of activations.

    Gradients appear in a backward and go at the update that applies them (``Trainer`` frees them
    between steps). They sit beside the activations of every micro-batch in flight when a forward
    can run between the first backward that adds to them and that update, and, under
    recomputation, beside the activations each later backward of the step rebuilds:

    - ``async`` with an update every micro-batch (G = ``gradient_accumulation_steps`` = 1): no,
      the update follows the backward at once. With G > 1: yes.
    - ``2bw``: yes; it updates once per mini-batch and never flushes.
    - ``gpipe``: no for a stage alone on its GPU, which runs every forward of the step before its
      first backward; yes where the GPU runs other stages too, whose backwards interleave; yes
      under recomputation with several micro-batches.
    - ``1f1b``: like ``gpipe`` when the stage holds every micro-batch of the step
      (``in_flight`` = M); otherwise yes.

    Where they do not persist, a backward turns the activations it frees into gradients, and only
    the gradients beyond those activations add to the peak (``backward_bytes``).
    """
    traits = schedule_traits(schedule)
    if not traits.flushes and traits.updates_every_group:  # async: the update follows the backward
        return gradient_accumulation_steps > 1
    if not traits.flushes or (recompute and num_microbatches > 1):
        return True
    alone = sum(1 for device in stage_device if device == stage_device[stage_index]) == 1
    if traits.holds_every_microbatch:
        return not alone
    return not (alone and in_flight(schedule, stage_index, stage_device, num_microbatches) == num_microbatches)
