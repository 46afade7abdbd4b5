"""``runtime.py --paired``: every runner in the same rank processes, timed step by step in turn.

Separate launches time each runner at another moment, and on a shared machine the cores' speed can
move between launches by more than the schedules differ (README.md has such a run). Here one launch
builds every runner, then runs step 1 of each, step 2 of each, and so on, every step between two
barriers; the ratio of two runners is taken step by step, so a slow spell of the machine hits both
sides of a ratio alike. What separate launches measure and this does not: memory (runners built in
one process share its allocator) and the stages alone.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch.distributed as dist
from _gpt2_split import Setup, make_batch
from _runtime_ranks import make_runner


def run_paired(rank: int, setup: Setup, runner_setups: dict[str, Setup]) -> dict[str, Any]:
    """This rank's wall time of every step of every runner (ms), the runners stepped in turn.

    ``setup.warmup`` steps of each runner first, untimed; then ``setup.steps`` rounds of one step of each."""
    pipes = {runner: make_runner(rank, runner_setup, runner) for runner, runner_setup in runner_setups.items()}
    for pipe in pipes.values():
        pipe.build()
    batches = [make_batch(setup, step) for step in range(2)]
    for pipe in pipes.values():
        for step in range(setup.warmup):
            pipe.step(batches[step % 2])
    gc.collect()
    step_ms: dict[str, list[float]] = {runner: [] for runner in pipes}
    for step in range(setup.steps):
        for runner, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.step(batches[step % 2])
            dist.barrier()  # the step ends when its slowest rank's part does
            step_ms[runner].append(1000 * (time.perf_counter() - start))
    for pipe in pipes.values():
        pipe.finish()
    return {"rank": rank, "step_ms": step_ms}
