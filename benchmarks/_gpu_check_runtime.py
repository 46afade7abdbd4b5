"""Checks 2 and 3 of ``gpu_checks.py``: peak memory against the prediction, the split graph against eager.

Both run the engine with every stage on rank 0 on the first model of the sizes (GPT-2).

- ``memory``: for each schedule, with and without recomputation, `PeakMemory` over the engine's
  construction and ``steps`` SGD steps (drained) against `estimate_memory` for the same plan
  (optimizer ``sgd``): the ratio measured / predicted per rank (one rank here). On CUDA the peak is
  ``max_memory_allocated`` less what was allocated before the block (earlier checks' leftovers);
  on the CPU, tensors allocated inside the block (`PeakMemory`).
- ``split_vs_eager``: steps per second of the engine (gpipe, one micro-batch) against the model's
  own modules trained eagerly on the same micro-batch (forward, backward, SGD step): the cost of
  running the exported, split graph. The median of ``timed_steps`` steps after as many untimed.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _gpu_check_correctness import LR, SCHEDULES
from _gpu_check_models import Captured, Sizes, microbatches

MB = 2**20


def check_memory(
    captured: Captured, sizes: Sizes, device: torch.device, tolerance: float, log: Callable[[str], None]
) -> dict[str, Any]:
    from hf_ftpipe.costmodel import estimate_memory
    from hf_ftpipe.costmodel.options import MemoryOptions

    graph, placement = captured.traced.cost_graph, captured.placement
    runs = []
    for schedule, recompute in sizes.memory_runs or [(s, r) for s in SCHEDULES for r in (False, True)]:
        run: dict[str, Any] = {"schedule": schedule, "recompute": recompute}
        try:
            measured = _peak_bytes(captured, sizes, device, schedule, recompute)
        except Exception as error:  # a CUDA-only failure of one schedule: the other runs still report
            runs.append({**run, "ok": False, "error": f"{type(error).__name__}: {error}"})
            log(traceback.format_exc())
            continue
        predicted = estimate_memory(
            graph,
            placement.node_stage,
            placement.stage_device,
            num_microbatches=sizes.num_microbatches,
            optimizer="sgd",
            schedule=schedule,
            memory=MemoryOptions(recompute=recompute),
        )
        ratios = [m / p for m, p in zip(measured, predicted, strict=True)]
        run["measured_mb"] = [round(b / MB, 2) for b in measured]
        run["predicted_mb"] = [round(b / MB, 2) for b in predicted]
        run["ratio"] = [round(r, 3) for r in ratios]
        run["ok"] = all(abs(r - 1) <= tolerance for r in ratios)
        runs.append(run)
        log(f"memory {schedule} recompute={recompute}: measured / predicted {ratios}")
    return {
        "check": "memory",
        "ok": all(run["ok"] for run in runs),
        "model": captured.size.name,
        "tolerance": tolerance,
        "runs": runs,
    }


def _peak_bytes(captured: Captured, sizes: Sizes, device: torch.device, schedule: str, recompute: bool) -> list[int]:
    """Rank 0's peak over the engine's construction and its steps (a list: one entry per rank)."""
    from hf_ftpipe.runtime import PeakMemory, PipelineEngine

    captured.reset()
    gc.collect()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    memory = PeakMemory(device)
    with memory:
        engine = PipelineEngine(
            captured.traced,
            captured.placement,
            num_microbatches=sizes.num_microbatches,
            schedule=schedule,
            recompute=recompute,
            device=device,
        )
        memory.own(engine.parameters())
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        if engine.streaming:
            engine.attach_optimizer(optimizer)
        for batch in captured.data:
            engine.train_step(batch)
            if not engine.streaming:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if engine.streaming:
            engine.drain()  # inside the block: PeakMemory's CPU profiler must not stop mid-pipeline
    peak = memory.peak_bytes() - before
    del engine, optimizer
    return [peak]


def check_split_vs_eager(
    captured: Captured, sizes: Sizes, device: torch.device, min_ratio: float, log: Callable[[str], None]
) -> dict[str, Any]:
    microbatch = microbatches(captured.data[0], sizes.num_microbatches)[0]
    engine_s = _engine_step_s(captured, microbatch, sizes, device)
    eager_s = _eager_step_s(captured, microbatch, sizes, device)
    ratio = eager_s / engine_s
    log(f"split_vs_eager: engine {1 / engine_s:.2f} steps/s, eager {1 / eager_s:.2f} steps/s")
    return {
        "check": "split_vs_eager",
        "ok": ratio >= min_ratio,
        "model": captured.size.name,
        "microbatch_size": sizes.microbatch_size,
        "engine_steps_per_s": round(1 / engine_s, 3),
        "eager_steps_per_s": round(1 / eager_s, 3),
        "ratio": round(ratio, 3),
        "min_ratio": min_ratio,
    }


def _engine_step_s(
    captured: Captured, microbatch: dict[str, torch.Tensor], sizes: Sizes, device: torch.device
) -> float:
    """Median step of the engine: every stage on rank 0, gpipe, one micro-batch, SGD."""
    from hf_ftpipe.runtime import PipelineEngine

    captured.reset()
    engine = PipelineEngine(captured.traced, captured.placement, num_microbatches=1, schedule="gpipe", device=device)
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)

    def step() -> None:
        engine.train_step(microbatch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _median_step_s(step, sizes.timed_steps, device)


def _eager_step_s(captured: Captured, microbatch: dict[str, torch.Tensor], sizes: Sizes, device: torch.device) -> float:
    """Median step of the model's own modules on the same micro-batch: forward, backward, SGD."""
    captured.reset()
    model = copy.deepcopy(captured.model).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    on_device = {name: value.to(device) for name, value in microbatch.items()}

    def step() -> None:
        model(**on_device).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _median_step_s(step, sizes.timed_steps, device)


def _median_step_s(step: Callable[[], None], count: int, device: torch.device) -> float:
    """Median seconds of ``step`` over ``count`` timed runs after ``count`` untimed ones."""
    times = []
    for i in range(2 * count):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        if i >= count:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
