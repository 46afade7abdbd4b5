"""Pipeline runtime: stages built from the exported graph, schedules as data, the per-rank engine."""

from .comm import Messenger
from .engine import PipelineEngine, StagePlacement
from .peak_memory import PeakMemory
from .schedule import Action, ScheduleGPipe, format_actions
from .stage import StageSpec, build_stage_module, plan_stages
from .watchdog import Watchdog

__all__ = [
    "Action",
    "Messenger",
    "PeakMemory",
    "PipelineEngine",
    "ScheduleGPipe",
    "StagePlacement",
    "Watchdog",
    "StageSpec",
    "build_stage_module",
    "format_actions",
    "plan_stages",
]
