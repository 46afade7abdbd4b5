"""The bars of a timeline, as data: what ``hf-ftpipe simulate --plot`` draws, testable without matplotlib."""

from __future__ import annotations

from dataclasses import dataclass

from hf_ftpipe.simulator.result import SimulationResult

__all__ = ["Bar", "timeline_bars"]


@dataclass(frozen=True)
class Bar:
    """One box of the Gantt chart: on ``rank``'s row from ``start_s`` for ``duration_s``, coloured
    by ``kind`` (``F``, ``B``, ``U``, or ``idle`` for a gap), ``text`` written inside it (the
    micro-batch, ``m.slice`` for a token slice; empty for a gap)."""

    rank: int
    start_s: float
    duration_s: float
    kind: str
    text: str


def timeline_bars(result: SimulationResult) -> list[Bar]:
    """Every action as a bar and every gap on a rank (from 0 to the last step's end) as an idle bar,
    rank by rank in time order."""
    end = result.step_ends_s[-1] if result.step_ends_s else 0.0
    bars: list[Bar] = []
    for rank in range(result.num_ranks):
        clock = 0.0
        for event in sorted(result.events_of(rank), key=lambda e: e.start_s):
            if event.start_s > clock:
                bars.append(Bar(rank, clock, event.start_s - clock, "idle", ""))
            text = str(event.microbatch) if event.slice is None else f"{event.microbatch}.{event.slice}"
            bars.append(Bar(rank, event.start_s, event.end_s - event.start_s, event.kind, text))
            clock = max(clock, event.end_s)
        if end > clock:
            bars.append(Bar(rank, clock, end - clock, "idle", ""))
    return bars
