"""``zb-auto``: a zero-bubble order built for a plan from its stages' F, B and W times, checked by the simulator.

In the manner of the automatic scheduling of "Zero Bubble Pipeline Parallelism" (Qi et al., ICLR
2024), which builds a schedule from measured F, B and W times and a memory limit: the same list
scheduler as ``zb-h1`` (`hf_ftpipe.schedules.zero_bubble.zero_bubble_order`), within its memory
bounds, but timed by the plan's own per-stage times (`PipelineCosts`: the roofline's, or measured
ones where a cost table exists) instead of one unit each, on the plan's placement, Mixed-Pipe
included. Where the stages are unequal, a rank then fills its idle time with the actions that
really fit it. The order is checked (every dependency, no deadlock: `GivenSchedule`) and
replayed by the simulator against ``zb-h1``'s; the faster one is kept, so it is never slower
there. It is handed on as a file (``str(schedule)``, the text ``hf-ftpipe schedule`` prints),
which `make_schedule`, the cost model and the simulator take as a path
(`hf_ftpipe.schedules.from_file`): what runs is what was simulated.
"""

from __future__ import annotations

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.schedules.from_file import GivenSchedule
from hf_ftpipe.schedules.orders import Schedule, make_schedule
from hf_ftpipe.schedules.zero_bubble import zero_bubble_order
from hf_ftpipe.simulator.api import plan_profile, simulate_costs
from hf_ftpipe.simulator.costs import PipelineCosts, costs_from_prediction
from hf_ftpipe.simulator.result import SimulationResult

__all__ = ["auto_schedule", "plan_auto_schedule"]


def auto_schedule(costs: PipelineCosts, num_microbatches: int) -> tuple[Schedule, SimulationResult]:
    """The ``zb-auto`` schedule of the pipeline ``costs`` describes and its simulated step (see the
    module); ``zb-h1``'s where that simulates faster."""
    edges = sorted({(e.source, e.target) for e in costs.edges})
    stage_costs = []
    for s, forward in enumerate(costs.forward_s):
        backward, weight = costs.split_s(s)
        stage_costs.append({"F": forward, "B": backward, "W": weight})
    order = zero_bubble_order(costs.stage_rank, num_microbatches, edges, stage_costs)
    orders = {r: [a for a in order if costs.stage_rank[a.stage_index] == r] for r in sorted(set(costs.stage_rank))}
    built: Schedule = GivenSchedule("zb-auto", orders, costs.stage_rank, num_microbatches, edges)
    result = simulate_costs(costs, built, num_microbatches)
    fixed = make_schedule("zb-h1", costs.stage_rank, num_microbatches, edges)
    baseline = simulate_costs(costs, fixed, num_microbatches)
    return (fixed, baseline) if baseline.step_time_s < result.step_time_s else (built, result)


def plan_auto_schedule(
    plan: Partition, *, profile: GPUProfile | str | None = None, num_microbatches: int | None = None
) -> tuple[Schedule, SimulationResult]:
    """`auto_schedule` for ``plan``, timed by its recorded per-stage prediction (measured where the
    plan was priced by a cost table: ``hf-ftpipe simulate --costs``)."""
    costs = costs_from_prediction(plan, plan_profile(plan, profile))
    return auto_schedule(costs, num_microbatches or plan.key.num_microbatches)
