"""Pipeline schedules as data: the registry of schedules and their traits, actions, the order each
rank runs them in, the lowering that adds the messages, and their checks.

Pure Python: no torch, so a schedule can be printed and checked without processes.
"""

from hf_ftpipe.schedules.actions import Action, chain_edges, check_order, format_actions
from hf_ftpipe.schedules.orders import Schedule, Schedule1F1B, ScheduleGPipe, StreamingSchedule, make_schedule
from hf_ftpipe.schedules.registry import SCHEDULE_NAMES, SCHEDULES, ScheduleName, ScheduleTraits, schedule_traits
from hf_ftpipe.schedules.rules import (
    awaiting_weight_gradients,
    gradients_persist,
    held_at_peaks,
    held_before_backwards,
    in_flight,
    in_flight_limits,
    stage_moments,
    weight_versions,
)

__all__ = [
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleName",
    "ScheduleTraits",
    "StreamingSchedule",
    "awaiting_weight_gradients",
    "chain_edges",
    "check_order",
    "format_actions",
    "gradients_persist",
    "held_at_peaks",
    "held_before_backwards",
    "in_flight",
    "in_flight_limits",
    "make_schedule",
    "schedule_traits",
    "stage_moments",
    "weight_versions",
]
