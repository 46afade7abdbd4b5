"""What a plan predicts, per GPU and per stage, as JSON-ready data and as the tables ``hf-ftpipe
show`` prints; and the built-in GPU profiles as ``hf-ftpipe profiles`` lists them.

Everything here reads a `Partition` alone (no model, no trace): a plan file from the Hub can be
judged before anything is downloaded or launched.
"""

from __future__ import annotations

from typing import Any

from hf_ftpipe.costmodel.profiles import list_profiles
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.plan.partition import Partition

__all__ = ["format_plan", "format_profiles", "plan_summary", "profile_rows", "table"]

_GiB = 2**30
_MiB = 2**20


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
                "weights_gib": gpu.weights_bytes / _GiB,
                "gradients_gib": gpu.gradient_bytes / _GiB,
                "optimizer_gib": gpu.optimizer_bytes / _GiB,
                "activations_gib": gpu.activation_bytes / _GiB,
                "memory_gib": gpu.memory_bytes / _GiB,
                "capacity_gib": gpu.capacity_bytes / _GiB,
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
            "recv_mib": st.fwd_in_bytes / _MiB,
            "send_mib": st.fwd_out_bytes / _MiB,
            "comm_fwd_in_ms": st.comm_fwd_in_s * 1e3,
            "comm_fwd_out_ms": st.comm_fwd_out_s * 1e3,
            "comm_bwd_in_ms": st.comm_bwd_in_s * 1e3,
            "comm_bwd_out_ms": st.comm_bwd_out_s * 1e3,
            "memory_gib": st.memory_bytes / _GiB,
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
        "stage_edges": [{"source": s, "destination": t, "mib": b / _MiB} for s, t, b in p.stage_edges],
        "versions": dict(plan.versions),
    }


def _count_ops(plan: Partition) -> list[int]:
    counts = [0] * plan.num_stages
    for s in plan.node_stage.values():
        counts[s] += 1
    return counts


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
        "",
    ]
    rows = [["GPU", "stages", "ops", "compute ms", "send ms", "recv grad ms", "cost ms", "/ ideal",
             "weights", "grads", "optim", "activ", "memory GiB", "of GPU"]]  # fmt: skip
    for g in summary["gpus"]:
        rows.append(
            [
                f"{g['gpu']}{' *' if g['bottleneck'] else ''}",
                _ranges(g["stages"]),
                str(g["num_ops"]),
                f"{g['compute_ms']:.1f}",
                f"{g['comm_fwd_out_ms']:.1f}",
                f"{g['comm_bwd_in_ms']:.1f}",
                f"{g['cost_ms']:.1f}",
                f"{g['cost_over_ideal']:.2f}",
                f"{g['weights_gib']:.2f}",
                f"{g['gradients_gib']:.2f}",
                f"{g['optimizer_gib']:.2f}",
                f"{g['activations_gib']:.2f}",
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
    rows = [["stage", "GPU", "ops", "fwd ms", "bwd ms", "recv MiB", "send MiB", "memory GiB", "feeds"]]
    feeds: dict[int, list[int]] = {}
    for edge in summary["stage_edges"]:
        feeds.setdefault(edge["source"], []).append(edge["destination"])
    for st in summary["stages"]:
        rows.append(
            [
                str(st["stage"]),
                str(st["gpu"]),
                str(st["num_ops"]),
                f"{st['forward_ms']:.1f}",
                f"{st['backward_ms']:.1f}",
                f"{st['recv_mib']:.1f}",
                f"{st['send_mib']:.1f}",
                f"{st['memory_gib']:.2f}",
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
                f"{p.memory_bytes / _GiB:.0f}",
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


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns under a dashed rule (the style of ``hf-ftpipe compare``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
