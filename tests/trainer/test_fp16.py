"""``fp16=True``: float16 autocast with one loss scale for all ranks. A step in which the gradients
overflow is skipped on every rank (weights, optimizer and learning-rate schedule untouched), the
scale follows GradScaler's rule identically on every rank, and checkpoints carry it (scaler.pt) so
that a resumed run ends exactly where the uninterrupted one does. The numerics of a scaled float16
step are checked against one process in tests/runtime/test_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import REPO, accelerate_launch

JOB = str(REPO / "tests" / "trainer" / "fp16_job.py")
STEPS, LR = 5, 1e-2  # as in fp16_job.py


def _ranks(output: Path) -> list[dict]:
    return [json.loads((output / f"fp16_rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    whole = tmp_path_factory.mktemp("fp16_whole")
    accelerate_launch(JOB, str(whole))
    resumed = tmp_path_factory.mktemp("fp16_resumed")
    accelerate_launch(JOB, str(resumed), str(whole / "checkpoint-3"))
    return whole, resumed


@pytest.mark.distributed
@pytest.mark.slow
def test_an_overflowing_step_is_skipped_on_every_rank_and_the_scale_backs_off(runs: tuple[Path, Path]) -> None:
    whole, _ = runs
    ranks = _ranks(whole)
    for rank in ranks:
        steps = rank["steps"]
        # Step 1 overflowed at 2**40: skipped, weights untouched, scale 2**40 * 2**-30; then doubled
        # every 2 steps without an overflow.
        assert [s["scale"] for s in steps] == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12]
        assert [s["skipped_steps"] for s in steps] == [1] * STEPS
        assert steps[0]["checksum"] == rank["start_checksum"]
        assert all(later["checksum"] != earlier["checksum"] for earlier, later in zip(steps, steps[1:]))
        # Trainer leaves the learning-rate schedule where it is on a skipped step (linear decay to 0).
        assert [s["learning_rate"] for s in steps] == pytest.approx([LR * (1 - k / STEPS) for k in range(STEPS)])
        losses = [entry["loss"] for entry in rank["log_history"] if "loss" in entry]
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert [e.get("loss") for e in ranks[0]["log_history"]] == [e.get("loss") for e in ranks[1]["log_history"]]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resumed_fp16_run_continues_with_the_saved_scale_and_ends_with_the_same_weights(
    runs: tuple[Path, Path],
) -> None:
    whole, resumed = runs
    assert (whole / "checkpoint-3" / "scaler.pt").is_file()
    for uninterrupted, continued in zip(_ranks(whole), _ranks(resumed)):
        # The job starts its scaler at 2**40: only scaler.pt gives 2**11 at step 4.
        assert continued["steps"] == uninterrupted["steps"][3:]
    expected = load_file(whole / "final" / "model.safetensors")
    actual = load_file(resumed / "final" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=0, rtol=0, msg=name)
