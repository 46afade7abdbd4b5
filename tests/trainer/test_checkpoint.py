"""Checkpoints and resume: PipeTrainer runs interrupted at step 3 end as the uninterrupted ones do.

Launches of CPU processes on a tiny GPT-2 (`resume_job.py`): two processes train the
uninterrupted runs, saving ``checkpoint-3`` and ``checkpoint-6``; fresh ones resume each from its
``checkpoint-3``, two processes again, and three for one of them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from distributed import REPO, accelerate_launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = str(REPO / "tests" / "trainer" / "resume_job.py")
TIED = "transformer.wte.weight"


def launch(runs: list[dict], num_processes: int = 2, timeout_s: float = 240) -> None:
    accelerate_launch(JOB, json.dumps(runs), num_processes=num_processes, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    uninterrupted = [
        {"output_dir": str(root / "gpipe"), "dropout": 0.1},  # dropout on: resuming must restore the RNG
        {"output_dir": str(root / "nodropout")},
        {"output_dir": str(root / "async"), "schedule": "async", "dropout": 0.1},
        {"output_dir": str(root / "2bw"), "schedule": "2bw", "dropout": 0.1},
        {"output_dir": str(root / "best"), "best": True},
    ]
    launch(uninterrupted)
    incomplete = root / "incomplete"
    shutil.copytree(root / "gpipe" / "checkpoint-3", incomplete)
    (incomplete / "optimizer" / "rank1.json").unlink()
    weights_only = root / "weights-only"
    shutil.copytree(root / "nodropout" / "checkpoint-3", weights_only)
    shutil.rmtree(weights_only / "optimizer")
    (weights_only / "scheduler.pt").unlink()

    def step3(run: str) -> str:
        return str(root / run / "checkpoint-3")

    resumed = [
        # A model built without weights: every rank reads its stages from the checkpoint.
        {"output_dir": str(root / "gpipe-resumed"), "resume": step3("gpipe"), "dropout": 0.1, "empty_weights": True},
        # Another partition moves parameters between the ranks; other initial weights, all overwritten.
        {
            "output_dir": str(root / "repartitioned"),
            "resume": step3("nodropout"),
            "partitioner": "seq-greedy",
            "model_seed": 1,
        },
        {"output_dir": str(root / "async-resumed"), "resume": step3("async"), "schedule": "async", "dropout": 0.1},
        {"output_dir": str(root / "2bw-resumed"), "resume": step3("2bw"), "schedule": "2bw", "dropout": 0.1},
        {"output_dir": str(root / "weights-only-resumed"), "resume": str(weights_only)},
        {"output_dir": str(root / "refused"), "resume": str(incomplete), "expect_error": True},
    ]
    launch(resumed)
    three = {"output_dir": str(root / "three-ranks"), "resume": step3("nodropout")}
    launch([three], num_processes=3)
    return root


def _losses(folder: Path) -> dict[str, float]:
    return json.loads((folder / "result.json").read_text())["losses"]


def _assert_same_model(folder: Path, reference: Path) -> None:
    expected = load_file(reference / "model.safetensors")
    actual = load_file(folder / "model.safetensors")
    assert set(actual) == set(expected)
    for name, value in actual.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)


def test_resumed_run_ends_with_the_weights_and_losses_of_the_uninterrupted_one(runs: Path) -> None:
    reference, resumed = runs / "gpipe", runs / "gpipe-resumed"
    assert _losses(resumed) == pytest.approx(_losses(reference), abs=1e-6)
    assert list(_losses(resumed)) == ["1", "2", "3", "4", "5", "6"]  # 1-3 from the checkpoint's trainer state
    _assert_same_model(resumed, reference)
    # Dropout really draws from the RNG state being restored: without it the losses differ.
    assert _losses(reference)["1"] != pytest.approx(_losses(runs / "nodropout")["1"], abs=1e-4)


def test_checkpoint_resumes_under_a_partition_that_moves_parameters_between_ranks(runs: Path) -> None:
    reference, resumed = runs / "nodropout", runs / "repartitioned"
    before = [set(torch.load(reference / f"rank{r}.pt")) for r in (0, 1)]
    after = [set(torch.load(resumed / f"rank{r}.pt")) for r in (0, 1)]
    assert before != after, "the two partitions should place parameters differently"
    assert _losses(resumed) == pytest.approx(_losses(reference), abs=1e-6)
    _assert_same_model(resumed, reference)


def test_checkpoint_of_two_ranks_resumes_on_three(runs: Path) -> None:
    reference, resumed = runs / "nodropout", runs / "three-ranks"
    held = [set(torch.load(resumed / f"rank{r}.pt")) for r in (0, 1, 2)]
    assert all(held) and len(set().union(*held)) == len(
        torch.load(reference / "rank0.pt") | torch.load(reference / "rank1.pt")
    )
    assert _losses(resumed) == pytest.approx(_losses(reference), abs=1e-6)
    _assert_same_model(resumed, reference)


def test_checkpoint_folder_is_trainer_layout_plus_a_standard_model_and_named_optimizer_state(runs: Path) -> None:
    folder = runs / "gpipe" / "checkpoint-3"
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    expected = {"config.json", "model.safetensors", "scheduler.pt", "trainer_state.json", "partition.json"}
    expected |= {"rng_state_0.pth", "rng_state_1.pth"}
    expected |= {f"optimizer/rank{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")}
    assert expected <= names
    assert not any(name.startswith("optimizer_rank") or name == "optimizer.pt" for name in names)

    model = AutoModelForCausalLM.from_pretrained(folder)
    later = AutoModelForCausalLM.from_pretrained(runs / "gpipe" / "checkpoint-6").state_dict()
    assert not torch.equal(model.state_dict()[TIED], later[TIED])  # steps 4-6 changed the weights
    _assert_same_model(runs / "gpipe" / "checkpoint-6", runs / "gpipe")  # the last checkpoint = the final model

    # Adam's state is stored once per parameter name, wherever it lived: every trained weight, the tied one once.
    indexes = [json.loads((folder / "optimizer" / f"rank{r}.json").read_text()) for r in (0, 1)]
    stored = [{key.rpartition("/")[0] for key in index["tensors"]} for index in indexes]
    assert not stored[0] & stored[1]
    trained = {name for name, p in model.named_parameters()}  # lm_head.weight is the tied wte
    assert stored[0] | stored[1] == trained
    assert all(f"{name}/exp_avg" in indexes[0]["tensors"] + indexes[1]["tensors"] for name in trained)
    decays = sorted({g["weight_decay"] for index in indexes for g in index["param_groups"]})
    assert decays == [0.0, 0.01]


@pytest.mark.parametrize("schedule", ["async", "2bw"])
def test_streaming_run_resumes_as_the_run_that_wrote_the_checkpoint_went_on(runs: Path, schedule: str) -> None:
    # Saving drains the pipeline, in the run that saves as in the resumed one: from there both
    # continue alike, each copy of the tied weight with its own optimizer state back.
    reference, resumed = runs / schedule, runs / f"{schedule}-resumed"
    assert _losses(resumed) == pytest.approx(_losses(reference), abs=1e-6)
    assert all(math.isfinite(loss) for loss in _losses(resumed).values())
    _assert_same_model(resumed, reference)
    rank0, rank1 = (torch.load(resumed / f"rank{r}.pt") for r in (0, 1))
    torch.testing.assert_close(rank0[TIED], rank1[TIED], atol=0, rtol=0)  # tied copies reconciled at the end
    indexes = [json.loads((reference / "checkpoint-3" / "optimizer" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(f"{TIED}/exp_avg" in index["tensors"] for index in indexes)


def test_load_best_model_at_end_reloads_every_stage_from_the_best_checkpoint(runs: Path) -> None:
    result = json.loads((runs / "best" / "result.json").read_text())
    assert Path(result["best_model_checkpoint"]).name == "checkpoint-3"
    _assert_same_model(runs / "best", runs / "best" / "checkpoint-3")
    final = load_file(runs / "best" / "checkpoint-6" / "model.safetensors")
    assert not torch.equal(final[TIED], load_file(runs / "best" / "model.safetensors")[TIED])


def test_checkpoint_without_optimizer_state_resumes_its_weights_with_a_fresh_optimizer(runs: Path) -> None:
    # As Trainer does with save_only_model=True checkpoints.
    reference, resumed = _losses(runs / "nodropout"), _losses(runs / "weights-only-resumed")
    assert resumed["4"] == pytest.approx(reference["4"], abs=1e-6)  # the same weights before step 4's update
    assert resumed["5"] != pytest.approx(reference["5"], abs=1e-4)  # Adam restarted from zero moments


def test_incomplete_checkpoint_is_refused_with_the_reason(runs: Path) -> None:
    message = (runs / "refused" / "error.txt").read_text()
    assert "holds 1 rank files but they were written by [2] ranks" in message
