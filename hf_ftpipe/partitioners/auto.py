"""`auto`: run every registered partitioner, keep the best feasible plan, report them all.

FTPipe runs several partitioners and keeps the best predicted plan (Eliad et al., ATC'21, §4);
`auto` does the same with whatever is registered (``available_partitioners()``):

1. Run each partitioner (cheap ones first) until ``time_budget_s`` is spent; the first always
   runs, later ones are skipped once the budget is gone, and the report says so.
2. A plan is feasible when its partitioner returned one (a `PartitionError` means it found none)
   and `validate_partition` accepts it with each GPU's memory less the headroom.
3. The best feasible plan has the lowest predicted step time (the slowest GPU, FTPipe's
   objective); on a tie, the lowest peak memory fraction. With ``rank_by="simulated"`` the lowest
   simulated step time instead (`hf_ftpipe.simulator`: the schedule's fill, drain and waits on
   messages included, which the steady-state objective leaves out).
4. No feasible plan: `PlanDoesNotFitError` with each partitioner's reason and, once, what would
   fit: the memory per GPU and the number of these GPUs (``fit.FitAdvice``), with the fixes in
   the words of whoever reads it (the partition API's keywords by default).

The returned plan is the winner's own: its ``partitioner`` field names the algorithm that made it
(e.g. ``"mixed"``), so a plan from `auto` equals one asked of the winner directly. What each
partitioner did is in ``report`` (and `compare_partitioners` returns it), which the CLI prints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from hf_ftpipe._units import GiB, format_bytes
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.fit import FitAdvice
from hf_ftpipe.partitioners.registry import available_partitioners, register_partitioner, run_partitioner
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanOptions, PlanRequest
from hf_ftpipe.plan.validate import validate_partition
from hf_ftpipe.simulator.api import simulate

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "NAME",
    "PartitionerResult",
    "RankBy",
    "best_result",
    "compare_partitioners",
    "no_plan_fits",
    "partition_auto",
    "reason_line",
    "result_of",
    "simulate_results",
]

NAME = "auto"
RankBy = Literal["predicted", "simulated"]
"""What `auto` ranks feasible plans by: the cost model's step time, or the simulated one."""
logger = logging.getLogger(__name__)
# Cheap partitioners first, so a short budget still compares the baselines; others follow by name.
_RUN_ORDER = ("uniform", "params", "seq-greedy", "seq-dp", "mixed")
_UNLIMITED = 2**62  # bytes: "no memory limit" for a profile


@dataclass(kw_only=True)
class PartitionerResult:
    """What one partitioner did for a request: its plan's predicted figures, or why it has none."""

    partitioner: str
    feasible: bool
    time_s: float
    """Wall time the partitioner took (0 when skipped)."""
    throughput_samples_per_s: float | None = None
    step_time_s: float | None = None
    """Predicted time per micro-batch of the slowest GPU (the objective)."""
    worst_over_ideal: float | None = None
    """Slowest GPU / (total compute / GPUs): 1.0 is a perfect balance."""
    max_memory_fraction: float | None = None
    """Peak predicted memory / capacity, over the GPUs (capacity without the headroom)."""
    memory_fraction_per_gpu: list[float] = field(default_factory=list)
    memory_gib_per_gpu: list[float] = field(default_factory=list)
    num_stages: int | None = None
    stages_per_gpu: list[int] = field(default_factory=list)
    error: str | None = None
    """Why the plan is infeasible or missing (``None`` when feasible)."""
    skipped: bool = False
    """Not run: the time budget was spent before its turn."""
    simulated_step_s: float | None = None
    """The simulated step of the plan's schedule, per mini-batch (`simulate_results` fills it)."""
    simulated_bubble: float | None = None
    partition: Partition | None = field(default=None, repr=False)
    """The plan; when infeasible, the one it came closest with, if it made one (or one made
    without a memory limit, for ``unlimited_figures``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (everything but the plan itself)."""
        return {name: value for name, value in self.__dict__.items() if name != "partition"}


def compare_partitioners(
    graph: CostGraph,
    profile: GPUProfile,
    num_stages: int | None = None,
    *,
    time_budget_s: float = 60.0,
    partitioners: Sequence[str] | None = None,
    unlimited_figures: bool = False,
    **options: Unpack[PlanOptions],
) -> list[PartitionerResult]:
    """Run ``partitioners`` (default: every registered one but `auto`) and report each.

    Arguments are those of every partitioner (see ``registry``), plus:

    Args:
        time_budget_s (`float`, *optional*, defaults to 60): no partitioner starts after this
            many seconds (the first always runs).
        unlimited_figures (`bool`, *optional*, defaults to `False`): for a partitioner that finds
            no plan within memory and keeps none that came close, run it again without a memory
            limit and report that plan's figures (still infeasible), so that a comparison shows what
            each would need.
    """
    names = _run_order(available_partitioners() if partitioners is None else list(partitioners))
    if not names:
        raise PartitionError("no partitioner is registered besides 'auto'; import hf_ftpipe.partitioners")
    request = PlanRequest(profile=profile, num_stages=num_stages, **options)
    start = time.perf_counter()
    results = []
    for name in names:
        elapsed = time.perf_counter() - start
        if results and elapsed >= time_budget_s:
            error = f"skipped: the time budget of {time_budget_s:g} s was spent ({elapsed:.1f} s)"
            results.append(PartitionerResult(partitioner=name, feasible=False, time_s=0.0, error=error, skipped=True))
            continue
        results.append(_run_one(name, graph, request, unlimited_figures))
        logger.info("partitioner %s: %s", name, _one_line(results[-1]))
    return results


@register_partitioner(NAME)
def partition_auto(
    graph: CostGraph,
    profile: GPUProfile,
    num_stages: int | None = None,
    *,
    time_budget_s: float = 60.0,
    report: list[PartitionerResult] | None = None,
    rank_by: RankBy = "predicted",
    **options: Unpack[PlanOptions],
) -> Partition:
    """The best feasible plan of every registered partitioner (see the module docstring).

    Args:
        time_budget_s (`float`, *optional*, defaults to 60): no partitioner starts after this.
        report (`list`, *optional*): receives one `PartitionerResult` per partitioner.
        rank_by (`str`, *optional*, defaults to ``"predicted"``): ``"simulated"`` keeps the plan
            whose simulated step is shortest.

    Raises:
        `PlanDoesNotFitError`: no partitioner found a plan that fits; the message says what would fit.
    """
    if rank_by not in get_args(RankBy):
        raise PartitionError(f"unknown `rank_by` {rank_by!r}; use one of {list(get_args(RankBy))}")
    results = compare_partitioners(graph, profile, num_stages, time_budget_s=time_budget_s, **options)
    if rank_by == "simulated":
        simulate_results(results, profile)
    if report is not None:
        report.extend(results)
    best = best_result(results, rank_by)
    if best is None:
        raise no_plan_fits(graph, profile, results, **options)
    logger.info("auto chose %s: %s", best.partitioner, _one_line(best))
    return best.partition  # type: ignore[return-value]  # feasible results carry their plan


def best_result(results: Sequence[PartitionerResult], rank_by: RankBy = "predicted") -> PartitionerResult | None:
    """The feasible result with the lowest step time (predicted, or simulated: `simulate_results`
    first); on a tie (1e-9 relative), the lowest peak memory."""
    time_of = (lambda r: r.step_time_s) if rank_by == "predicted" else (lambda r: r.simulated_step_s)
    feasible = [r for r in results if r.feasible and time_of(r) is not None]
    if not feasible:
        return None
    fastest = min(time_of(r) for r in feasible)
    tied = [r for r in feasible if time_of(r) <= fastest * (1 + 1e-9)]
    return min(tied, key=lambda r: r.max_memory_fraction or 0.0)


def simulate_results(results: Sequence[PartitionerResult], profile: GPUProfile) -> None:
    """Fill each result's simulated step and bubble from its plan (`hf_ftpipe.simulator.simulate`
    on the plan's schedule and micro-batches, over ``profile``'s link)."""
    for result in results:
        plan = result.partition
        if plan is not None and plan.predicted is not None:
            simulated = simulate(plan, profile=profile)
            result.simulated_step_s, result.simulated_bubble = simulated.step_time_s, simulated.bubble_fraction


def result_of(
    name: str, plan: Partition, time_s: float, error: str | None = None, *, capacity_bytes: int | None = None
) -> PartitionerResult:
    """The figures of a plan that has a prediction; feasible unless ``error`` says why not.
    Memory fractions are of ``capacity_bytes`` (default: the capacity the plan was made for)."""
    predicted = plan.predicted
    fractions = [g.memory_bytes / (capacity_bytes or g.capacity_bytes) for g in predicted.gpus]
    return PartitionerResult(
        partitioner=name,
        feasible=error is None,
        time_s=time_s,
        throughput_samples_per_s=predicted.throughput_samples_per_s,
        step_time_s=predicted.step_time_s,
        worst_over_ideal=predicted.imbalance,
        max_memory_fraction=max(fractions, default=0.0),
        memory_fraction_per_gpu=fractions,
        memory_gib_per_gpu=[g.memory_bytes / GiB for g in predicted.gpus],
        num_stages=plan.num_stages,
        stages_per_gpu=[len(plan.stages_on(g)) for g in range(plan.num_devices)],
        error=error,
        partition=plan,
    )


# -- one partitioner ---------------------------------------------------------------------------


def _run_order(names: Sequence[str]) -> list[str]:
    names = [n for n in names if n != NAME]
    known = [n for n in _RUN_ORDER if n in names]
    return known + sorted(n for n in names if n not in known)


def _run_one(name: str, graph: CostGraph, request: PlanRequest, unlimited_figures: bool = False) -> PartitionerResult:
    started = time.perf_counter()
    try:
        plan = run_partitioner(name, graph, request)
    except PartitionError as error:
        time_s = time.perf_counter() - started
        if isinstance(error, PlanDoesNotFitError):  # what would fit is said once, by auto
            reason, near = error.reason, error.advice.plans if error.advice else ()
        else:
            reason, near = str(error), ()
        closest = near[0][1] if near else None
        if closest is None and unlimited_figures:
            closest = _unlimited_plan(name, graph, request)
        if closest is None or closest.predicted is None:
            return PartitionerResult(partitioner=name, feasible=False, time_s=time_s, error=reason)
        return result_of(name, closest, time_s, reason, capacity_bytes=request.profile.memory_bytes)
    time_s = time.perf_counter() - started
    if plan.predicted is None:  # the contract asks for a prediction; make one rather than fail
        plan.predicted = request.estimate(graph, plan.node_stage, plan.stage_device)
    error = None
    try:
        validate_partition(plan, graph, memory_capacity_bytes=request.usable_bytes_per_gpu)
    except PartitionError as invalid:
        error = f"{name} returned a plan that is not usable: {invalid}"
    return result_of(name, plan, time_s, error)


def _unlimited_plan(name: str, graph: CostGraph, request: PlanRequest) -> Partition | None:
    """What partitioner ``name`` makes when memory is no limit (None if it still makes nothing)."""
    unlimited = replace(request, profile=replace(request.profile, memory_bytes=_UNLIMITED))
    try:
        return run_partitioner(name, graph, unlimited)
    except PartitionError:
        return None


def _one_line(result: PartitionerResult) -> str:
    if result.step_time_s is None:
        return f"no plan ({result.error})"
    return (
        f"{result.throughput_samples_per_s:.3g} samples/s, worst/ideal {result.worst_over_ideal:.3f}, "
        f"peak memory {result.max_memory_fraction:.0%} of capacity, {result.num_stages} stages, "
        f"{result.time_s:.2f} s" + ("" if result.feasible else f", infeasible: {result.error}")
    )


# -- nothing fits: what would ------------------------------------------------------------------


def no_plan_fits(
    graph: CostGraph, profile: GPUProfile, results: Sequence[PartitionerResult], **options: Unpack[PlanOptions]
) -> PlanDoesNotFitError:
    """The error when no partitioner fits: each one's reason, then what would fit, said once.

    The advice (``fit.FitAdvice``) takes the least memory of the fullest GPU among the plans the
    partitioners made and the leanest contiguous split, and the fewest of these GPUs that fit, from
    the memory rules the partitioners use; it words the fixes for the reader
    (`PlanDoesNotFitError.message`).
    """
    request = PlanRequest(profile=profile, **(options | {"key": None}))
    memory = request.memory
    lines = [
        f"no partitioner found a plan that fits {profile.count} × {profile.name} "
        f"({format_bytes(request.usable_bytes)} usable per GPU: {format_bytes(profile.memory_bytes)} less "
        f"{memory.headroom:.0%} headroom):"
    ]
    lines += [f"  - {reason_line(r)}" for r in results]
    plans = tuple((r.partitioner, r.partition) for r in results if r.partition is not None)
    return PlanDoesNotFitError("\n".join(lines), FitAdvice(graph=graph, request=request, plans=plans))


def reason_line(result: PartitionerResult) -> str:
    """``"name: why it failed"`` on one line, whole (a cut reason loses the figure that matters)."""
    text = result.error or "no reason given"
    flat = "; ".join(line.strip(" -") for line in text.strip().splitlines() if line.strip())
    if not flat.startswith(f"{result.partitioner}:"):  # errors often name their partitioner already
        flat = f"{result.partitioner}: {flat}"
    return flat
