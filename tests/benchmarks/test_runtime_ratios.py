"""``benchmarks/runtime.py``'s ratios, worked by hand: with ``--paired`` each round's is the median of the
two runners' step-by-step ratios in its paired launch, then the median over rounds; without, the median
over rounds of their samples/s ratios (the runs themselves are never timed in tests)."""

from __future__ import annotations

import sys

import pytest

from doc_blocks import REPO


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(sys, "path", [str(REPO / "benchmarks"), *sys.path])
    import _runtime_report

    return _runtime_report


def _round(runner: str, samples_per_s: float, paired_step_ms: list[float] | None) -> dict[str, object]:
    return {"runner": runner, "samples_per_s": samples_per_s, "error": None, "paired_step_ms": paired_step_ms}


def test_paired_ratios_are_step_by_step_medians_and_separate_ones_round_ratios(report: object) -> None:
    runs = {
        # Round 1: steps 500/400, 600/500, 450/500 -> ratios 1.25, 1.2, 0.9: median 1.2.
        # Round 2: steps 480/400, 520/400, 500/400 -> 1.2, 1.3, 1.25: median 1.25. Round 3: 1.1 (one step).
        "torch/gpipe": [
            _round("torch/gpipe", 10.0, [500.0, 600.0, 450.0]),
            _round("torch/gpipe", 12.0, [480.0, 520.0, 500.0]),
            _round("torch/gpipe", 11.0, [550.0]),
        ],
        "hf_ftpipe/zbv": [
            _round("hf_ftpipe/zbv", 20.0, [400.0, 500.0, 500.0]),
            _round("hf_ftpipe/zbv", 12.0, [400.0, 400.0, 400.0]),
            _round("hf_ftpipe/zbv", 11.0, [500.0]),
        ],
    }
    rows = {row["runner"]: row for row in report.median_rows(runs)}
    assert rows["hf_ftpipe/zbv"]["ratio_vs_torch_gpipe"] == 1.2  # median of 1.2, 1.25, 1.1
    assert rows["torch/gpipe"]["ratio_vs_torch_gpipe"] == 1.0

    for rounds in runs.values():  # no paired launch: samples/s 20/10, 12/12, 11/11 -> median 1.0
        for row in rounds:
            row["paired_step_ms"] = None
    rows = {row["runner"]: row for row in report.median_rows(runs)}
    assert rows["hf_ftpipe/zbv"]["ratio_vs_torch_gpipe"] == 1.0
