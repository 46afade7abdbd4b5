"""Fresh rank processes for one benchmark runner: spawn them, wait with a deadline, collect each rank's figures.

``runtime.py`` and ``terapipe.py`` both run every runner in processes of its own, so that no runner
inherits another's threads, allocator state or process group. A rank that fails sends its
traceback; the first to report is raised, because its peers' errors are mostly "connection closed".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from _gpt2_split import Setup

Work = Callable[[int, Setup, Any], dict[str, Any]]
"""``work(rank, setup, argument)``: what one rank does once its process group is up; a module-level
function, so that the spawned processes can import it."""


def _rank_entry(rank: int, setup: Setup, work: Work, argument: Any, rendezvous: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(setup.threads_per_rank)
    try:
        if setup.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if setup.device == "cuda" else "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=setup.num_ranks,
            timeout=timedelta(seconds=120),
        )
        results.put((rank, work(rank, setup, argument), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(setup: Setup, work: Work, argument: Any, timeout_s: float) -> list[dict[str, Any]]:
    """Every rank's ``work(rank, setup, argument)``; raises RuntimeError with the first failing rank's traceback."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank_entry, args=(rank, setup, work, argument, rendezvous, results))
            for rank in range(setup.num_ranks)
        ]
        for process in processes:
            process.start()
        figures: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        end = time.monotonic() + timeout_s
        while len(figures) + len(errors) < setup.num_ranks and time.monotonic() < end:
            try:
                rank, value, error = results.get(timeout=0.5)
            except queue_module.Empty:
                if not any(p.is_alive() for p in processes) and results.empty():
                    break  # a rank died without a word (killed, or os._exit by a peer's failure)
                continue
            if error is None:
                figures[rank] = value
            else:
                errors[rank] = error
                end = min(end, time.monotonic() + 10.0)  # its peers may be stuck waiting for it
        for process in processes:
            process.join(timeout=max(1.0, end - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    if errors:  # the first to report is the cause; its peers' errors are mostly "connection closed"
        rank, error = next(iter(errors.items()))
        raise RuntimeError(f"rank {rank}: {error.strip()}")
    if len(figures) < setup.num_ranks:
        missing = [f"{r} (exit code {processes[r].exitcode})" for r in range(setup.num_ranks) if r not in figures]
        raise RuntimeError(f"ranks {', '.join(missing)} gave no result: died, or killed after {timeout_s:.0f} s")
    return [figures[rank] for rank in range(setup.num_ranks)]
