"""Time each block of a traced model on this device: the measured side of the cost model.

FTPipe profiled its graphs on the GPUs it planned for; PipeDream's planner works from measured layer
times. Here a block (`hf_ftpipe.plan.blocks`: a layer, or the ops between layers) runs as the
pipeline runs a stage: its own ``fx.GraphModule`` (`build_stage_module`) reading random values of
the shapes it receives, forward then backward with a gradient of ones on what it hands on, warm-up
runs first, the median of the timed ones kept. Blocks with equal signatures (the layers of one
stack) are timed once, so a full-size model is profiled in a handful of blocks. Only the timed
blocks' weights are made, randomly, on the device: the model itself may live on the meta device.

The backward runs split, as ``zb-h1`` and ``zbv`` run it (`hf_ftpipe.runtime.split_backward`):
``B``, then ``W`` (the weight gradients of the products with a weight), timed apart. Their sum is
the whole backward's work; ``W`` is what those schedules defer, and no share of the block's time
by op says how large it is: the roofline's shares gave GPT-2's products on a CPU thread about
half the backward, where ``W`` alone measured 40-45% of it.

The timings are plain data, as the runtime does not import the cost model:
``hf_ftpipe.costmodel.CostTable.from_timings`` makes the table of them (``hf_ftpipe.profile_model``
does both). The timing core (`median_times`) is shared with TeraPipe's slice timing
(`hf_ftpipe.runtime.slice_timing`).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import torch

from hf_ftpipe.errors import ProfileError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.trace import TracedModel
from hf_ftpipe.plan.blocks import Block, blocks_of
from hf_ftpipe.plan.keys import params_dtype
from hf_ftpipe.runtime.shapes import ShapeBook
from hf_ftpipe.runtime.split_backward import DeferredWeightGradient, collecting, defer_weight_gradients
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, plan_stages

__all__ = [
    "BlockRunner",
    "BlockTimings",
    "TimedBlock",
    "TimingOptions",
    "default_device",
    "device_name",
    "dtype_name",
    "median_times",
    "progress",
    "time_blocks",
    "weights_for",
]


def median_times(
    phases: Callable[[], Iterator[None]], *, warmup: int, repeats: int, device: torch.device
) -> list[float]:
    """Median seconds of each phase of ``phases`` over ``repeats`` timed runs after ``warmup`` untimed ones.

    ``phases()`` is a generator that yields after each phase (forward, backward...): the device is
    synchronised and the clock read at every yield, so one run times every phase of it.
    """
    for _ in range(warmup):
        for _ in phases():
            pass
    runs: list[list[float]] = []
    for _ in range(repeats):
        _synchronize(device)
        times, start = [], time.perf_counter()
        for _ in phases():
            _synchronize(device)
            now = time.perf_counter()
            times.append(now - start)
            start = now
        runs.append(times)
    return [statistics.median(column) for column in zip(*runs, strict=True)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(total: int, description: str) -> Any:
    """A tqdm bar on stderr (it is a transformers dependency) for ``total`` steps."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="block", file=sys.stderr, leave=False)


def device_name(device: torch.device) -> str:
    """What a cost table records as its device: the GPU's name, else the device type (``"cpu"``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class TimedBlock(NamedTuple):
    """One block's measured time (``timed_as``: the block whose time it reuses, ``""`` when timed itself)."""

    name: str
    nodes: tuple[str, ...]
    forward_s: float
    backward_s: float
    timed_as: str
    weight_s: float = 0.0
    """The part of ``backward_s`` spent in the products' weight gradients (a split backward's ``W``)."""


@dataclass(frozen=True)
class BlockTimings:
    """What `time_blocks` measured, as plain data (``CostTable.from_timings`` makes the table of it)."""

    blocks: list[TimedBlock]
    dtype: str
    device: str
    warmup: int
    repeats: int


class TimingOptions(TypedDict, total=False):
    """The keywords of `time_blocks` (``**options: Unpack[TimingOptions]``), for callers that pass them on."""

    dtype: str | None
    device: torch.device | None
    warmup: int
    repeats: int
    show_progress: bool


def time_blocks(
    traced: TracedModel,
    *,
    dtype: str | None = None,
    device: torch.device | None = None,
    warmup: int = 1,
    repeats: int = 3,
    show_progress: bool = True,
) -> BlockTimings:
    """Time one block per signature of ``traced`` on ``device``; every block gets its kind's time.

    Args:
        dtype (`str`, *optional*): the compute dtype (default: the weights'). Another dtype than the
            weights' runs under autocast, as a run with ``bf16=True`` does.
        device (`torch.device`, *optional*): default CUDA when available, else CPU.
        warmup, repeats (`int`): untimed runs, then timed runs per block (the median is kept).
        show_progress (`bool`): say up front how many blocks run, and show a progress bar (stderr).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"`repeats` must be ≥ 1 and `warmup` ≥ 0, got {repeats} and {warmup}")
    device = device or default_device()
    graph = traced.cost_graph
    weights_dtype = params_dtype(graph)
    dtype = dtype_name(dtype) if dtype is not None else weights_dtype
    blocks = blocks_of(graph)
    first: dict[str, Block] = {}
    for block in blocks:
        first.setdefault(block.signature, block)
    if show_progress:
        print(
            f"profiling {graph.model_class} on {device_name(device)} in {dtype}: {len(blocks)} blocks, "
            f"{len(first)} to time (the rest repeat one), {warmup} warm-up + {repeats} timed runs each",
            file=sys.stderr,
        )
    timed: dict[str, tuple[float, float, float]] = {}
    bar = progress(len(first), "profiling") if show_progress else None
    autocast = dtype != weights_dtype
    for signature, block in first.items():
        runner = BlockRunner(traced, block, device)
        with torch.autocast(device.type, dtype=getattr(torch, dtype)) if autocast else contextlib.nullcontext():
            forward_s, input_s, weight_s = median_times(runner.phases, warmup=warmup, repeats=repeats, device=device)
        weight_s = weight_s if runner.weight_gradients else 0.0  # no product: W is an empty loop
        timed[signature] = (forward_s, input_s + weight_s, weight_s) if runner.has_backward else (forward_s, 0.0, 0.0)
        del runner  # its weights: the next block's may not fit beside them
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return BlockTimings(
        blocks=[
            TimedBlock(
                block.name,
                block.nodes,
                *timed[block.signature][:2],
                timed_as="" if first[block.signature] is block else first[block.signature].name,
                weight_s=timed[block.signature][2],
            )
            for block in blocks
        ],
        dtype=dtype,
        device=device_name(device),
        warmup=warmup,
        repeats=repeats,
    )


def default_device() -> torch.device:
    """CUDA's current device when there is one, else the CPU: where a profile runs unless told."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dtype_name(dtype: str) -> str:
    """The name of a torch dtype (``"bfloat16"`` for ``"torch.bfloat16"``); a `ProfileError` for anything else."""
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ProfileError(f"unknown dtype {dtype!r}; use a torch dtype name such as float32, bfloat16 or float16")
    return str(value).removeprefix("torch.")


class BlockRunner:
    """One block built as a stage with random weights and inputs on ``device``, run as forward, then its
    backward split as a zero-bubble schedule splits it: input gradients (``B``), then weight gradients (``W``)."""

    def __init__(self, traced: TracedModel, block: Block, device: torch.device) -> None:
        graph = traced.cost_graph
        inside = set(block.nodes)
        order = graph.topological_order()
        start = next(i for i, n in enumerate(order) if n in inside)
        node_stage = {n: (1 if n in inside else 0 if i < start else 2) for i, n in enumerate(order)}
        used = sorted(set(node_stage.values()))  # no stage before the first block, or after the last
        node_stage = {n: used.index(s) for n, s in node_stage.items()}
        spec = plan_stages(graph, node_stage)[used.index(1)]
        tensors = weights_for(traced, inside, device)
        self.module = build_stage_module(traced.graph_module, spec, traced.canonical_names, tensors, device)
        defer_weight_gradients(self.module)  # the same values; the products' weight gradients wait for W
        self.inputs = _inputs(traced, graph, spec, device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.has_backward = any(graph.node(n)["requires_grad"] for n in block.nodes)
        self.weight_gradients = 0
        """The products whose weight gradients the last backward deferred to ``W``."""

    def phases(self) -> Iterator[None]:
        for p in self.params:  # each micro-batch's gradients start from none, as the first one's do
            p.grad = None
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in self.inputs]
        outputs = self.module(*leaves)
        yield
        roots = [y for y in outputs if isinstance(y, torch.Tensor) and y.requires_grad]
        deferred: list[DeferredWeightGradient] = []
        if roots:
            with collecting() as deferred:
                torch.autograd.backward(roots, [torch.ones_like(y) for y in roots])
        self.weight_gradients = len(deferred)
        yield
        for weight_gradient in deferred:
            weight_gradient.apply()
        yield


def weights_for(traced: TracedModel, nodes: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The weights ``nodes`` read, by canonical name, on ``device``: the model's own where it has
    them, random ones of their shapes where it lives on the meta device. Only these are made, so a
    full-size model is timed a block at a time at the memory of one."""
    graph = traced.cost_graph
    return {name: _weight(graph, name, traced.tensors.get(name), device) for name in graph.params_of(nodes)}


def _weight(graph: CostGraph, name: str, tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The model's own tensor on ``device``, or, where it has none (meta), a random one of its shape:
    only time is measured, so values matter only where they index (integers: ones)."""
    info = graph.params[name]
    if tensor is not None and not tensor.is_meta:
        value = tensor.detach().to(device)
    else:
        value = _random(info.shape, getattr(torch, info.dtype.removeprefix("torch.")), device)
    if info.is_buffer:
        return value
    return torch.nn.Parameter(value, requires_grad=info.requires_grad)


def _inputs(traced: TracedModel, graph: CostGraph, spec: StageSpec, device: torch.device) -> list[torch.Tensor]:
    """The stage's batch inputs, sizes and received values, random of the planned shapes."""
    batch = {
        name: _random(graph.inputs[name].shape or (), _torch_dtype(graph.inputs[name].dtype), device)
        for name in spec.batch_inputs
    }
    sizes: dict[str, Any] = {}
    if spec.size_inputs:
        shapes = {n: torch.empty(info.shape, device="meta") for n, info in graph.inputs.items() if info.shape}
        sizes = ShapeBook(traced.shapes, graph, [], spec.size_inputs).of(shapes).sizes  # from every input's
    received = []
    for name in spec.received:
        attrs = graph.node(name)
        value = _random(attrs["output_shapes"][0], _torch_dtype(attrs["output_dtypes"][0]), device)
        received.append(value.requires_grad_(attrs["requires_grad"] and value.is_floating_point()))
    return [*batch.values(), *[sizes[name] for name in spec.size_inputs], *received]


def _random(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(tuple(shape), dtype=dtype, device=device) * 0.02
    return torch.ones(tuple(shape), dtype=dtype, device=device)  # token 1, label 1, mask on, index 1


def _torch_dtype(name: str | None) -> torch.dtype:
    return getattr(torch, (name or "float32").removeprefix("torch."))
