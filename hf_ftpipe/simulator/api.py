"""`simulate`: a plan's schedule, lowered to each rank's program as the runtime lowers it, replayed in time.

The programs come from the runtime's own lowering (`hf_ftpipe.schedules.programs.RankPrograms` on
the schedule of `hf_ftpipe.schedules.orders.make_schedule`), so what is simulated is what the
executor runs, SENDs and RECVs included; only the data flow is the stage graph's (one message per
pair of stages on different ranks, as the estimate counts them) rather than one per traced value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from hf_ftpipe.costmodel.estimate import gpu_cost_s
from hf_ftpipe.costmodel.op_time import NodeCost
from hf_ftpipe.costmodel.profiles import GPUProfile, get_profile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.schedules.orders import Schedule, StreamingSchedule, make_schedule
from hf_ftpipe.schedules.programs import RankPrograms
from hf_ftpipe.schedules.registry import schedule_traits
from hf_ftpipe.simulator.costs import PipelineCosts, costs_from_prediction, pipeline_costs
from hf_ftpipe.simulator.replay import Replay, stage_dataflow
from hf_ftpipe.simulator.result import SimulationResult, busy_in

__all__ = ["simulate", "simulate_costs"]

STREAMING_STEPS = 5
"""Steps simulated for ``async`` and ``2bw`` by default: the first fills the pipeline, the four
after it are the steady stream (a Mixed-Pipe stream may repeat every two steps)."""


def simulate(
    plan: Partition,
    schedule: str | None = None,
    costs: Mapping[str, NodeCost] | None = None,
    *,
    graph: CostGraph | None = None,
    profile: GPUProfile | str | None = None,
    num_microbatches: int | None = None,
    num_slices: int | None = None,
    steps: int | None = None,
    gradient_accumulation_steps: int = 1,
    gpu_profiles: Sequence[GPUProfile] | None = None,
) -> SimulationResult:
    """Simulate one training step of ``plan`` (the steady step of a streaming schedule).

    Args:
        plan (`Partition`): the plan; a plan file alone is enough (its recorded prediction gives
            each stage's times and the stage graph's bytes).
        schedule (`str`, *optional*): one of `hf_ftpipe.schedules.SCHEDULE_NAMES`; the plan's own by default.
        costs (`Mapping[str, NodeCost]`, *optional*): per-node forward and backward times, e.g.
            measured ones, summed per stage over ``plan.node_stage``; the roofline by default.
        graph (`CostGraph`, *optional*): the plan's graph: message bytes per value that requires
            grad and each stage's own memory, instead of what the plan file records.
        profile (`GPUProfile` or `str`, *optional*): the link (latency, bandwidth) and, with
            ``graph`` and no ``costs``, the roofline; the plan's ``key.gpu_profile`` by default.
        num_microbatches (`int`, *optional*): the plan's ``key.num_microbatches`` by default.
        num_slices (`int`, *optional*): token slices per sequence (``gpipe``, ``1f1b``), each taking
            an equal share of its stage's time.
        steps (`int`, *optional*): steps to simulate; 1 for flushing schedules, 5 for streaming ones
            (the first fills the pipeline; the step time is the mean of the others).
        gradient_accumulation_steps (`int`, defaults to 1): ``async``: backwards per weight update.
        gpu_profiles (`Sequence[GPUProfile]`, *optional*): with ``graph`` and no ``costs``, GPU g's
            own profile when the GPUs differ: each stage is timed on its GPU's roofline (a plan's
            recorded prediction already is, when it was planned with ``gpu_profiles``).
    """
    schedule = schedule or plan.key.schedule
    schedule_traits(schedule)  # an unknown name fails here, naming the valid ones
    num_microbatches = num_microbatches or plan.key.num_microbatches
    link = plan_profile(plan, profile)
    predicted = plan.predicted
    if graph is not None:
        pipeline = pipeline_costs(
            plan,
            graph,
            link,
            costs=costs,
            schedule=schedule,
            num_microbatches=num_microbatches,
            dtype=predicted.dtype if predicted else None,
            recompute=predicted.recompute if predicted else False,
            optimizer=predicted.optimizer if predicted else "adamw",
            microbatch_size=predicted.microbatch_size if predicted else 1,
            gpu_profiles=gpu_profiles,
        )
    else:
        pipeline = costs_from_prediction(plan, link)
        if costs is not None:
            pipeline = _with_node_costs(plan, pipeline, costs)
    result = simulate_costs(
        pipeline,
        schedule,
        num_microbatches,
        num_slices=num_slices,
        steps=steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    if predicted is not None:
        result.analytical_step_s = num_microbatches * _bottleneck_s(pipeline, predicted)
    return result


def simulate_costs(
    costs: PipelineCosts,
    schedule: str | Schedule,
    num_microbatches: int,
    *,
    num_slices: int | None = None,
    steps: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> SimulationResult:
    """Simulate ``schedule`` (a name, a file, or a `Schedule` made for these stages) on a pipeline
    given by its `PipelineCosts` (the tests' toy pipelines)."""
    if num_microbatches < 1:
        raise PartitionError(f"`num_microbatches` must be at least 1, got {num_microbatches}")
    if schedule == "zb-auto":  # the order built for these stages' times, as the trainer runs it
        from hf_ftpipe.simulator.auto_schedule import auto_schedule  # it simulates with this function

        return auto_schedule(costs, num_microbatches)[1]
    edges = sorted({(e.source, e.target) for e in costs.edges})
    try:
        order_maker = (
            schedule
            if isinstance(schedule, Schedule)
            else make_schedule(
                schedule,
                costs.stage_rank,
                num_microbatches,
                edges,
                gradient_accumulation_steps=gradient_accumulation_steps,
                num_slices=num_slices,
            )
        )
    except ValueError as error:
        raise PartitionError(f"cannot simulate this pipeline: {error}") from error
    schedule = order_maker.name
    streaming = isinstance(order_maker, StreamingSchedule)
    steps = steps or (STREAMING_STEPS if streaming else 1)
    if steps < 1 or (streaming and steps < 2):
        raise PartitionError(f"`steps` must be at least {2 if streaming else 1} for {schedule!r}, got {steps}")
    replay = _replay(costs, order_maker, steps, num_slices)
    ranks = range(costs.num_ranks)
    ends = [max(per_rank) for per_rank in replay.step_ends_s]
    # A streaming schedule's first step fills the pipeline; the steps after it are the steady
    # stream, whose pattern may repeat over more than one step (Mixed-Pipe): their mean is the step.
    window = (ends[0], ends[-1]) if streaming else (0.0, ends[0])
    measured = steps - 1 if streaming else 1
    step_s = (window[1] - window[0]) / measured
    # Each rank over a window as long, from its own end of the first step: ranks end a streaming
    # step at staggered times.
    start = replay.step_ends_s[0] if streaming else [0.0] * costs.num_ranks
    length = window[1] - window[0]
    busy = [busy_in(replay.events, r, (start[r], start[r] + length)) / measured for r in ranks]
    samples = num_microbatches * costs.microbatch_size
    return SimulationResult(
        schedule=schedule,
        num_microbatches=num_microbatches,
        num_slices=num_slices,
        num_ranks=costs.num_ranks,
        num_steps=steps,
        step_time_s=step_s,
        window_s=window,
        busy_s=busy,
        idle_s=[step_s - b for b in busy],
        bubble_fraction=1.0 - math.fsum(busy) / (costs.num_ranks * step_s) if step_s > 0 else 0.0,
        throughput_samples_per_s=samples / step_s if step_s > 0 else math.inf,
        microbatch_size=costs.microbatch_size,
        step_ends_s=ends,
        memory=replay.memory,
        peak_memory_bytes=[max(b for _, b in points) for points in replay.memory],
        events=replay.events,
        messages=replay.messages,
        stages=[
            {"stage": s, "rank": r, "forward_s": costs.forward_s[s], "backward_s": costs.backward_s[s]}
            for s, r in enumerate(costs.stage_rank)
        ],
        notes=list(costs.notes),
    )


def _replay(costs: PipelineCosts, order_maker: Schedule, steps: int, num_slices: int | None) -> Replay:
    """Each step's programs, lowered by the engine's `RankPrograms`, replayed one after the other."""
    dataflow = stage_dataflow(costs)
    ranks = range(costs.num_ranks)
    programs = {r: RankPrograms(order_maker, dataflow, r) for r in ranks}
    replay = Replay(costs, dataflow, num_slices, split_backward=order_maker.traits.split_backward)
    for _ in range(steps):
        if isinstance(order_maker, StreamingSchedule):
            order = order_maker.next_step()
            replay.run_step({r: programs[r].streaming(order) for r in ranks})
        else:
            replay.run_step({r: programs[r].flushing(True, order_maker.num_microbatches, num_slices) for r in ranks})
    return replay


def plan_profile(plan: Partition, profile: GPUProfile | str | None = None) -> GPUProfile:
    """The GPUs whose link prices ``plan``'s messages: ``profile`` (a name or a JSON file), else the plan's own."""
    if isinstance(profile, GPUProfile):
        return profile
    name = profile or plan.key.gpu_profile
    try:
        return get_profile(name, count=plan.key.num_gpus)
    except Exception as error:
        raise PartitionError(
            f"cannot find GPU profile {name!r} for the simulated links ({error}); pass `profile=` (a GPUProfile, "
            "a built-in name or a JSON file)"
        ) from error


def _with_node_costs(plan: Partition, pipeline: PipelineCosts, costs: Mapping[str, NodeCost]) -> PipelineCosts:
    """``pipeline`` with each stage's times summed from per-node ``costs`` over ``plan.node_stage``."""
    missing = [n for n in plan.node_stage if n not in costs]
    if missing:
        raise PartitionError(
            f"`costs` has no entry for {len(missing)} ops of the plan, e.g. {missing[:5]}; costs must be keyed by "
            "the plan's op names"
        )
    forward = [0.0] * pipeline.num_stages
    backward = [0.0] * pipeline.num_stages
    for node, s in plan.node_stage.items():
        forward[s] += costs[node].forward_s
        backward[s] += costs[node].backward_s
    if plan.predicted is not None and plan.predicted.recompute:
        backward = [b + f for b, f in zip(backward, forward, strict=True)]
    notes = ["times: the per-node costs given, summed per stage", *pipeline.notes[1:]]
    return replace(pipeline, forward_s=forward, backward_s=backward, notes=notes)


def _bottleneck_s(pipeline: PipelineCosts, predicted: object) -> float:
    """FTPipe's per-micro-batch bottleneck (`gpu_cost_s`) on ``pipeline``'s stage times, with the
    communication the plan's prediction recorded per GPU."""
    gpus = getattr(predicted, "gpus", [])
    cost = 0.0
    for g in range(pipeline.num_ranks):
        compute = math.fsum(
            pipeline.forward_s[s] + pipeline.backward_s[s] for s, r in enumerate(pipeline.stage_rank) if r == g
        )
        if g < len(gpus):
            cost = max(cost, gpu_cost_s(compute, gpus[g].comm_fwd_out_s, gpus[g].comm_bwd_in_s))
        else:
            cost = max(cost, compute)
    return cost
