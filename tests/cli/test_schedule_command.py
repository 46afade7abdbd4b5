"""`hf-ftpipe schedule`: each rank's actions, checked, with no process started."""

from __future__ import annotations

import pytest

from hf_ftpipe.cli import parser as cli


def test_schedule_prints_each_ranks_actions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "1f1b", "--num-microbatches", "4"]) == 0
    assert capsys.readouterr().out == (
        "step:\n  rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n  rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3\n"
    )
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "2bw", "--num-microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 0:\n  rank 0: 0F0 0F1 0B0\n  rank 1: 1F0 1B0 1F1 1B1 1U1\nstep 1:\n"), out
    assert out.endswith("drain:\n  rank 0: 0B3 0U3\n  rank 1: \n"), out


def test_schedule_refuses_a_placement_with_an_idle_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedule", "--placement", "0,2"]) == 2
    assert "ranks must be 0..N-1, each holding a stage; got [0, 2]" in capsys.readouterr().err
