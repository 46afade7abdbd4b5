"""What each rank of ``benchmarks/terapipe.py`` does: train one slicing, or time its stage on a grid of slices.

Every runner, and the latency measurement the DP plans on, runs in fresh rank processes
(``_rank_processes.py``); this is the work they are given, a `Job`, and the one capture of the
model (whole or sliced) that both these ranks and ``terapipe.py``'s predictions build from.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from _gpt2_split import Placement, Setup, build_model, make_batch, split_graph

GRID_LENGTHS = (64, 128, 256, 512, 1024)
"""Slice lengths timed for the latency fit (with every context that fits the sequence)."""

Job = tuple[str, Any]
"""``("train", slices or None)`` or ``("latency", repeats)``: what the rank processes do."""


def capture(setup: Setup, slices: tuple[int, ...] | None, dynamic: bool = True) -> tuple[Any, Any]:
    """The model and what the engine takes: a `TracedModel` unsliced, else a `SlicedModel` (with
    ``dynamic=False`` a fixed-shape graph per slice length, which the memory prediction reads)."""
    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.graph.token_slices import capture_token_slices

    model = build_model(setup)
    batch = make_batch(setup, 0)
    if slices is None:
        return model, capture_model(model, batch)
    return model, capture_token_slices(model, batch, list(slices), dynamic=dynamic)


def run_job(rank: int, setup: Setup, job: Job) -> dict[str, Any]:
    """This rank's part of ``job``: `run_rank`'s figures, or `time_stage`'s timings as ``{"samples": ...}``."""
    kind, argument = job
    if kind == "latency":
        return {"samples": time_stage(rank, setup, argument)}
    return run_rank(rank, setup, argument)


def run_rank(rank: int, setup: Setup, slices: list[int] | None) -> dict[str, Any]:
    """Build the engine (whole sequence when ``slices`` is None), step it, and return this rank's figures."""
    import gc

    import torch.distributed as dist

    from hf_ftpipe.runtime import PipelineEngine
    from hf_ftpipe.runtime.peak_memory import PeakMemory

    _, traced = capture(setup, None if slices is None else tuple(slices))
    whole = traced if slices is None else traced.full
    placement = Placement(split_graph(whole.cost_graph, setup), [0, 1])
    batches = [make_batch(setup, step) for step in range(2)]
    device = torch.device("cpu")
    gc.collect()
    dist.barrier()
    memory = PeakMemory(device)
    with memory:
        engine = PipelineEngine(traced, placement, num_microbatches=1, schedule="gpipe", device=device)
        optimizer = torch.optim.SGD(engine.parameters(), lr=1e-3)
        memory.own(engine.parameters())
        for step in range(setup.warmup):
            engine.train_step(batches[step % 2])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    times, loss = [], None
    for step in range(setup.steps):
        start = time.perf_counter()
        loss = engine.train_step(batches[step % 2])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    dist.barrier()
    return {
        "step_time_s": statistics.median(times),
        "peak_bytes": memory.peak_bytes(),
        "loss": float(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None,
    }


def time_stage(rank: int, setup: Setup, repeats: int) -> list[tuple[int, int, int, float]]:
    """This rank's stage timed on the grid of (slice, context) lengths, every rank at the same
    moment (a barrier per point), as the pipeline runs them: two ranks on one machine share its
    memory bandwidth, and a stage timed alone is faster than in the pipeline."""
    import torch.distributed as dist

    from hf_ftpipe.runtime import build_stage_module, plan_stages
    from hf_ftpipe.runtime.slice_timing import time_slice_grid
    from hf_ftpipe.runtime.token_slicing import TokenSlicing

    lengths = [*GRID_LENGTHS, setup.seq_len - sum(GRID_LENGTHS)]
    _, sliced = capture(setup, tuple(lengths), dynamic=False)  # timed per slice length
    whole = sliced.full
    node_stage = split_graph(whole.cost_graph, setup)
    specs = plan_stages(whole.cost_graph, node_stage)
    cpu = torch.device("cpu")
    module = build_stage_module(whole.graph_module, specs[rank], whole.canonical_names, whole.tensors, cpu)
    slicing = TokenSlicing(sliced, specs, node_stage, {rank: module}, cpu)
    grid = [(s, c) for s in GRID_LENGTHS for c in range(0, setup.seq_len - s + 1, 512)]
    return time_slice_grid(slicing, rank, make_batch(setup, 0), grid, repeats=repeats, barrier=dist.barrier)
