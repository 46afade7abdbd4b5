"""PipeTrainer with `partition_repo`: the first job computes and pushes, the second pulls and does not partition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_ftpipe.hub import PartitionStore

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
LAUNCH += ["--main_process_port", "0"]
PLANS = "ftpipe/plans"


def launch(output: Path, hf_home: Path, push: bool) -> dict:
    output.mkdir(parents=True)
    env = {**os.environ, "HF_HOME": str(hf_home)}  # HF_ENDPOINT and HF_TOKEN from the hub fixture
    command = [*LAUNCH, str(Path(__file__).with_name("hub_job.py")), str(output), PLANS, "push" if push else "pull"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return {**json.loads((output / "result.json").read_text()), "log": result.stderr}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_job_pulls_the_pushed_plan_instead_of_partitioning(hub, tmp_path: Path) -> None:
    first = launch(tmp_path / "first", tmp_path / "home_first", push=True)
    assert first["source"] == "computed" and first["partitioner_calls"] == 1
    assert "partition by counted-seq-greedy" in first["log"]
    (entry,) = PartitionStore(PLANS).list(model="GPT2LMHeadModel")
    pushed = PartitionStore(PLANS).pull_path(entry.path).partition
    assert pushed.to_dict() == first["partition"]

    second = launch(tmp_path / "second", tmp_path / "home_second", push=False)  # fresh HF_HOME: no cache
    assert second["source"] == "hub", second["log"][-3000:]
    assert second["partitioner_calls"] == 0
    assert "partition by" not in second["log"] and "partition from the Hub: hf://datasets/ftpipe/plans" in second["log"]
    assert second["partition"] == pushed.to_dict()
