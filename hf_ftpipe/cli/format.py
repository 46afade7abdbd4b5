"""What ``hf-ftpipe`` prints: tables, a plan's predictions, the GPU profiles, ``partition`` and ``compare``.

A plan's figures come as JSON-ready data (``plan_summary``) and as the tables ``hf-ftpipe show``
prints; they read a `Partition` alone (no model, no trace), so a plan file from the Hub can be
judged before anything is downloaded or launched. Every table goes through `table`.
"""

from __future__ import annotations

import argparse
from typing import Any

from hf_ftpipe._table import table
from hf_ftpipe._units import GiB, MiB
from hf_ftpipe.cli.simulate import simulated_figures
from hf_ftpipe.costmodel.profiles import GPUProfile, list_profiles
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.partition import Partition

__all__ = [
    "format_compare",
    "format_partition",
    "format_plan",
    "format_profiles",
    "gpu_rows",
    "plan_summary",
    "profile_rows",
    "setup_line",
    "table",
]


def plan_summary(plan: Partition) -> dict[str, Any]:
    """The plan's key, headline prediction, one row per GPU and per stage, and the stage graph."""
    p = plan.predicted
    if p is None:
        raise PartitionError(
            "this partition has no prediction (`predicted` is null), so there is nothing to show; "
            "make it again with `hf-ftpipe partition ... -o FILE`"
        )
    bottleneck = max(range(len(p.gpus)), key=lambda g: p.gpus[g].cost_s)
    ops = _count_ops(plan)
    gpus = []
    for g, gpu in enumerate(p.gpus):
        stages = plan.stages_on(g)
        gpus.append(
            {
                "gpu": g,
                "stages": stages,
                "num_ops": sum(ops[s] for s in stages),
                "compute_ms": gpu.compute_s * 1e3,
                "comm_fwd_out_ms": gpu.comm_fwd_out_s * 1e3,
                "comm_bwd_in_ms": gpu.comm_bwd_in_s * 1e3,
                "exposed_comm_ms": (gpu.cost_s - gpu.compute_s) * 1e3,
                "cost_ms": gpu.cost_s * 1e3,
                "cost_over_ideal": gpu.cost_s / p.ideal_step_time_s if p.ideal_step_time_s > 0 else 1.0,
                "bottleneck": g == bottleneck,
                "weights_gib": gpu.weights_bytes / GiB,
                "gradients_gib": gpu.gradient_bytes / GiB,
                "optimizer_gib": gpu.optimizer_bytes / GiB,
                "activations_gib": gpu.activation_bytes / GiB,
                "memory_gib": gpu.memory_bytes / GiB,
                "capacity_gib": gpu.capacity_bytes / GiB,
                "memory_fraction": gpu.memory_bytes / gpu.capacity_bytes if gpu.capacity_bytes else 0.0,
            }
        )
    stages = [
        {
            "stage": s,
            "gpu": st.device,
            "num_ops": ops[s],
            "forward_ms": st.forward_s * 1e3,
            "backward_ms": st.backward_s * 1e3,
            "recv_mib": st.fwd_in_bytes / MiB,
            "send_mib": st.fwd_out_bytes / MiB,
            "comm_fwd_in_ms": st.comm_fwd_in_s * 1e3,
            "comm_fwd_out_ms": st.comm_fwd_out_s * 1e3,
            "comm_bwd_in_ms": st.comm_bwd_in_s * 1e3,
            "comm_bwd_out_ms": st.comm_bwd_out_s * 1e3,
            "memory_gib": st.memory_bytes / GiB,
        }
        for s, st in enumerate(p.stages)
    ]
    return {
        "partitioner": plan.partitioner,
        "key": plan.key.to_dict(),
        "key_digest": plan.key.digest(),
        "schedule": p.schedule,
        "num_microbatches": p.num_microbatches,
        "microbatch_size": p.microbatch_size,
        "optimizer": p.optimizer,
        "throughput_samples_per_s": p.throughput_samples_per_s,
        "step_time_ms": p.step_time_s * 1e3,
        "ideal_step_time_ms": p.ideal_step_time_s * 1e3,
        "worst_over_ideal": p.worst_over_ideal,
        "max_memory_fraction": p.max_memory_fraction,
        "num_stages": plan.num_stages,
        "num_gpus_used": plan.num_devices,
        "gpus": gpus,
        "stages": stages,
        "stage_edges": [{"source": s, "destination": t, "mib": b / MiB} for s, t, b in p.stage_edges],
        "versions": dict(plan.versions),
        **simulated_figures(plan),
    }


def _count_ops(plan: Partition) -> list[int]:
    counts = [0] * plan.num_stages
    for s in plan.node_stage.values():
        counts[s] += 1
    return counts


# The columns of `format_plan`'s tables that print one figure of `plan_summary`: (header, key, format).
_GPU_FIGURES = (
    ("compute ms", "compute_ms", ".1f"),
    ("send ms", "comm_fwd_out_ms", ".1f"),
    ("recv grad ms", "comm_bwd_in_ms", ".1f"),
    ("cost ms", "cost_ms", ".1f"),
    ("/ ideal", "cost_over_ideal", ".2f"),
    ("weights", "weights_gib", ".2f"),
    ("grads", "gradients_gib", ".2f"),
    ("optim", "optimizer_gib", ".2f"),
    ("activ", "activations_gib", ".2f"),
)
_STAGE_FIGURES = (
    ("fwd ms", "forward_ms", ".1f"),
    ("bwd ms", "backward_ms", ".1f"),
    ("recv MiB", "recv_mib", ".1f"),
    ("send MiB", "send_mib", ".1f"),
    ("memory GiB", "memory_gib", ".2f"),
)


def _figures(row: dict[str, Any], columns: tuple[tuple[str, str, str], ...]) -> list[str]:
    return [format(row[key], spec) for _, key, spec in columns]


def format_plan(plan: Partition, *, source: str | None = None) -> str:
    """``hf-ftpipe show``'s text: the setup, the headline prediction, a GPU table, a stage table."""
    summary = plan_summary(plan)
    key = plan.key
    shapes = ", ".join(f"{name} {'×'.join(map(str, shape))}" for name, shape in key.input_shapes.items())
    lines = [
        *([source] if source else []),
        f"{key.model_class} on {key.num_gpus} × {key.gpu_profile}, {key.dtype}; micro-batch {shapes}",
        f"{summary['schedule']}, {summary['num_microbatches']} micro-batches, {summary['optimizer']}; "
        f"partitioner {plan.partitioner}: {plan.num_stages} stages on {plan.num_devices} GPUs; "
        f"key {summary['key_digest']}",
        f"predicted: {summary['throughput_samples_per_s']:.2f} samples/s, {summary['step_time_ms']:.1f} ms per "
        f"micro-batch on the slowest GPU, ideal {summary['ideal_step_time_ms']:.1f} ms "
        f"(worst GPU / ideal {summary['worst_over_ideal']:.3f}), peak memory {summary['max_memory_fraction']:.0%} "
        "of a GPU",
        _simulated_line(summary),
        "",
    ]
    rows = [["GPU", "stages", "ops", *(header for header, _, _ in _GPU_FIGURES), "memory GiB", "of GPU"]]
    for g in summary["gpus"]:
        rows.append(
            [
                f"{g['gpu']}{' *' if g['bottleneck'] else ''}",
                _ranges(g["stages"]),
                str(g["num_ops"]),
                *_figures(g, _GPU_FIGURES),
                f"{g['memory_gib']:.2f} / {g['capacity_gib']:.1f}",
                f"{g['memory_fraction']:.0%}",
            ]
        )
    lines.append(table(rows))
    lines.append(
        "  * the slowest GPU. cost = compute + the part of sending activations or receiving gradients that "
        "outlasts the compute it overlaps; memory in GiB."
    )
    lines.append(
        "  grads: gradients kept from one backward to the next; where the schedule applies or frees them right "
        "after a backward (async updating every micro-batch, gpipe with one stage per GPU) they count under "
        "activ, by what they exceed the activations that backward frees."
    )
    lines.append("")
    rows = [["stage", "GPU", "ops", *(header for header, _, _ in _STAGE_FIGURES), "feeds"]]
    feeds: dict[int, list[int]] = {}
    for edge in summary["stage_edges"]:
        feeds.setdefault(edge["source"], []).append(edge["destination"])
    for st in summary["stages"]:
        rows.append(
            [
                str(st["stage"]),
                str(st["gpu"]),
                str(st["num_ops"]),
                *_figures(st, _STAGE_FIGURES),
                _ranges(feeds.get(st["stage"], [])) or "-",
            ]
        )
    lines.append(table(rows))
    lines.append(
        "  recv/send: activations per micro-batch to or from stages on other GPUs; bwd includes the forward run "
        "again when the plan was made with recomputation."
    )
    if not summary["stage_edges"] and plan.num_stages > 1:
        lines.append("  (this file predates recorded stage edges: `feeds` is unknown)")
    return "\n".join(lines)


def _simulated_line(summary: dict[str, Any]) -> str:
    """The simulated step of the plan's schedule beside the analytical one (fill and drain, waits)."""
    if summary["simulated_step_ms"] is None:
        return f"simulated: not possible ({summary['why_not']})"
    analytical = summary["analytical_step_ms"]
    return (
        f"simulated: {summary['simulated_step_ms']:.1f} ms per step of {summary['num_microbatches']} micro-batches, "
        f"bubble {summary['simulated_bubble']:.1%}; analytical {analytical:.1f} ms ({summary['num_microbatches']} × "
        "the slowest GPU); hf-ftpipe simulate draws the timeline"
    )


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive values
    for v in sorted(set(values)):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def profile_rows() -> list[dict[str, Any]]:
    """Every built-in profile as plain data (``GPUProfile.to_dict`` without the count)."""
    return [{k: v for k, v in p.to_dict().items() if k != "count"} for p in list_profiles()]


def format_profiles() -> str:
    rows = [["name", "memory GiB", "fp32 TFLOP/s", "fp16", "bf16", "memory GB/s", "link GB/s", "link latency us",
             "efficiency compute/memory"]]  # fmt: skip
    for p in list_profiles():
        flops = {dtype: p.flops_per_s(dtype) / 1e12 for dtype in ("float32", "float16", "bfloat16")}
        rows.append(
            [
                p.name,
                f"{p.memory_bytes / GiB:.0f}",
                f"{flops['float32']:.3g}",
                f"{flops['float16']:.3g}",
                f"{flops['bfloat16']:.3g}",
                f"{p.memory_bandwidth_bytes_per_s / 1e9:.0f}",
                f"{p.link_bandwidth_bytes_per_s / 1e9:.0f}",
                f"{p.link_latency_s * 1e6:.0f}",
                f"{p.compute_efficiency:.2f} / {p.memory_efficiency:.2f}",
            ]
        )
    return (
        table(rows)
        + "\n\nDatasheet peaks (dense); the cost model assumes peak × efficiency. Links: achieved bandwidth per "
        "direction between two GPUs (PCIe or NVLink).\nUse a name with --gpu-profile, or write your own with "
        "GPUProfile.to_json and pass its path."
    )


# -- hf-ftpipe partition and compare ------------------------------------------------------------


def gpu_rows(plan: Partition) -> list[dict[str, Any]]:
    """``hf-ftpipe partition``'s per-GPU figures: stages, compute and cost in ms, memory in GiB."""
    predicted = plan.predicted
    return [
        {
            "gpu": g,
            "stages": plan.stages_on(g),
            "compute_ms": gpu.compute_s * 1e3,
            "cost_ms": gpu.cost_s * 1e3,
            "memory_gib": gpu.memory_bytes / GiB,
            "capacity_gib": gpu.capacity_bytes / GiB,
            "memory_fraction": gpu.memory_bytes / gpu.capacity_bytes,
        }
        for g, gpu in enumerate(predicted.gpus)
    ]


def setup_line(args: argparse.Namespace, graph: CostGraph, profile: GPUProfile) -> str:
    """``hf-ftpipe compare``'s first line: the model, the GPUs and the options it was planned with."""
    shape = f"{args.seq_len}" + (f"/{args.target_len}" if args.target_len else "")
    extras = ", recompute" if args.recompute else ""
    if getattr(args, "lora_r", None) is not None:
        extras += f", LoRA r={args.lora_r}" + (f" on {' '.join(args.lora_targets)}" if args.lora_targets else "")
    if getattr(args, "costs", None):
        extras += f"; op times measured ({args.costs})"
    return (
        f"{args.model} ({graph.model_class}, {graph.num_nodes} ops) on {profile.count} × {profile.name} "
        f"({profile.memory_bytes / GiB:.1f} GiB, {args.headroom:.0%} kept free); micro-batch {args.batch_size} "
        f"× {args.num_microbatches}, length {shape}, {args.schedule}, {args.optimizer}{extras}"
    )


def format_partition(summary: dict[str, Any], report: list) -> str:
    """``hf-ftpipe partition``'s text: the setup, the winner, its prediction and a GPU table."""
    lines = [
        f"{summary['model']} ({summary['model_class']}, {summary['num_ops']} ops) on {summary['num_gpus']} × "
        f"{summary['gpu_profile']}" + (f"; op times measured ({summary['costs']})" if summary.get("costs") else ""),
        f"partitioner: {summary['partitioner']}"
        + (f" (chosen by auto among {len(report)})" if summary["chosen_by_auto"] else ""),
        f"predicted: {summary['throughput_samples_per_s']:.2f} samples/s, worst GPU / ideal "
        f"{summary['worst_over_ideal']:.3f}, {summary['num_stages']} stages, peak memory "
        f"{summary['max_memory_fraction']:.0%} of capacity",
    ]
    cells = [["GPU", "stages", "compute ms", "cost ms", "memory GiB", "of capacity"]]
    for row in summary["gpus"]:
        cells.append(
            [
                str(row["gpu"]),
                ",".join(map(str, row["stages"])),
                f"{row['compute_ms']:.1f}",
                f"{row['cost_ms']:.1f}",
                f"{row['memory_gib']:.2f} / {row['capacity_gib']:.1f}",
                f"{row['memory_fraction']:.0%}",
            ]
        )
    lines.append(table(cells))
    if summary["output"]:
        lines.append(f"wrote {summary['output']}")
    return "\n".join(lines)


def format_compare(rows: list[dict[str, Any]]) -> str:
    """``hf-ftpipe compare``'s table: one row per partitioner, then `auto` and what it chose."""
    cells = [
        ["partitioner", "fits", "samples/s", "worst/ideal", "sim step s", "sim/analytic", "peak GiB", "of capacity",
         "stages", "per GPU", "time s"]
    ]  # fmt: skip
    for row in rows:
        has_plan = row["step_time_s"] is not None
        name = row["partitioner"] + (" *" if row["best"] else "")
        if row["partitioner"] == "auto" and row.get("chosen"):
            name = f"auto ({row['chosen']})"
        cells.append(
            [
                name,
                "yes" if row["feasible"] else ("skipped" if row["skipped"] else "no"),
                f"{row['throughput_samples_per_s']:.2f}" if has_plan else "-",
                f"{row['worst_over_ideal']:.3f}" if has_plan else "-",
                *_simulated_cells(row),
                f"{max(row['memory_gib_per_gpu']):.2f}" if has_plan else "-",
                f"{row['max_memory_fraction']:.0%}" if has_plan else "-",
                str(row["num_stages"]) if has_plan else "-",
                _stages_per_gpu(row["stages_per_gpu"]) if has_plan else "-",
                f"{row['time_s']:.2f}",
            ]
        )
    return table(cells)


def _simulated_cells(row: dict[str, Any]) -> list[str]:
    """The simulated step (per mini-batch) and its ratio to the analytical one (micro-batches × the
    slowest GPU's time per micro-batch)."""
    simulated, analytical = row.get("simulated_step_s"), row.get("analytical_step_s")
    if simulated is None:
        return ["-", "-"]
    return [f"{simulated:.2f}", f"{simulated / analytical:.3f}" if analytical else "-"]


def _stages_per_gpu(counts: list[int]) -> str:
    """``[1, 1, 1]`` → ``"1"``; ``[2, 1, 3]`` → ``"1-3"``."""
    low, high = min(counts, default=0), max(counts, default=0)
    return str(low) if low == high else f"{low}-{high}"
