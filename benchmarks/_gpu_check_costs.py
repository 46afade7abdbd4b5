"""Check 4 of ``gpu_checks.py``: one transformer layer's measured time against the roofline prediction.

The models are the shipped configs (``hf_ftpipe/model_configs/``: T5-3B at FTPipe's BoolQ shapes,
GPT2-XL at 1024 tokens, `hf_ftpipe.hub.setups`) cut to ``cost_layers`` layers per stack and built
on the meta device; layer 1 of each stack (a middle layer: T5's layer 0 also computes the
relative position bias) is the block timed, found by module scope (`find_blocks`). Only the timed
block gets real tensors: random weights and random inputs of the traced shapes on the device. The
block runs as the pipeline runs a stage: its own ``fx.GraphModule`` (`build_stage_module`), forward
then backward with a gradient of ones on what it hands on; the median of ``block_repeats`` runs
after three untimed. The prediction is `node_costs` summed over the block's ops, on the device's
built-in profile (`get_profile("auto")`; on the CPU the ``cpu`` profile).

Per op kind, one more forward and one more backward run under ``torch.profiler``: the self time
of each ``aten::`` op (device time on CUDA, CPU time on the CPU) is summed by kind, and compared
with the prediction of the graph's ops of that kind. Kinds from the op's name (`op_kind`):
``matmul`` (mm, bmm, addmm, baddbmm, linear, matmul), ``attention`` (scaled dot-product attention
and its kernels), ``norm`` (layer_norm, rms_norm), ``elementwise`` (the rest). T5's RMSNorm is
written as pow / mean / rsqrt / mul, so it counts as elementwise on both sides.

The measured-cost profiler of issue 27 item 2 (``hf_ftpipe.runtime.block_timing``, not yet on main
when this was written) builds and times blocks the same way: `_BlockModule` is its ``_BlockRunner``,
`_median_phases` its ``median_times``, `_timed_blocks` a subset of ``plan.blocks.blocks_of``. Once
it is on main, this check should take its block times from ``time_blocks`` (one block per
signature) and keep only the per-kind profile and the comparison here.

``--quick`` times layer 1 of the correctness check's tiny GPT-2 instead (one capture less: the
test's time budget), so `capture_config` runs only at full size.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
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

    profile = get_profile("auto")
    blocks = []
    for config_name, traced in models:
        for block_name in _timed_blocks(traced.cost_graph):
            for dtype in dtypes:
                figures = _measure_block(traced, block_name, device, dtype, profile, sizes.block_repeats)
                figures = {"model": config_name, "block": block_name, "dtype": dtype, **figures}
                ratios = (figures["forward_ratio"], figures["backward_ratio"])
                figures["ok"] = all(1 / max_ratio <= r <= max_ratio for r in ratios)
                blocks.append(figures)
                log(
                    f"cost_model {config_name} {block_name} {dtype}: measured / roofline forward "
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


def _timed_blocks(graph: Any) -> list[str]:
    """Layer 1 of each stack (``transformer.h.1``, ``encoder.block.1``, ``decoder.block.1``)."""
    from hf_ftpipe.partitioners.baselines import find_blocks

    return sorted({block for block in find_blocks(graph).values() if block.endswith(".1")})


class _BlockModule:
    """One block built as a stage on ``device``: random weights for its parameters only, random inputs."""

    def __init__(self, traced: Any, block_name: str, device: torch.device) -> None:
        from hf_ftpipe.partitioners.baselines import find_blocks
        from hf_ftpipe.runtime import build_stage_module, plan_stages
        from hf_ftpipe.runtime.shapes import ShapeBook

        graph = traced.cost_graph
        self.nodes = [n for n, b in find_blocks(graph).items() if b == block_name]
        inside, order = set(self.nodes), graph.topological_order()
        start = min(order.index(n) for n in inside)
        node_stage = {n: 1 if n in inside else 0 if i < start else 2 for i, n in enumerate(order)}
        used = sorted(set(node_stage.values()))
        spec = plan_stages(graph, {n: used.index(s) for n, s in node_stage.items()})[used.index(1)]
        tensors = {}
        for name in graph.params_of(inside):
            info = graph.params[name]
            value = _random(info.shape, info.dtype, device, scale=0.02)
            tensors[name] = value if info.is_buffer else torch.nn.Parameter(value, requires_grad=info.requires_grad)
        self.module = build_stage_module(traced.graph_module, spec, traced.canonical_names, tensors, device)
        batch = {n: _random(graph.inputs[n].shape or (), graph.inputs[n].dtype, device) for n in spec.batch_inputs}
        size_values: dict[str, Any] = {}
        if spec.size_inputs:  # from every input's planned shape
            shapes = {n: torch.empty(info.shape, device="meta") for n, info in graph.inputs.items() if info.shape}
            size_values = ShapeBook(traced.shapes, graph, values=(), sizes=spec.size_inputs).of(shapes).sizes
        received = []
        for name in spec.received:
            attrs = graph.node(name)
            value = _random(attrs["output_shapes"][0], attrs["output_dtypes"][0], device)
            received.append(value.requires_grad_(bool(attrs["requires_grad"]) and value.is_floating_point()))
        self.inputs = [*batch.values(), *(size_values[n] for n in spec.size_inputs), *received]
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def phases(self) -> Iterator[None]:
        """Forward, yield, backward, yield: the caller times each phase."""
        for param in self.params:
            param.grad = None
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in self.inputs]
        outputs = self.module(*leaves)
        yield
        roots = [y for y in outputs if isinstance(y, torch.Tensor) and y.requires_grad]
        torch.autograd.backward(roots, [torch.ones_like(y) for y in roots])
        yield


def _measure_block(
    traced: Any, block_name: str, device: torch.device, dtype: str, profile: Any, repeats: int
) -> dict[str, Any]:
    from hf_ftpipe.costmodel import node_costs

    block = _BlockModule(traced, block_name, device)
    autocast = dtype != "float32"
    with torch.autocast(device.type, dtype=getattr(torch, dtype), enabled=autocast):
        forward_s, backward_s = _median_phases(block, device, repeats)
        measured_kinds = _profiled_kinds(block, device)
    costs = node_costs(traced.cost_graph, profile, dtype=dtype)
    predicted = {(kind, phase): 0.0 for kind in KINDS for phase in ("forward", "backward")}
    for node in block.nodes:
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
        "ops": len(block.nodes),
        "forward_ms": round(forward_s * 1e3, 4),
        "backward_ms": round(backward_s * 1e3, 4),
        "forward_roofline_ms": round(predicted_forward * 1e3, 4),
        "backward_roofline_ms": round(predicted_backward * 1e3, 4),
        "forward_ratio": round(forward_s / predicted_forward, 3),
        "backward_ratio": round(backward_s / predicted_backward, 3),
        "kinds": kinds,
    }


def _median_phases(block: _BlockModule, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds over ``repeats`` runs after `WARMUP` untimed (on the shared
    CPU the first runs of a tiny block took up to 100× the later ones)."""
    for _ in range(WARMUP):
        for _ in block.phases():
            pass
    runs = []
    for _ in range(repeats):
        times = []
        _synchronize(device)
        start = time.perf_counter()
        for _ in block.phases():
            _synchronize(device)
            now = time.perf_counter()
            times.append(now - start)
            start = now
        runs.append(times)
    forward_s, backward_s = (statistics.median(column) for column in zip(*runs, strict=True))
    return forward_s, backward_s


def _profiled_kinds(block: _BlockModule, device: torch.device) -> dict[tuple[str, str], float]:
    """(kind, phase) → seconds of the ``aten::`` ops' self time in one profiled run of each phase;
    a profiled run before it is thrown away (the profiler's first run was 100× slow on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):
        found = {(kind, phase): 0.0 for kind in KINDS for phase in ("forward", "backward")}
        phases = block.phases()
        for phase in ("forward", "backward"):
            with profile(activities=activities) as profiler:
                next(phases)
                _synchronize(device)
            for event in profiler.key_averages():
                if event.key.startswith("aten::"):
                    self_us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
                    found[op_kind(event.key), phase] += self_us * 1e-6
    return found


def _random(shape: Any, dtype: str | None, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Values of a trained model's scale: floats ``scale × randn``, 1-D weights (norms, biases) ones,
    integers ones (a valid token, label, mask or index). Only time is measured."""
    torch_dtype = getattr(torch, (dtype or "float32").removeprefix("torch."))
    if not torch_dtype.is_floating_point or len(shape) == 1:
        return torch.ones(tuple(shape), dtype=torch_dtype, device=device)
    return torch.randn(tuple(shape), dtype=torch_dtype, device=device) * scale


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
