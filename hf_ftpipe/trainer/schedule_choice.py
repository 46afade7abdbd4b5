"""``pipeline_schedule``: a registered schedule's name or a schedule file, and what follows from it.

One place turns the argument into traits (`schedule_traits`), whichever it is, so the arguments,
the data loading, the plan and the engine ask the same question the same way. A file
(`hf_ftpipe.schedules.from_file`) fixes what a name leaves to the plan: its stages' ranks and its
number of micro-batches. Its number must be that of one flush, ``num_microbatches`` ×
``gradient_accumulation_steps``; a step with fewer micro-batches (the last, short batch of an
epoch, or an incomplete accumulation window) runs the file's order less every action of the
missing ones, checked before it runs (`hf_ftpipe.schedules.actions.restrict_order`). A file for
fewer micro-batches than a flush is refused rather than repeated: its order says nothing of how
two copies would interleave.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.schedules.from_file import is_schedule_file, summarize_file
from hf_ftpipe.schedules.registry import SCHEDULE_NAMES, SCHEDULES, ScheduleTraits, schedule_traits
from hf_ftpipe.schedules.zero_bubble import is_v_shape

if TYPE_CHECKING:
    from hf_ftpipe.plan.request import Placement

__all__ = ["SCHEDULE_HELP", "check_schedule_argument", "planned_placement"]

SCHEDULE_HELP = (
    "Pipeline schedule: one of "
    + " ".join(f"'{traits.name}': {traits.help}" for traits in SCHEDULES.values())
    + " Or the path of a schedule file: each rank's actions in order, as `hf-ftpipe schedule` prints them "
    "(one line per rank) or as CSV (one row per rank), for `num_microbatches` x `gradient_accumulation_steps` "
    "micro-batches on the plan's stages; checked before it runs. `activation_checkpointing=True` (formerly "
    "`gradient_checkpointing`) recomputes each stage's activations under any schedule."
)


def check_schedule_argument(schedule: str, num_microbatches: int, gradient_accumulation_steps: int) -> ScheduleTraits:
    """The traits of ``pipeline_schedule``; `ValueError` naming both kinds of choice for neither a
    name nor a file, and the fix for a file made for another number of micro-batches."""
    try:
        traits = schedule_traits(schedule)
    except ValueError as error:
        raise ValueError(f"`pipeline_schedule={schedule!r}`: {error}") from None
    if schedule in SCHEDULE_NAMES:
        return traits
    given = summarize_file(schedule).num_microbatches
    flush = num_microbatches * gradient_accumulation_steps
    if given != flush:
        raise ValueError(
            f"`pipeline_schedule={schedule!r}` orders {given} micro-batches, but each optimizer step runs "
            f"num_microbatches={num_microbatches} x gradient_accumulation_steps={gradient_accumulation_steps} = "
            f"{flush} in one flush; write the file for {flush} (`hf-ftpipe schedule --num-microbatches {flush} ...`), "
            f"or set num_microbatches and gradient_accumulation_steps to make {given}. A step with fewer "
            "(a short last batch) runs the file's order less the missing micro-batches' actions"
        )
    return traits


def planned_placement(schedule: str) -> tuple[Placement, int | None]:
    """The placement and number of stages to plan for: a V for a schedule that runs only one
    (`ScheduleTraits.v_placement`); a file's own, a chain or a V (for another, which no partitioner
    is asked for, a `PartitionError` says to give that plan in ``partition_file``); else a chain, as many
    stages as the partitioner chooses."""
    traits = schedule_traits(schedule)
    if not is_schedule_file(schedule):
        return ("v" if traits.v_placement else "chain"), None
    stage_rank = summarize_file(schedule).stage_rank
    if stage_rank is None or not (stage_rank == list(range(len(stage_rank))) or is_v_shape(stage_rank)):
        where = "names a stage on two ranks or leaves one out" if stage_rank is None else f"places {stage_rank}"
        raise PartitionError(
            f"`pipeline_schedule={schedule!r}` {where}; the partitioners plan a chain (stage s on rank s) or a V "
            "(stage s on rank min(s, 2P-1-s)): write the file for one of them, or give a plan with its placement "
            "in `partition_file`"
        )
    return ("v" if traits.v_placement else "chain"), len(stage_rank)
