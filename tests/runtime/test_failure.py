"""A rank that raises mid-step stops the whole job quickly, naming the rank and the stage."""

import io
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from distributed import run_job, run_ranks

SCRIPT = Path(__file__).with_name("crashing_rank.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_raising_rank_stops_every_rank_within_60_s() -> None:
    start = time.monotonic()
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(SCRIPT)]
    result = run_job(*command, timeout_s=120, check=False)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert elapsed < 60, f"took {elapsed:.0f} s\n{output}"
    assert "rank 0 finished step 0" in output and "rank 1 finished step 0" in output, output
    assert "rank 1 finished step 1" not in output, output
    assert "[rank 1, stage 1] micro-batch 0, forward: RuntimeError: injected failure" in output, output


def killed_rank_run(rank: int, world_size: int, schedule: str):
    import os
    import signal

    import torch

    from hf_ftpipe.errors import PipelineError
    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.runtime import PipelineEngine

    from models import tiny_batch, tiny_model
    from placements import contiguous_placement

    model = tiny_model("bert")
    batch = tiny_batch("bert", 4)
    traced = capture_model(model, {k: v[:2] for k, v in batch.items()})
    placement = contiguous_placement(traced.cost_graph, [0, 1])
    engine = PipelineEngine(traced, placement, num_microbatches=2, schedule=schedule, timeout_s=50)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    engine.attach_optimizer(optimizer)
    if rank == 1:
        original = engine.modules[1].forward
        calls = []

        def dying_forward(*args):
            calls.append(1)
            if len(calls) == 3:  # the first forward of the second step
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)

        engine.modules[1].forward = dying_forward
    start = time.monotonic()
    try:
        for _ in range(3):
            engine.train_step(batch)
            optimizer.step()
    except PipelineError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_killed_rank_stops_the_others_with_an_error_naming_what_they_waited_for(schedule: str) -> None:
    rank0, rank1 = run_ranks(killed_rank_run, 2, schedule, deadline_s=90)
    assert rank1.exitcode == -signal.SIGKILL, rank1
    assert rank0.error is None, rank0.error
    message, elapsed = torch.load(io.BytesIO(rank0.value), weights_only=False)
    assert elapsed < 50, f"rank 0 took {elapsed:.0f} s to stop: {message}"
    assert message.startswith("[rank 0, stage 0] micro-batch "), message
    assert "from rank 1" in message and "a peer process probably died" in message, message
