"""Draw a plan (``hf-ftpipe show --plot``): the load of each GPU and the stage graph, in one image.

Left: one bar per GPU, its compute per micro-batch with the communication that is not hidden
behind it stacked on top (FTPipe's cost of a GPU), against the ideal (total compute / GPUs): the
tallest bar is the pipeline's step time. Right: the stages as nodes in one row per GPU, in stage
order from left to right, an arrow where a stage feeds another (thicker for more bytes): a
Mixed-Pipe plan shows GPUs that run several non-adjacent stages.

Needs matplotlib (``pip install "hf_ftpipe[plot]"``), imported only here and only when drawing.
"""

from __future__ import annotations

import os
from typing import Any

from hf_ftpipe.cli.format import plan_summary
from hf_ftpipe.errors import FtpipeError
from hf_ftpipe.plan.partition import Partition

__all__ = ["plot_plan"]


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` class and its colormap registry, or an error that says what to install."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as error:
        raise FtpipeError(
            'drawing a plan needs matplotlib: pip install "hf_ftpipe[plot]" (or pip install matplotlib)'
        ) from error
    return Figure, matplotlib.colormaps


def plot_plan(plan: Partition, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Write the per-GPU load and the stage graph of ``plan`` to ``path`` (PNG, or any format
    matplotlib knows by the file's extension).

    Draws on a bare ``Figure`` rather than through pyplot: no display is needed, and the caller's
    pyplot backend and current figure are left alone.
    """
    summary = plan_summary(plan)
    Figure, colormaps = _matplotlib()
    num_gpus = len(summary["gpus"])
    fig = Figure(figsize=(6 + 0.5 * num_gpus + 0.35 * plan.num_stages, 4.8))
    load, graph = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
    palette = colormaps["tab10" if num_gpus <= 10 else "tab20"]
    colors = [palette(g % 20) for g in range(num_gpus)]
    _draw_load(load, summary, colors)
    _draw_stage_graph(graph, summary, colors)
    key = plan.key
    fig.suptitle(
        (f"{title}\n" if title else "")
        + f"{key.model_class} on {key.num_gpus} × {key.gpu_profile}, {summary['schedule']}, "
        f"{plan.partitioner}: {summary['throughput_samples_per_s']:.2f} samples/s predicted, "
        f"worst GPU / ideal {summary['worst_over_ideal']:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)


def _draw_load(ax: Any, summary: dict[str, Any], colors: list[Any]) -> None:
    gpus = summary["gpus"]
    x = list(range(len(gpus)))
    compute = [g["compute_ms"] for g in gpus]
    exposed = [g["exposed_comm_ms"] for g in gpus]
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.bar(x, compute, color=colors)
    ax.bar(x, exposed, bottom=compute, color="0.35", hatch="//")
    ax.axhline(summary["ideal_step_time_ms"], color="black", linestyle="--", linewidth=1)
    handles = [
        Patch(facecolor="0.8", edgecolor="black", label="compute (fwd + bwd)"),
        Patch(facecolor="0.35", hatch="//", label="communication not hidden"),
        Line2D([], [], color="black", linestyle="--", linewidth=1, label="ideal"),
    ]
    for g in gpus:
        ax.annotate(
            f"{g['memory_fraction']:.0%}",
            (g["gpu"], g["cost_ms"]),
            textcoords="offset points",
            xytext=(0, 2),
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(x, [str(g["gpu"]) for g in gpus])
    ax.set_xlabel("GPU (above each bar: share of its memory used)")
    ax.set_ylabel("ms per micro-batch")
    ax.set_title("load per GPU", fontsize=9)
    top = max([summary["ideal_step_time_ms"], *(g["cost_ms"] for g in gpus)])
    ax.set_ylim(0, top * 1.45)  # room for the labels and the legend above the bars
    ax.legend(handles=handles, fontsize=7, loc="upper left", frameon=False)


def _draw_stage_graph(ax: Any, summary: dict[str, Any], colors: list[Any]) -> None:
    import networkx as nx

    stages = summary["stages"]
    graph = nx.DiGraph()
    graph.add_nodes_from(st["stage"] for st in stages)
    for edge in summary["stage_edges"]:
        graph.add_edge(edge["source"], edge["destination"], mib=edge["mib"])
    # One row per GPU (GPU 0 on top), stages left to right in their (topological) order.
    pos = {st["stage"]: (st["stage"], -st["gpu"]) for st in stages}
    heaviest = max((d["mib"] for _, _, d in graph.edges(data=True)), default=1.0) or 1.0
    widths = [0.5 + 3.0 * d["mib"] / heaviest for _, _, d in graph.edges(data=True)]
    nx.draw_networkx_edges(
        graph, pos, ax=ax, width=widths, edge_color="0.5", arrows=True, arrowsize=10,
        connectionstyle="arc3,rad=0.15", node_size=420,
    )  # fmt: skip
    nx.draw_networkx_nodes(
        graph, pos, ax=ax, node_color=[colors[st["gpu"]] for st in stages], node_size=420, edgecolors="black"
    )
    nx.draw_networkx_labels(graph, pos, ax=ax, font_size=7, font_color="white")
    num_gpus = len(summary["gpus"])
    ax.set_yticks([-g for g in range(num_gpus)], [f"GPU {g}" for g in range(num_gpus)])
    ax.tick_params(left=True, labelleft=True, bottom=False, labelbottom=False)
    ax.set_xlabel("stage (order of execution)")
    title = "stage graph (edge width: activation bytes)"
    if not summary["stage_edges"] and len(stages) > 1:
        title += " — edges not recorded in this file"
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.08, y=0.15)
