"""What each rank of ``benchmarks/hybrid.py`` does: one P × D layout of the runtime benchmark's GPT-2.

A layout runs D replicas of a P-rank pipeline (replica d on ranks d·P … d·P + P − 1) with
`PipelineEngine(data_parallel_size=D)`, on the plan `compare_layouts` made for it. The model, the
batches and the engine's runner are ``runtime.py``'s (`_gpt2_split`, `HfFtpipeRunner`); only the
placement and the replicas differ.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _gpt2_split import Placement, Setup, build_model, make_batch
from _runtime_ranks import HfFtpipeRunner


@dataclass(frozen=True)
class LayoutRun:
    """What every rank of one layout needs: P, D, the plan's placement and the schedule."""

    pipeline_gpus: int
    replicas: int
    node_stage: dict[str, int]
    stage_device: list[int]
    """Pipeline positions 0..P − 1, the same plan in every replica."""
    schedule: str


class ReplicatedRunner(HfFtpipeRunner):
    """`HfFtpipeRunner` on a given plan, one of D replicas: each runs M / D of the global batch's micro-batches."""

    def __init__(self, rank: int, setup: Setup, run: LayoutRun) -> None:
        super().__init__(rank, setup, build_model(setup), run.schedule)
        self.run = run
        self.placement = Placement(dict(run.node_stage), list(run.stage_device))

    def build(self) -> None:
        from hf_ftpipe.runtime import PipelineEngine

        replicas = self.run.replicas
        keywords: dict[str, Any] = {"data_parallel_size": replicas} if replicas > 1 else {}
        self.engine = PipelineEngine(
            self.traced,
            self.placement,
            num_microbatches=self.setup.num_microbatches // replicas,  # per replica: D × M/D globally
            device=self.device,
            schedule=self.schedule,
            **keywords,
        )
        self.optimizer = torch.optim.SGD(self.engine.parameters(), lr=self.setup.lr)


def run_layout_rank(rank: int, setup: Setup, run: LayoutRun) -> dict[str, Any]:
    """Build this rank's replica of the layout, warm it up, and time ``setup.steps`` steps of the global batch."""
    runner = ReplicatedRunner(rank, setup, run)
    batches = [make_batch(setup, step) for step in range(2)]  # the global batch, the same on every rank
    gc.collect()
    dist.barrier()
    runner.build()
    losses = [_value(runner.step(batches[step % 2])) for step in range(setup.warmup)]
    dist.barrier()
    step_times_s = []
    for step in range(setup.steps):
        start = time.perf_counter()
        loss = runner.step(batches[(setup.warmup + step) % 2])
        step_times_s.append(time.perf_counter() - start)
    dist.barrier()
    losses.append(_value(loss))
    return {"rank": rank, "step_time_s": statistics.median(step_times_s), "losses": losses}


def _value(loss: Any) -> float | None:
    """The loss as a number (None on a rank that returns none)."""
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
