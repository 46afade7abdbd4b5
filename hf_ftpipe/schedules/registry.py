"""The schedules by name, each with the traits that the planner and the runtime act on.

This is the one place where schedule names are written: the cost model's `Schedule`, the trainer's
`pipeline_schedule` choices and help, and `make_schedule` all derive from it, and the runtime asks
a schedule's traits (does it flush? how many weight versions? when does it update?) instead of
comparing names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "ScheduleName", "ScheduleTraits", "schedule_traits"]

ScheduleName = Literal["gpipe", "1f1b", "async", "2bw", "zb-h1", "zbv", "interleaved-1f1b", "zb-auto"]
"""The schedules, for type hints and argument parsers; `SCHEDULES` gives each one's traits."""


@dataclass(frozen=True, kw_only=True)
class ScheduleTraits:
    """What a schedule does, in the terms the memory rules and the runtime need. The defaults are
    those of a synchronous schedule like ``1f1b``: each schedule states only where it differs."""

    name: str
    """A `ScheduleName`, or the path of a schedule file (`hf_ftpipe.schedules.from_file`)."""
    help: str
    """One sentence for the trainer's ``pipeline_schedule`` help."""
    flushes: bool = True
    """The pipeline empties at the end of every mini-batch and the caller's optimizer applies its
    gradients (``gpipe``, ``1f1b``); otherwise micro-batches stream from one mini-batch into the
    next and each stage updates inside the pipeline."""
    holds_every_microbatch: bool = False
    """Every forward of a mini-batch runs before its first backward, so a stage holds all its
    micro-batches at once (``gpipe``); otherwise a stage holds one per stage from it to the end."""
    weights: Literal["single", "stashed", "double-buffered"] = "single"
    """``stashed``: a micro-batch's backward uses the weights its forward used, the newest when
    it started (PipeDream's weight stashing); ``double-buffered``: mini-batch b runs on the weights
    from before the previous update (PipeDream-2BW)."""
    updates_every_group: bool = False
    """Streaming only: a stage updates after every ``gradient_accumulation_steps`` backwards, not
    once per mini-batch."""
    weight_prediction: bool = False
    """Whether its gradients are stale in a way weight prediction can extrapolate."""
    token_slices: bool = False
    """Whether it can cut each sequence into token slices (TeraPipe) and pipeline the slices
    (``gpipe``, ``1f1b``). The streaming schedules version weights by sequence: a slice's
    backward must see the weights of its sequence's other slices, so they do not, for now."""
    split_backward: bool = False
    """Whether a backward is split in two actions (Qi et al., ICLR 2024): ``B`` computes only the
    input gradients, which the stage before waits for, and a later ``W`` of the same stage and
    micro-batch the weight gradients, which nothing waits for, so W can fill idle time. What W
    needs (each weighted layer's input and output gradient) is kept between the two."""
    held_by_order: bool = False
    """The micro-batches a stage holds at once are counted from the schedule's own order
    (``interleaved-1f1b``: Megatron's warm-up of 2·(P − r − 1) + (v − 1)·P forwards holds more than
    the depth rule of `hf_ftpipe.schedules.rules.in_flight`); otherwise that rule gives them."""
    v_placement: bool = False
    """It runs only on a V placement, 2 stages per GPU, stage s on GPU min(s, 2P − 1 − s) (``zbv``, a
    file written for one): a planner asks the partitioner for that placement."""

    def update_every(self, num_microbatches: int, gradient_accumulation_steps: int) -> int:
        """Backwards per weight update (for a flushing schedule, the mini-batch's)."""
        return gradient_accumulation_steps if self.updates_every_group else num_microbatches


SCHEDULES: dict[str, ScheduleTraits] = {
    traits.name: traits
    for traits in (
        ScheduleTraits(
            name="gpipe",
            holds_every_microbatch=True,
            token_slices=True,
            help="all forwards, then all backwards, one update per mini-batch.",
        ),
        ScheduleTraits(
            name="1f1b",
            token_slices=True,
            help="the same update with less activation memory (backwards start as soon as they can).",
        ),
        ScheduleTraits(
            name="async",
            flushes=False,
            weights="stashed",
            updates_every_group=True,
            weight_prediction=True,
            help="PipeDream: no flush between mini-batches, each stage updates every "
            "`async_update_interval` micro-batches, weight stashing keeps each micro-batch on one weight "
            "version (fastest; gradients are stale by the pipeline depth).",
        ),
        ScheduleTraits(
            name="2bw",
            flushes=False,
            weights="double-buffered",
            help="PipeDream-2BW: no flush, one update per mini-batch applying the gradient of the weights one "
            "update older, two weight copies.",
        ),
        ScheduleTraits(
            name="zb-h1",
            split_backward=True,
            help="ZB-H1 (zero bubble): 1F1B with each backward split into input gradients and later weight "
            "gradients, which fill the cool-down; 1F1B's memory and update, any placement.",
        ),
        ScheduleTraits(
            name="zbv",
            split_backward=True,
            v_placement=True,
            help="ZB-V (zero bubble): zb-h1's rules on a V placement (2 stages per GPU, stage s on GPU "
            "min(s, 2P-1-s)), nearly bubble-free; the same update as 1f1b.",
        ),
        ScheduleTraits(
            name="interleaved-1f1b",
            held_by_order=True,
            help="Megatron's interleaved 1F1B on a looped placement (stage s on GPU s mod P): a smaller "
            "bubble than 1f1b for the same update.",
        ),
        ScheduleTraits(
            name="zb-auto",
            split_backward=True,
            help="zb-h1's list scheduler timed by the plan's own per-stage F, B and W times (measured ones with "
            "`cost_table='measured'`), so that each GPU fills its idle time with what fits there; run where the "
            "simulator finds it no slower than zb-h1's order and it fits each GPU's memory, else zb-h1's order; "
            "zb-h1's update.",
        ),
    )
}
"""Every schedule's traits, by name, in the order `ScheduleName` lists them."""

SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)

if SCHEDULE_NAMES != get_args(ScheduleName):  # the Literal is for type checkers; the table is the truth
    raise ImportError(f"ScheduleName {get_args(ScheduleName)} and SCHEDULES {SCHEDULE_NAMES} disagree")


def schedule_traits(name: str) -> ScheduleTraits:
    """The traits of schedule ``name``, or of the schedule in the file ``name`` names
    (`hf_ftpipe.schedules.from_file`); `ValueError` naming the valid ones otherwise."""
    traits = SCHEDULES.get(name)
    if traits is None:
        from hf_ftpipe.schedules.from_file import file_traits, is_schedule_file  # a file's schedule builds on these

        if is_schedule_file(name):
            return file_traits(name)
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose one of {list(SCHEDULE_NAMES)}, or give the path of a "
            "schedule file (each rank's actions, as `hf-ftpipe schedule` prints them, or CSV)"
        )
    return traits
