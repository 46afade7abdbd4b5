"""What a simulation returns: the step time, each rank's busy and idle time, the bubble, the
throughput, memory over time and every event, as plain data with a JSON form for benchmarks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hf_ftpipe.simulator.replay import Event, Message

__all__ = ["SimulationResult", "busy_in"]


@dataclass(kw_only=True)
class SimulationResult:
    """The simulated timeline of a pipeline and its figures.

    The figures are taken over ``window_s``: a flushing schedule's (``gpipe``, ``1f1b``) only step,
    from 0 to its last rank's end; for a streaming schedule (``async``, ``2bw``) every step after
    the first, which fills the pipeline (the stream never empties, so a step's time is the mean
    interval between the ends of consecutive steps: the steady state).
    """

    schedule: str
    num_microbatches: int
    num_slices: int | None
    num_ranks: int
    num_steps: int
    step_time_s: float
    """Seconds per mini-batch of ``num_microbatches`` micro-batches (the window's length over the
    steps in it)."""
    window_s: tuple[float, float]
    busy_s: list[float]
    """Per rank, time spent in actions per step: for a streaming schedule, over a window as long as
    ``window_s`` from the rank's own end of the first step (ranks end a step at staggered times)."""
    idle_s: list[float]
    bubble_fraction: float
    """1 − Σ busy / (ranks × step time): the share of the ranks' time spent waiting."""
    throughput_samples_per_s: float
    """``num_microbatches × microbatch_size / step_time_s``."""
    microbatch_size: int
    step_ends_s: list[float]
    """When the last rank finished each simulated step."""
    memory: list[list[tuple[float, int]]]
    """Per rank, ``(time_s, bytes)`` at each change of what it holds (a step function)."""
    peak_memory_bytes: list[int]
    events: list[Event]
    messages: list[Message]
    stages: list[dict[str, float]] = field(default_factory=list)
    """Per stage, what it was priced at: ``{"stage", "rank", "forward_s", "backward_s"}`` per
    micro-batch (backward with recomputation's forward), to set beside measured times."""
    analytical_step_s: float | None = None
    """The cost model's step time for the same plan (``num_microbatches`` × its bottleneck per
    micro-batch: no fill or drain), beside the simulated one when the plan carries a prediction."""
    notes: list[str] = field(default_factory=list)

    def events_of(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["window_s"] = list(self.window_s)
        data["memory"] = [[list(point) for point in points] for points in self.memory]
        return data

    def to_json(self, indent: int | None = 1) -> str:
        """The result as JSON: the figures, then ``memory``, ``events`` and ``messages``."""
        return json.dumps(self.to_dict(), indent=indent)


def busy_in(events: list[Event], rank: int, window: tuple[float, float]) -> float:
    """Time ``rank`` spends in actions within ``window`` (parts of actions that straddle it count)."""
    low, high = window
    return sum(max(0.0, min(e.end_s, high) - max(e.start_s, low)) for e in events if e.rank == rank)
