"""``benchmarks/hybrid.py`` refuses a layout that does not fill its processes, or micro-batches the
replicas cannot share, before it starts anything (the runs themselves are never timed in tests)."""

from __future__ import annotations

import subprocess
import sys

from doc_blocks import REPO


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/hybrid.py", *argv], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_layouts_must_fill_the_processes_and_share_the_microbatches() -> None:
    result = run("--layouts", "3x1")
    assert result.returncode == 2
    assert "layout 3x1 has 3 processes, --ranks is 4: P × D must be it" in result.stderr
    result = run("--layouts", "2x2", "--microbatches", "3")
    assert result.returncode == 2
    assert "layout 2x2: --microbatches (3) must be a multiple of D = 2" in result.stderr
