"""The simulator: a plan's schedule replayed in time on each rank's lowered program, before any run.

`simulate` prices every forward, backward and update with per-stage costs (the roofline, or any
per-node costs such as measured ones), sends every message over the profile's link, and returns
the step time, each rank's busy and idle time, the bubble, the throughput, memory over time and
the events themselves (`SimulationResult`). `timeline_bars` is what ``hf-ftpipe simulate --plot``
draws. `auto_schedule` (`plan_auto_schedule` for a plan) builds ``zb-auto``, a zero-bubble order
timed by the plan's own stage costs. Pure Python on the cost model: no process is started.
"""

from hf_ftpipe.simulator.api import simulate, simulate_costs
from hf_ftpipe.simulator.auto_schedule import auto_schedule, plan_auto_schedule
from hf_ftpipe.simulator.bars import Bar, timeline_bars
from hf_ftpipe.simulator.costs import PipelineCosts, StageEdge, costs_from_prediction, pipeline_costs
from hf_ftpipe.simulator.replay import Event, Message
from hf_ftpipe.simulator.result import SimulationResult

__all__ = [
    "Bar",
    "Event",
    "Message",
    "PipelineCosts",
    "SimulationResult",
    "StageEdge",
    "auto_schedule",
    "costs_from_prediction",
    "pipeline_costs",
    "plan_auto_schedule",
    "simulate",
    "simulate_costs",
    "timeline_bars",
]
