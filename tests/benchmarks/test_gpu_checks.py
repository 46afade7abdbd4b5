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

    # Correctness compares: each schedule ran against one process, in every precision between them.
    runs = checks["correctness"]["runs"]
    assert {r["schedule"] for r in runs} == {"gpipe", "1f1b", "async", "2bw"}
    assert {r["dtype"] for r in runs} == {"float32", "bfloat16", "float64"}
    for run in runs:
        assert 0 <= run["max_loss_diff"] <= 1e-4 and 0 <= run["max_param_diff"] <= 1e-4, run
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
        assert run["missing_params"] == []
    # float64 is its own reference, and the pipeline equals it to rounding of float64.
    (exact,) = [r for r in runs if r["dtype"] == "float64"]
    assert exact["own_loss_diff"] == 0 and exact["own_param_diff"] == 0
    assert exact["float64_param_diff"] <= 1e-12, exact
    # The other precisions' one process differs from float64 by its own rounding (not zero).
    assert all(r["own_param_diff"] > 0 for r in runs if r["dtype"] != "float64")
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


def test_the_verdict_allows_twice_one_process_own_error_and_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 is judged against float64: the engine may be as far off as one process in float32 is,
    twice over, plus the fixed tolerance (1e-4 on parameters); float64 must agree exactly."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import _gpu_check_models as gpu_models
    import torch
    from _gpu_check_correctness import Reference, compare

    size = gpu_models.ModelSize(kind="gpt2", layers=1, hidden=8, heads=2, vocab=16, seq_len=4, num_stages=2)
    exact = Reference([100.0, 90.0], {"w": torch.zeros(2, dtype=torch.float64)})
    own = Reference([100.05, 90.0], {"w": torch.tensor([0.01, 0.0], dtype=torch.float64)})

    def verdict(losses: list[float], weight: float, precision: str = "float32") -> bool:
        state = {"w": torch.tensor([weight, 0.0], dtype=torch.float64)}
        same = exact if precision == "float64" else own
        return compare(size, "async", precision, losses, state, same, exact)["ok"]

    # Losses: 2 x 0.05 + 1e-4 + 1e-5 x 100 = 0.1011 allowed at step 0; step 1 has no own error: 1e-4 + 9e-4.
    assert verdict([100.1010, 90.0009], weight=0.0201)
    assert not verdict([100.1012, 90.0], weight=0.0)  # step 0 over
    assert not verdict([100.0, 90.0011], weight=0.0)  # step 1 over
    assert not verdict([100.0, 90.0], weight=0.0202)  # weights: 2 x 0.01 + 1e-4 = 0.0201
    assert verdict([100.0, 90.0], weight=1e-10, precision="float64")
    assert not verdict([100.0, 90.0], weight=2e-9, precision="float64")
    assert not verdict([100.001, 90.0], weight=0.0, precision="float64")  # 1e-6 relative: 1e-4


def test_a_model_whose_capture_raises_fails_every_check_that_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A T5 whose export raises (as on torch 2.11) is a failed correctness run with the error, and the
    checks that take the first model raise naming it, instead of running on the models captured before."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import _gpu_check_models as gpu_models
    import torch
    from _gpu_check_correctness import check_correctness

    def failing_capture(
        size: gpu_models.ModelSize, sizes: gpu_models.Sizes, dtype: object = None
    ) -> gpu_models.Captured:
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
