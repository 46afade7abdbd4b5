"""The schedule one rank's engine runs: made for its partition and options, checked against them."""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.schedules.orders import Schedule, make_schedule
from hf_ftpipe.schedules.registry import SCHEDULES, schedule_traits
from hf_ftpipe.schedules.rules import proof_limits

__all__ = ["rank_schedule"]


def rank_schedule(
    name: str,
    specs: Sequence[StageSpec],
    stage_rank: list[int],
    num_microbatches: int,
    *,
    batches_per_step: int,
    gradient_accumulation_steps: int,
    num_slices: int | None,
    weight_prediction: bool,
    layout: ReplicaLayout,
) -> tuple[Schedule, list[int]]:
    """The schedule ``name`` (or a schedule file) over ``specs`` placed by ``stage_rank``, and the in-flight
    limits its messages are held to (`hf_ftpipe.schedules.rules.proof_limits`). ``layout``: the replicas
    the schedule must take (`ReplicaLayout.check_schedule`).

    Raises:
        `PipelineError`: the schedule cannot be made for these stages, or does not take the options
            (``batches_per_step`` > 1 on a streaming schedule, weight prediction on a synchronous one).
    """
    if batches_per_step > 1 and not schedule_traits(name).flushes:
        raise PipelineError(f"the {name!r} schedule streams one mini-batch per step; batches_per_step=1 only")
    edges = sorted({(spec.stage_index, c) for spec in specs for cs in spec.consumers.values() for c in cs})
    try:
        schedule = make_schedule(
            name,
            stage_rank,
            num_microbatches * batches_per_step,
            edges,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_slices=num_slices,
        )
    except ValueError as error:
        raise PipelineError(str(error)) from error
    layout.check_schedule(schedule.traits)
    limits = proof_limits(name, stage_rank, schedule.num_microbatches, sliced=bool(num_slices))
    if weight_prediction and not schedule.traits.weight_prediction:
        predictable = " or ".join(repr(n) for n, t in SCHEDULES.items() if t.weight_prediction)
        raise PipelineError(
            f"weight prediction is for the {predictable} schedule (stale gradients); {name!r} has none to predict"
        )
    return schedule, limits
