"""``benchmarks/hybrid.py`` refuses a layout that does not fill its processes, or micro-batches the
replicas cannot share, before it starts anything (the runs themselves are never timed in tests)."""

from __future__ import annotations

import sys

import pytest

from doc_blocks import REPO


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[object, str]:
    """The script's ``main`` on ``argv`` in this process (its argument checks come before it builds a model
    or starts a rank; a process of its own would import torch again for them): its exit status and stderr."""
    monkeypatch.setattr(sys, "path", [str(REPO / "benchmarks"), *sys.path])  # the script adds to it: undone after
    monkeypatch.setattr(sys, "argv", ["hybrid.py", *argv])
    import hybrid

    with pytest.raises(SystemExit) as exit_status:
        hybrid.main()
    return exit_status.value.code, capsys.readouterr().err


def test_layouts_must_fill_the_processes_and_share_the_microbatches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stderr = run(monkeypatch, capsys, "--layouts", "3x1")
    assert code == 2
    assert "layout 3x1 has 3 processes, --ranks is 4: P × D must be it" in stderr
    code, stderr = run(monkeypatch, capsys, "--layouts", "2x2", "--microbatches", "3")
    assert code == 2
    assert "layout 2x2: --microbatches (3) must be a multiple of D = 2" in stderr
