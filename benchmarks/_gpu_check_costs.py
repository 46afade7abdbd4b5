"""Check 4 of ``gpu_checks.py``: one transformer layer's measured time against the roofline prediction.

The models are the shipped configs (``hf_ftpipe/model_configs/``: T5-3B at FTPipe's BoolQ shapes,
GPT2-XL at 1024 tokens, `hf_ftpipe.hub.setups`) cut to ``cost_layers`` layers per stack and built
on the meta device; layer 1 of each stack (a middle layer: T5's layer 0 also computes the
relative position bias) is the block compared. Block times come from the measured-cost profiler,
`hf_ftpipe.runtime.block_timing.time_blocks` (``hf-ftpipe profile``'s): each block runs as the
pipeline runs a stage, with random weights and inputs on the device (only the timed block gets
real tensors), forward then backward, the median of ``block_repeats`` runs after `WARMUP`. The
prediction is `node_costs` summed over the block's ops, on the device's built-in profile
(`get_profile("auto")`; on the CPU the ``cpu`` profile).

Per op kind, the profiler's block runner runs one more forward and backward under
``torch.profiler``: the self time of each ``aten::`` op (device time on CUDA, CPU time on the CPU)
is summed by kind, and compared with the prediction of the graph's ops of that kind. Kinds from
the op's name (`op_kind`): ``matmul`` (mm, bmm, addmm, baddbmm, linear, matmul), ``attention``
(scaled dot-product attention and its kernels), ``norm`` (layer_norm, rms_norm), ``elementwise``
(the rest). T5's RMSNorm is written as pow / mean / rsqrt / mul, so it counts as elementwise on
both sides.

``--quick`` times layer 1 of the correctness check's tiny GPT-2 instead (one capture less: the
test's time budget), so `capture_config` runs only at full size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from _gpu_check_models import Sizes

WARMUP = 3
KINDS = ("matmul", "attention", "norm", "elementwise")
_MATMUL = re.compile(r"(^|[:._])(mm|bmm|addmm|baddbmm|matmul|linear)([._]|$)")


def op_kind(name: str) -> str:
    """``"aten.addmm.default"`` or ``"aten::addmm"`` → ``"matmul"``; see the module docstring."""
    lowered = name.lower()
    if any(k in lowered for k in ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")):
        return "attention"
    if "layer_norm" in lowered or "rms_norm" in lowered:
        return "norm"
    return "matmul" if _MATMUL.search(lowered) else "elementwise"


def check_cost_model(
    models: Iterable[tuple[str, Any]],
    sizes: Sizes,
    device: torch.device,
    dtypes: tuple[str, ...],
    max_ratio: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``models``: (name, traced model) pairs, e.g. `capture_config` of each of ``sizes.cost_shapes``."""
    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.runtime.block_timing import time_blocks

    profile = get_profile("auto")
    blocks = []
    for config_name, traced in models:
        for dtype in dtypes:
            timings = time_blocks(
                traced, dtype=dtype, device=device, warmup=WARMUP, repeats=sizes.block_repeats, show_progress=False
            )
            for timed in (t for t in timings.blocks if t.name.endswith(".1")):  # layer 1 of each stack
                figures = _compare_block(traced, timed, device, dtype, profile)
                figures = {"model": config_name, "block": timed.name, "dtype": dtype, **figures}
                ratios = (figures["forward_ratio"], figures["backward_ratio"])
                figures["ok"] = all(1 / max_ratio <= r <= max_ratio for r in ratios)
                blocks.append(figures)
                log(
                    f"cost_model {config_name} {timed.name} {dtype}: measured / roofline forward "
                    f"{figures['forward_ratio']:.2f}, backward {figures['backward_ratio']:.2f}"
                )
    return {
        "check": "cost_model",
        "ok": all(block["ok"] for block in blocks),
        "profile": profile.name,
        "max_ratio": max_ratio,
        "blocks": blocks,
    }


def capture_config(config_name: str, sizes: Sizes) -> Any:
    """The shipped config cut to ``sizes.cost_layers`` layers per stack, on meta, captured at its task's shapes."""
    import transformers

    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.graph.sources import load_config

    config = load_config(config_name)
    layers = {"num_layers": sizes.cost_layers, "num_decoder_layers": sizes.cost_layers, "n_layer": sizes.cost_layers}
    dropout = {"dropout_rate": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    for field, value in {**layers, **dropout, **sizes.cost_overrides.get(config_name, {})}.items():
        if hasattr(config, field):
            setattr(config, field, value)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config).train()
    rows, seq_len, target_len = sizes.cost_shapes[config_name]
    inputs = {"input_ids": torch.ones(rows, seq_len, dtype=torch.long)}
    inputs["labels"] = torch.ones(rows, target_len or seq_len, dtype=torch.long)
    if target_len:
        inputs["attention_mask"] = torch.ones(rows, seq_len, dtype=torch.long)
    return capture_model(model, inputs)


def _compare_block(traced: Any, timed: Any, device: torch.device, dtype: str, profile: Any) -> dict[str, Any]:
    """``timed`` (a `TimedBlock`) against the roofline, in all and per op kind (profiled once more here)."""
    from hf_ftpipe.costmodel import node_costs
    from hf_ftpipe.plan.blocks import blocks_of
    from hf_ftpipe.runtime.block_timing import BlockRunner  # the profiler's own block, built the same way

    block = BlockRunner(traced, next(b for b in blocks_of(traced.cost_graph) if b.name == timed.name), device)
    with torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
        measured_kinds = _profiled_kinds(block, device)
    forward_s, backward_s = timed.forward_s, timed.backward_s
    costs = node_costs(traced.cost_graph, profile, dtype=dtype)
    predicted = {(kind, phase): 0.0 for kind in KINDS for phase in ("forward", "backward")}
    for node in timed.nodes:
        kind = op_kind(str(traced.cost_graph.node(node)["op"]))
        predicted[kind, "forward"] += costs[node].forward_s
        predicted[kind, "backward"] += costs[node].backward_s
    predicted_forward = sum(v for (_, phase), v in predicted.items() if phase == "forward")
    predicted_backward = sum(v for (_, phase), v in predicted.items() if phase == "backward")
    kinds = {}
    for kind in KINDS:
        row = {}
        for phase in ("forward", "backward"):
            measured, roofline = measured_kinds[kind, phase], predicted[kind, phase]
            row[f"{phase}_measured_ms"] = round(measured * 1e3, 4)
            row[f"{phase}_roofline_ms"] = round(roofline * 1e3, 4)
            row[f"{phase}_ratio"] = round(measured / roofline, 3) if roofline > 0 else None
        kinds[kind] = row
    return {
        "ops": len(timed.nodes),
        "forward_ms": round(forward_s * 1e3, 4),
        "backward_ms": round(backward_s * 1e3, 4),
        "weight_ms": round(timed.weight_s * 1e3, 4),
        "forward_roofline_ms": round(predicted_forward * 1e3, 4),
        "backward_roofline_ms": round(predicted_backward * 1e3, 4),
        "forward_ratio": round(forward_s / predicted_forward, 3),
        "backward_ratio": round(backward_s / predicted_backward, 3),
        "kinds": kinds,
    }


def _profiled_kinds(block: Any, device: torch.device) -> dict[tuple[str, str], float]:
    """(kind, phase) → seconds of the ``aten::`` ops' self time in one profiled run of each phase;
    a profiled run before it is thrown away (the profiler's first run was 100× slow on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):
        found = {(kind, phase): 0.0 for kind in KINDS for phase in ("forward", "backward")}
        phases = block.phases()
        for phase in ("forward", "backward", "backward"):  # the backward in two phases: B, then W
            with profile(activities=activities) as profiler:
                next(phases)
                _synchronize(device)
            for event in profiler.key_averages():
                if event.key.startswith("aten::"):
                    self_us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
                    found[op_kind(event.key), phase] += self_us * 1e-6
    return found


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
