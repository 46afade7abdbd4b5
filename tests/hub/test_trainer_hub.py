"""PipeTrainer with `partition_repo`: the first job computes and pushes, the second pulls and does not partition
(and pushes its trained model with `push_to_hub`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_ftpipe.hub import PartitionStore

from distributed import accelerate_launch
from models import tiny_model

PLANS = "ftpipe/plans"


def launch(output: Path, hf_home: Path, push: bool, model_repo: str = "") -> dict:
    output.mkdir(parents=True)
    command = [str(Path(__file__).with_name("hub_job.py")), str(output), PLANS, "push" if push else "pull"]
    command += [model_repo] if model_repo else []
    # HF_ENDPOINT and HF_TOKEN come from the hub fixture's environment.
    result = accelerate_launch(*command, timeout_s=240, env={"HF_HOME": str(hf_home)})
    return {**json.loads((output / "result.json").read_text()), "log": result.stderr}


@pytest.fixture(scope="module")
def jobs(module_hub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Two launches, each with an HF_HOME of its own: the first computes the plan and pushes it, the second
    (a fresh cache) pulls it, and also pushes its trained model with Trainer's ``push_to_hub``."""
    root = tmp_path_factory.mktemp("jobs")
    first = launch(root / "first", root / "home_first", push=True)
    (entry,) = PartitionStore(PLANS).list(model="GPT2LMHeadModel")
    pushed = PartitionStore(PLANS).pull_path(entry.path).partition
    second = launch(root / "second", root / "home_second", push=False, model_repo="user/tiny-pipe")
    return {"first": first, "second": second, "entry": entry, "pushed": pushed, "root": root}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_job_pulls_the_pushed_plan_instead_of_partitioning(jobs: dict) -> None:
    first, second, entry, pushed = jobs["first"], jobs["second"], jobs["entry"], jobs["pushed"]
    assert first["source"] == "computed" and first["partitioner_calls"] == 1
    assert "pipeline plan: computed by counted-seq-greedy in " in first["log"]
    assert pushed.to_dict() == first["partition"]

    assert second["source"] == "hub", second["log"][-3000:]
    assert second["partitioner_calls"] == 0
    assert "computed by" not in second["log"] and "partition from the Hub: hf://datasets/ftpipe/plans" in second["log"]
    pulled = f"pipeline plan: from the Hub, hf://datasets/{PLANS}@main/{entry.path} (made by counted-seq-greedy)"
    assert pulled in second["log"]
    assert second["partition"] == pushed.to_dict()


@pytest.mark.distributed
@pytest.mark.slow
def test_push_to_hub_uploads_the_whole_trained_model_that_plain_transformers_loads(
    module_hub, jobs: dict, tmp_path: Path
) -> None:
    """Trainer's own ``push_to_hub``: rank 0 uploads one standard checkpoint holding every stage's
    trained weights (gathered from both ranks), which ``from_pretrained`` loads (the second job's)."""
    job = jobs["root"] / "second"
    files = module_hub.repo("user/tiny-pipe", repo_type="model").resolve("main").files
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    # The checkpoint is pushed once every rank has written it and it is renamed from its temporary folder.
    shares = {f"last-checkpoint/optimizer/rank{r}.safetensors" for r in (0, 1)}
    assert {"last-checkpoint/trainer_state.json", "last-checkpoint/model.safetensors", *shares} <= set(files), files
    assert not any(name.startswith("_tmp-") for name in files)
    assert files["model.safetensors"] == (job / "model.safetensors").read_bytes()

    # This process's huggingface_hub read HF_ENDPOINT at import, so load the pushed files from disk.
    pushed = tmp_path / "pushed"
    pushed.mkdir()
    for name in ("config.json", "model.safetensors"):
        (pushed / name).write_bytes(files[name])
    model = AutoModelForCausalLM.from_pretrained(pushed)
    trained = load_file(job / "model.safetensors")
    untrained = tiny_model("gpt2").state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained.get(name, value), atol=0, rtol=0, msg=name)
    changed = [name for name, value in trained.items() if not torch.equal(value, untrained[name])]
    assert len(changed) > len(trained) // 2, "the pushed weights are not the trained ones"
