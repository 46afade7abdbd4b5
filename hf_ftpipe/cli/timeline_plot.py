"""Draw a simulated timeline (``hf-ftpipe simulate --plot``): a Gantt chart, one row per rank.

Each action is a box on its rank's row from its start to its end, coloured by its kind (forward,
backward, weight update), its micro-batch number inside; the gaps between boxes, where the rank
waits, are drawn as light hatched boxes so that idle time is visible. What is drawn is exactly
`hf_ftpipe.simulator.timeline_bars`; `plot_timeline` returns the bars read back from the drawn
figure (position, length, colour and text of every box), so a test checks what was drawn.

Needs matplotlib (``pip install "hf_ftpipe[plot]"``), imported only when drawing.
"""

from __future__ import annotations

import os
from typing import Any

from hf_ftpipe.cli.plot import _matplotlib
from hf_ftpipe.simulator import Bar, SimulationResult, timeline_bars

__all__ = ["COLORS", "plot_timeline"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "U": "#55A868", "idle": "#EEEEEE"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients", "U": "weight update", "idle": "idle"}


def plot_timeline(result: SimulationResult, path: str | os.PathLike, *, title: str | None = None) -> list[Bar]:
    """Write ``result``'s timeline to ``path`` (PNG, or any format matplotlib knows by the file's
    extension); returns the bars as drawn, read back from the figure (times in seconds)."""
    Figure, _ = _matplotlib()
    from matplotlib.patches import Patch

    bars = timeline_bars(result)
    end = result.step_ends_s[-1] if result.step_ends_s else 0.0
    fig = Figure(figsize=(min(18.0, 6.0 + 0.12 * len(bars) / max(result.num_ranks, 1)), 1.2 + 0.45 * result.num_ranks))
    ax = fig.subplots()
    scale = 1e3 if end < 10 else 1.0  # ms for short steps
    for bar in bars:
        y = result.num_ranks - 1 - bar.rank  # rank 0 on top
        ax.broken_barh(
            [(bar.start_s * scale, bar.duration_s * scale)],
            (y - 0.4, 0.8),
            facecolors=COLORS.get(bar.kind, "0.5"),
            edgecolor="white" if bar.kind != "idle" else "0.85",
            hatch="//" if bar.kind == "idle" else None,
            linewidth=0.5,
        )
        if bar.text and bar.duration_s * scale > end * scale / 150:  # a label only where it fits
            ax.text((bar.start_s + bar.duration_s / 2) * scale, y, bar.text, ha="center", va="center", fontsize=6,
                    color="white")  # fmt: skip
    for step_end in result.step_ends_s[:-1]:
        ax.axvline(step_end * scale, color="black", linewidth=0.6, linestyle=":")
    ax.set_yticks(range(result.num_ranks), [f"rank {r}" for r in reversed(range(result.num_ranks))])
    ax.set_xlim(0, end * scale)
    ax.set_xlabel("time (ms)" if scale == 1e3 else "time (s)")
    kinds = [k for k in COLORS if any(b.kind == k for b in bars)]
    ax.legend(
        handles=[Patch(facecolor=COLORS[k], hatch="//" if k == "idle" else None, label=_NAMES[k]) for k in kinds],
        fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False,
    )  # fmt: skip
    steps = f", {result.num_steps} steps (dotted: step ends)" if result.num_steps > 1 else ""
    fig.suptitle(
        (f"{title}\n" if title else "")
        + f"{result.schedule}, {result.num_microbatches} micro-batches{steps}: step {result.step_time_s * scale:.1f} "
        f"{'ms' if scale == 1e3 else 's'}, bubble {result.bubble_fraction:.0%}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    return _drawn(ax, result.num_ranks, scale)


def _drawn(ax: Any, num_ranks: int, scale: float) -> list[Bar]:
    """The boxes on ``ax`` as bars: each collection's rectangle, its kind by its colour, and the
    text written at its centre (none for a box too narrow to hold it)."""
    from matplotlib.colors import to_hex

    kinds = {to_hex(color): kind for kind, color in COLORS.items()}
    texts = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text() for t in ax.texts}
    drawn = []
    for collection in ax.collections:
        box = collection.get_paths()[0].get_extents()
        rank = num_ranks - 1 - round(box.y0 + 0.4)
        centre = (round(box.x0 + box.width / 2, 6), round(box.y0 + 0.4, 6))
        kind = kinds[to_hex(collection.get_facecolor()[0])]
        drawn.append(Bar(rank, float(box.x0) / scale, float(box.width) / scale, kind, texts.get(centre, "")))
    return drawn
