"""Pipeline schedules as data: actions, the order each rank runs them in, and their checks.

Pure Python: no torch, so a schedule can be printed and checked without processes.
"""

from hf_ftpipe.schedules.orders import (
    Action,
    Schedule,
    Schedule1F1B,
    ScheduleGPipe,
    StreamingSchedule,
    check_order,
    format_actions,
    make_schedule,
)

__all__ = [
    "Action",
    "Schedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "StreamingSchedule",
    "check_order",
    "format_actions",
    "make_schedule",
]
