"""A rank that raises mid-step stops the whole job quickly, naming the rank and the stage."""

import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("crashing_rank.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_raising_rank_stops_every_rank_within_60_s() -> None:
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert elapsed < 60, f"took {elapsed:.0f} s\n{output}"
    assert "rank 0 finished step 0" in output and "rank 1 finished step 0" in output, output
    assert "rank 1 finished step 1" not in output, output
    assert "[rank 1, stage 1] micro-batch 0, forward: RuntimeError: injected failure" in output, output
