"""``benchmarks/gpu_checks.py --device cpu --quick --json`` runs every GPU check on tiny models, so that
the script a first GPU run depends on cannot rot before a GPU is lent. The command is read from
benchmarks/README.md (doc_blocks.page_command), so the page and what runs cannot drift apart."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from doc_blocks import REPO, page_command

COMMAND = page_command("benchmarks/README.md", "gpu_checks.py --device cpu --quick --json")


@pytest.mark.slow
def test_gpu_checks_run_every_check_on_the_cpu() -> None:
    assert COMMAND[0] == "python"
    # One torch thread, as every test process here (tests/conftest.py): the suite shares 2 cores.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, *COMMAND[1:]], capture_output=True, text=True, timeout=180, cwd=REPO, env=environment
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)

    assert report["device"] == "cpu" and report["quick"] is True
    checks = {check["check"]: check for check in report["checks"]}
    assert list(checks) == ["correctness", "memory", "split_vs_eager", "cost_model"]
    assert all(check["ok"] is True for check in checks.values()), result.stderr[-3000:]

    # Correctness compares: each schedule ran against one process, in both dtypes between them.
    runs = checks["correctness"]["runs"]
    assert {r["schedule"] for r in runs} == {"gpipe", "1f1b", "async", "2bw"}
    assert {r["dtype"] for r in runs} == {"float32", "bfloat16"}
    for run in runs:
        assert 0 <= run["max_loss_diff"] <= 1e-4 and 0 <= run["max_param_diff"] <= 1e-4, run
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
        assert run["missing_params"] == []
    # bfloat16 autocast computes other losses than float32 on the same data: autocast was on.
    losses = {r["dtype"]: r["losses"][0] for r in runs if r["schedule"] in ("gpipe", "1f1b")}
    assert losses["float32"] != losses["bfloat16"]

    for run in checks["memory"]["runs"]:
        assert run["measured_mb"][0] > 0 and run["predicted_mb"][0] > 0
        assert run["ratio"][0] == pytest.approx(run["measured_mb"][0] / run["predicted_mb"][0], rel=0.05)
    speed = checks["split_vs_eager"]
    assert speed["engine_steps_per_s"] > 0 and speed["eager_steps_per_s"] > 0

    (block,) = checks["cost_model"]["blocks"]
    assert block["block"] == "transformer.h.1" and block["dtype"] == "float32"
    assert checks["cost_model"]["profile"] == "cpu"
    assert block["forward_ms"] > 0 and block["backward_ms"] > 0 and block["forward_roofline_ms"] > 0
    assert set(block["kinds"]) == {"matmul", "attention", "norm", "elementwise"}
    # A GPT-2 layer has matmuls, attention and layer norms: each kind measured and predicted.
    for kind in ("matmul", "attention", "norm"):
        assert block["kinds"][kind]["forward_measured_ms"] > 0 and block["kinds"][kind]["forward_roofline_ms"] > 0


def test_a_model_whose_capture_raises_fails_every_check_that_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A T5 whose export raises (as on torch 2.11) is a failed correctness run with the error, and the
    checks that take the first model raise naming it, instead of running on the models captured before."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import _gpu_check_models as gpu_models
    import torch
    from _gpu_check_correctness import check_correctness

    def failing_capture(size: gpu_models.ModelSize, sizes: gpu_models.Sizes) -> gpu_models.Captured:
        raise TypeError("insert_subgm() takes 4 positional arguments but 5 were given")

    monkeypatch.setattr(gpu_models, "capture", failing_capture)
    t5 = gpu_models.ModelSize(kind="t5", layers=1, hidden=16, heads=2, vocab=32, seq_len=4, target_len=2, num_stages=2)
    sizes = gpu_models.Sizes(
        models=(t5,), microbatch_size=1, num_microbatches=2, steps=1, timed_steps=1, block_repeats=1
    )
    logged: list[str] = []
    captures = gpu_models.capture_all(sizes, logged.append)
    result = check_correctness(captures, sizes, torch.device("cpu"), logged.append)

    assert result["ok"] is False and result["max_loss_diff"] is None
    (run,) = result["runs"]
    assert run["model"] == t5.name and run["ok"] is False
    assert run["error"] == "capture failed: TypeError: insert_subgm() takes 4 positional arguments but 5 were given"
    with pytest.raises(RuntimeError, match=r"capturing t5 1L d16, 2 stages failed: TypeError: insert_subgm"):
        gpu_models.captured(captures[0])
