"""Run a function on N real processes (gloo on CPU) with a deadline, for multi-rank tests.

Ranks are forked from a ``forkserver`` that imported torch, transformers (its Trainer and model
code included) and hf_ftpipe once (a fresh interpreter per rank spent seconds on those imports in
every test; forking from a process with no threads and no process group is as clean as
``spawn``), and meet through a file rendezvous in a temporary folder. The outer deadline kills
every rank that is still alive, so a hang fails the test instead of the CI. A rank's return
value (anything picklable) or its traceback comes back to the test.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


def _entry(fn: Callable, rank: int, world_size: int, rendezvous: str, queue: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        # Tensors are sent as bytes: torch's shared-memory handles die with the process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put(RankResult(rank, value=buffer.getvalue()))
    except BaseException:
        queue.put(RankResult(rank, error=traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOADED = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.trainer",
    "hf_ftpipe.runtime",
    "hf_ftpipe.graph.trace",
    "hf_ftpipe.partitioners",
    "hf_ftpipe.trainer.pipe_trainer",
    "pytest",
)
"""What the fork server imports once for every rank. transformers.trainer pulls in modeling_utils
and training_args, which every rank building a model or arguments would otherwise import again
(seconds per rank). ``hf_ftpipe`` loads its modules on first use: its runtime, tracing (torch.export,
sympy, networkx), partitioners and trainer are named here, and pytest, which every test module a
rank's function lives in imports (together about a second of CPU per rank, on every launch)."""


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def run_ranks(fn: Callable, world_size: int, *args: Any, deadline_s: float = 120.0) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results sorted by rank.

    The ranks see the environment the fork server started with (the first call's), not variables
    a test sets later: pass what a rank needs as an argument.
    """
    context = _context()
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_entry, args=(fn, rank, world_size, rendezvous, queue, args))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[int, RankResult] = {}
        end = time.monotonic() + deadline_s
        all_exited_at: float | None = None
        while len(results) < world_size and time.monotonic() < end:
            try:
                result = queue.get(timeout=0.2)
                results[result.rank] = result
            except queue_module.Empty:
                if all(not p.is_alive() for p in processes):
                    # results still in the pipe arrive shortly after their process exited
                    all_exited_at = all_exited_at or time.monotonic()
                    if time.monotonic() - all_exited_at > 3.0:
                        break
        for process in processes:
            process.join(timeout=max(0.0, end - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for rank, process in enumerate(processes):
            result = results.setdefault(rank, RankResult(rank, error="no result (killed at the deadline or died)"))
            result.exitcode = process.exitcode
    return [results[rank] for rank in range(world_size)]


def values_or_raise(results: list[RankResult]) -> list[Any]:
    """Every rank's value; if any rank failed, an AssertionError carrying every failing traceback."""
    failures = [f"--- rank {r.rank} (exit {r.exitcode}) ---\n{r.error}" for r in results if r.error]
    if failures:
        raise AssertionError("ranks failed:\n" + "\n".join(failures))
    import torch

    return [torch.load(io.BytesIO(r.value), weights_only=False) for r in results]


REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent


def job_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a job script started as its own process: this checkout's hf_ftpipe and
    these helpers importable (a script's own folder is all Python puts on its path), ``extra`` on top."""
    path = os.pathsep.join(p for p in (str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def launcher(num_processes: int = 2, monitor_interval_s: float | None = None) -> list[str]:
    """``accelerate launch --multi_gpu`` on ``num_processes`` CPU processes, on a free port.

    ``monitor_interval_s``: how often the launcher looks for a rank that exited (0.1 s by default;
    it then ends the others). A test that checks what the other ranks say about a rank that died
    gives them longer, so that what they print does not depend on who wins that race.
    """
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    command += ["--num_processes", str(num_processes), "--main_process_port", "0"]
    return command + (["--monitor_interval", str(monitor_interval_s)] if monitor_interval_s is not None else [])


def run_job(
    *command: str, timeout_s: float = 240, check: bool = True, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run ``python *command`` (a job script, ``-m module ...``) in the job environment, to its end.

    With ``check`` the job must succeed; its output tails are in the assertion message when it does not.
    """
    result = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=job_env(env)
    )
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result


def accelerate_launch(
    *command: str,
    num_processes: int = 2,
    timeout_s: float = 300,
    check: bool = True,
    env: dict | None = None,
    monitor_interval_s: float | None = None,
) -> subprocess.CompletedProcess:
    """Start ``command`` the way a user would on a CPU-only machine: ``accelerate launch --multi_gpu``.

    The script itself must ask for CPU (``use_cpu=True``). With ``check`` the job must succeed;
    its output tails are in the assertion message when it does not.
    """
    prefix = launcher(num_processes, monitor_interval_s)[1:]
    return run_job(*prefix, *command, timeout_s=timeout_s, check=check, env=env)


def torchrun(
    *command: str, num_processes: int = 2, timeout_s: float = 300, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Start ``command`` with ``torchrun --standalone --nproc_per_node N`` (a free port), without accelerate.

    On a CPU-only machine the script need not ask for CPU: `PipeTrainingArguments` does. With
    ``check`` the job must succeed; its output tails are in the assertion message when it does not.
    """
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(num_processes)]
    return run_job(*launch, *command, timeout_s=timeout_s, check=check, env=env)


def start_accelerate_launch(*command: str, num_processes: int = 2, env: dict | None = None) -> subprocess.Popen:
    """`accelerate_launch` without waiting, for a test that watches the job while it runs.

    The launcher leads its own process group (kill them all with ``os.killpg(process.pid, ...)``);
    stdout and stderr come together, as text, in ``process.stdout``.
    """
    return subprocess.Popen(
        [*launcher(num_processes), *command],
        cwd=REPO,
        env=job_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
