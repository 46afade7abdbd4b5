"""Time one stage's forward + backward of a token slice after some context, on this device.

TeraPipe (Li et al., ICML 2021, §3.3; zhuohan123/terapipe, ``latency_model.py``) chooses slice
lengths from measured timings: a layer is timed on a grid of (slice length, context length) and a
linear model is fitted to them. Here the timed unit is a pipeline stage as the engine runs it: the
stage's module at the slice's length (`TokenSlicing`), with `PrefixAttention` pointed at a
`SequenceKV` whose buffers already hold ``context_len`` tokens of keys and values (random: only
their shape matters for time). The samples are plain tuples so that the runtime does not import
the cost model; ``hf_ftpipe.costmodel.latency.SliceLatency.fit`` takes them as ``LatencySample``::

    samples = time_slice_grid(slicing, stage_index=0, microbatch=batch, grid=[(64, 0), (64, 512), ...])
    latency = SliceLatency.fit([LatencySample(*x) for x in samples], key, source="measured")
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from hf_ftpipe.graph.token_slices import SlicedModel
from hf_ftpipe.plan.blocks import blocks_of, signature_of
from hf_ftpipe.plan.keys import params_dtype
from hf_ftpipe.runtime.block_timing import median_times, progress, weights_for
from hf_ftpipe.runtime.prefix_attention import PrefixAttention, SequenceKV
from hf_ftpipe.runtime.shapes import ShapeBook
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, plan_stages
from hf_ftpipe.runtime.token_slicing import TokenSlicing

__all__ = ["time_slice", "time_slice_grid", "time_stages"]

Sample = tuple[int, int, int, float]
"""``(slice_len, context_len, batch_size, time_s)``: the fields of ``LatencySample``."""


def time_slice(
    slicing: TokenSlicing,
    stage_index: int,
    microbatch: Mapping[str, Any],
    slice_len: int,
    context_len: int,
    *,
    repeats: int = 3,
) -> float:
    """Median seconds of ``stage_index``'s forward + backward on a ``slice_len``-token slice after
    ``context_len`` tokens of context (one untimed run first).

    ``slice_len`` must be one of ``slicing.slice_lengths``: a capture with a symbolic length runs it
    on the whole graph's stages (the shapes from its formulas), a fixed-shape one on the stage built
    for that length. Received
    values are random of the slice's shapes; every output that goes on gets a gradient of ones.
    The backward adds into the stage's parameters' ``.grad``, which are the model's: time a copy
    of the model, or zero its gradients before training.
    """
    if slice_len not in slicing.slice_lengths:
        raise ValueError(
            f"no stage is built for slices of {slice_len} tokens; capture the model with it among "
            f"`slice_lengths` (built: {sorted(set(slicing.slice_lengths))})"
        )
    index = slicing.slice_lengths.index(slice_len)
    spec, module = slicing.spec(stage_index, index), slicing.module(stage_index, index)
    device = next(iter(module.parameters())).device
    inputs = _slice_inputs(slicing, microbatch, index, context_len, spec, device)
    cursor = slicing.cursors[stage_index]
    batch_size = int(next(iter(microbatch.values())).shape[0])
    padding = torch.ones(batch_size, context_len + slice_len, dtype=torch.bool, device=device)

    sequence = SequenceKV(padding)
    if context_len:  # the earlier slices' keys and values, as their forwards would have left them
        for layer, shape in _kv_shapes(module, cursor, padding[:, :slice_len], inputs).items():
            full = (*shape[:-2], context_len + slice_len, shape[-1])
            sequence.keys[layer] = torch.randn(full, device=device)
            sequence.values[layer] = torch.randn(full, device=device)

    def run() -> Iterator[None]:
        # The sequence's buffers are reused from run to run (the slice rewrites its own keys and
        # values; gradients left for earlier slices add up), so only the slice's work is timed.
        cursor.point(sequence, context_len)
        leaves = [x.detach().requires_grad_(x.is_floating_point()) if torch.is_tensor(x) else x for x in inputs]
        outputs = module(*leaves)
        roots = [y for y in outputs if isinstance(y, torch.Tensor) and y.requires_grad]
        torch.autograd.backward(roots, [torch.ones_like(y) for y in roots])
        yield  # one phase: forward + backward

    (time_s,) = median_times(run, warmup=1, repeats=repeats, device=device)
    return time_s


def time_slice_grid(
    slicing: TokenSlicing,
    stage_index: int,
    microbatch: Mapping[str, Any],
    grid: Iterable[tuple[int, int]],
    *,
    repeats: int = 3,
    barrier: Callable[[], None] | None = None,
) -> list[Sample]:
    """`time_slice` at every ``(slice_len, context_len)`` of ``grid``.

    ``barrier`` (e.g. ``torch.distributed.barrier``) runs before each point: every rank then times
    its stage at the same moment, as the pipeline runs them. Ranks that share a machine's memory
    bandwidth slow each other down, which a stage timed while the others idle does not show.
    """
    batch_size = int(next(iter(microbatch.values())).shape[0])
    samples = []
    for s, c in grid:
        if barrier is not None:
            barrier()
        samples.append((s, c, batch_size, time_slice(slicing, stage_index, microbatch, s, c, repeats=repeats)))
    return samples


def time_stages(
    sliced: SlicedModel,
    node_stage: Mapping[str, int],
    microbatch: Mapping[str, Any],
    grid: Iterable[tuple[int, int]],
    device: torch.device,
    *,
    repeats: int = 3,
    dtype: str | None = None,
    show_progress: bool = True,
) -> list[Sample]:
    """The slowest stage of ``node_stage`` at each point of ``grid``, timed in this one process:
    TeraPipe's DP takes the pipeline's stages as equal, so the slowest sets the pace.

    Where the stages are cut on block boundaries (`plan.blocks.layer_stages`), each kind of block
    (`plan.blocks`: a layer, the ops before and after the layers) is timed once per point and a
    stage's time is the sum of its blocks': GPT2-XL on 8 stages is 3 blocks per point, not 8 stages
    of 6 layers. Otherwise stages are the units, and equal ones (`signature_of`) are timed once.
    A unit without attention takes as long after any context, so it is timed once per slice length.
    How many units and points run is said up front, and a progress bar counts them (stderr,
    unless ``show_progress`` is off). Only the timed units' weights are made (`weights_for`): the
    model may live on the meta device, and then gets random ones; a real model lends its values
    (the gradients go to the timed units' own parameters, not the model's). ``dtype`` other than the weights' runs under
    autocast, as a run with ``bf16=True`` does.
    """
    whole = sliced.full
    graph = whole.cost_graph
    blocks = blocks_of(graph)
    if all(len({node_stage[n] for n in b.nodes}) == 1 for b in blocks):
        unit_of = {n: u for u, b in enumerate(blocks) for n in b.nodes}
        what = "blocks"
    else:
        unit_of, what = dict(node_stage), "stages"
    specs = plan_stages(graph, unit_of)
    stage_units: dict[int, list[int]] = {}
    for u, spec in enumerate(specs):
        stage_units.setdefault(node_stage[spec.nodes[0]], []).append(u)
    representative: dict[str, int] = {}
    same_as = [representative.setdefault(signature_of(graph, spec.nodes), u) for u, spec in enumerate(specs)]
    timed = sorted(representative.values())
    # One set of weights for every timed unit: a tied weight (GPT-2's wte and lm_head) is made once.
    weights = weights_for(whole, [n for u in timed for n in specs[u].nodes], device)
    modules = {
        u: build_stage_module(whole.graph_module, specs[u], whole.canonical_names, weights, device).to(device)
        for u in timed
    }
    slicing = TokenSlicing(sliced, specs, unit_of, modules, device)
    points = list(grid)
    # A unit without attention (the embeddings, the head) takes as long after any context: timed
    # once per slice length, at the first context the grid has for it.
    attends = {u: any(isinstance(m, PrefixAttention) for m in slicing.module(u, 0).modules()) for u in timed}
    first_point = {s: p for p, (s, _) in reversed(list(enumerate(points)))}
    runs = {u: list(range(len(points))) if attends[u] else sorted(first_point.values()) for u in timed}
    made = sum(w.numel() for w in weights.values() if isinstance(w, torch.nn.Parameter))
    total = sum(info.numel for info in graph.params.values() if not info.is_buffer)
    count = sum(len(r) for r in runs.values())
    if show_progress:
        print(
            f"timing {len(timed)} of {len(specs)} {what} (the others repeat one) at {len(points)} (slice, context) "
            f"points, those without attention once per slice length: {count} timings of 1 warm-up + {repeats} "
            f"runs, on {made:,} of the model's {total:,} parameters",
            file=sys.stderr,
        )
    bar = progress(count, "timing slices") if show_progress else None
    times: dict[int, list[Sample]] = {}
    weights_dtype = params_dtype(graph)
    autocast = dtype is not None and dtype != weights_dtype
    for u in timed:
        timed_at: dict[int, Sample] = {}
        for p in runs[u]:
            with torch.autocast(device.type, dtype=getattr(torch, dtype)) if autocast else contextlib.nullcontext():
                (timed_at[p],) = time_slice_grid(slicing, u, microbatch, [points[p]], repeats=repeats)
            if bar is not None:
                bar.update(1)
        times[u] = [timed_at[p if attends[u] else first_point[s]] for p, (s, _) in enumerate(points)]
    if bar is not None:
        bar.close()
    samples = []
    for p, (s, c) in enumerate(points):
        batch_size = times[timed[0]][p][2]
        slowest = max(sum(times[same_as[u]][p][3] for u in units) for units in stage_units.values())
        samples.append((s, c, batch_size, slowest))
    return samples


def _kv_shapes(
    module: torch.nn.Module, cursor: Any, padding: torch.Tensor, inputs: list[torch.Tensor]
) -> dict[str, tuple[int, ...]]:
    """Each attention layer's key shape at this slice, from one forward without context."""
    probe = SequenceKV(padding)
    cursor.point(probe, 0)
    with torch.no_grad():
        module(*inputs)
    return {layer: tuple(key.shape) for layer, key in probe.keys.items()}


def _slice_inputs(
    slicing: TokenSlicing,
    microbatch: Mapping[str, Any],
    index: int,
    context_len: int,
    spec: StageSpec,
    device: torch.device,
) -> list[torch.Tensor]:
    """The stage's batch inputs at slice ``index`` (positions moved to start at ``context_len``),
    its sizes, then random received values of the slice's shapes."""
    pieces = slicing.split(0, microbatch)
    piece = dict(pieces[index])
    length = slicing.slice_lengths[index]
    if "position_ids" in piece:
        positions = torch.arange(context_len, context_len + length)
        piece["position_ids"] = positions.expand_as(torch.as_tensor(piece["position_ids"])).contiguous()
    batch = [torch.as_tensor(piece[name]).to(device) for name in spec.batch_inputs]
    book = ShapeBook(slicing.full.shapes, slicing.full.cost_graph, spec.received, spec.size_inputs)
    shapes = slicing.shapes(index, piece, book)
    sizes = [shapes.sizes[name] for name in spec.size_inputs]
    received = [torch.randn(shapes.values[value], device=device) for value in spec.received]
    return [*batch, *sizes, *received]
