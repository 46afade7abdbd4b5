"""`torchrun` on a machine without a GPU and without ``use_cpu``: one rank writes, one rank logs.

One launch runs what transformers' ``run_glue.py`` does with `PipeTrainer` swapped in
(``writers_job.py``): ``main_process_first``, train, ``save_model``, ``log_metrics`` /
``save_metrics`` / ``save_state``, evaluate, at ``log_level="info"``. Before `PipeTrainingArguments`
asked for CPU itself, transformers made both ranks process 0 of 1 and both wrote every file.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.trainer.launch import check_one_writer, use_cpu_for_launch

from distributed import REPO, run_ranks, torchrun, values_or_raise
from models import tiny_model

JOB = str(REPO / "tests" / "trainer" / "writers_job.py")
OUTPUTS = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "training_args.bin",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "trainer_state.json",
]
"""What run_glue.py leaves in ``output_dir`` (``save_model``, ``save_metrics``, ``save_state``)."""


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    output, records = tmp_path_factory.mktemp("output"), tmp_path_factory.mktemp("records")
    result: subprocess.CompletedProcess = torchrun(JOB, str(output), str(records))
    ranks = [json.loads((records / f"rank{r}.json").read_text()) for r in range(2)]
    return output, ranks, result.stdout + result.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_every_output_file_is_written_by_rank_0_alone_and_is_valid(launched: tuple[Path, list[dict], str]) -> None:
    output, ranks, _ = launched
    # Before training each rank checks that it can write output_dir with a probe file it removes at once.
    probes = [[w for w in rank["written"] if w.startswith(".hf_ftpipe-write-check-")] for rank in ranks]
    assert probes == [[".hf_ftpipe-write-check-rank0"], [".hf_ftpipe-write-check-rank1"]]
    written = [[w for w in rank["written"] if not w.startswith(".hf_ftpipe-write-check-")] for rank in ranks]
    assert written[1] == [], "rank 1 wrote into output_dir"
    assert sorted(set(written[0])) == sorted(OUTPUTS)
    assert sorted(p.name for p in output.iterdir()) == sorted(OUTPUTS), "a file was written unrecorded"
    results = {name: json.loads((output / name).read_text()) for name in OUTPUTS if name.endswith("results.json")}
    assert {"train_loss", "train_samples"} <= set(results["train_results.json"])
    assert {"eval_loss", "eval_samples"} <= set(results["eval_results.json"])
    assert results["all_results.json"] == {**results["train_results.json"], **results["eval_results.json"]}
    assert json.loads((output / "trainer_state.json").read_text())["global_step"] == 2
    args = torch.load(output / "training_args.bin", weights_only=False)
    assert args.use_cpu and args.world_size == 2
    trained = AutoModelForCausalLM.from_pretrained(output).state_dict()
    initial = tiny_model("gpt2").state_dict()
    assert trained.keys() == initial.keys()
    assert not torch.equal(trained["lm_head.weight"], initial["lm_head.weight"]), "the saved model is untrained"


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_agrees_that_rank_0_is_the_main_process(launched: tuple[Path, list[dict], str]) -> None:
    _, ranks, _ = launched
    for rank in ranks:
        main = rank["rank"] == 0
        assert rank["process_index"] == rank["rank"] and rank["world_size"] == 2
        flags = ("is_world_process_zero", "is_local_process_zero", "should_save", "should_log")
        assert [rank[flag] for flag in flags] == [main] * len(flags), rank
    # main_process_first: rank 1 entered the block only after rank 0 had left it
    assert [rank["saw_marker_on_entry"] for rank in ranks] == [False, True]


@pytest.mark.distributed
@pytest.mark.slow
def test_log_level_info_shows_the_plan_and_the_chosen_slices_once(launched: tuple[Path, list[dict], str]) -> None:
    _, _, log = launched
    # Each line reaches the log once per handler: transformers' own, and under CI=true (transformers then
    # propagates to the root logger) also the script's basicConfig one. Trainer's banner counts them.
    handlers = log.count("***** Running training *****")
    assert handlers == (2 if os.environ.get("CI", "").upper() in {"1", "ON", "YES", "TRUE"} else 1), log[-6000:]
    plan_lines = [line for line in log.splitlines() if "pipeline plan: computed by auto (chose " in line]
    assert len(plan_lines) == handlers, log[-6000:]
    assert "2 stages on 2 GPUs" in plan_lines[0] and "GPU 1: stage 1, peak " in plan_lines[0]
    slices = [line for line in log.splitlines() if "token_slices='auto': [" in line]
    assert len(slices) == handlers, log[-6000:]
    chosen = slices[0].split("token_slices='auto': ")[1].split(" (")[0]
    assert plan_lines[0].endswith(f"token slices {chosen} (chosen by token_slices='auto')")


@pytest.mark.parametrize(
    ("local_rank", "world_size", "launched"),
    [("0", "2", True), ("1", "4", True), ("0", "1", False), (None, "2", False)],
)
def test_cpu_is_asked_for_when_a_launcher_started_several_processes_and_no_accelerator_exists(
    monkeypatch: pytest.MonkeyPatch, local_rank: str | None, world_size: str, launched: bool
) -> None:
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    assert use_cpu_for_launch() == (launched and not torch.accelerator.is_available())


def _check_one_writer(rank: int, world_size: int, output_dir: str) -> str | None:
    # A process group of 2 that no launcher announced (no LOCAL_RANK): transformers counts 1 process.
    args = PipeTrainingArguments(output_dir=output_dir, report_to="none")
    try:
        check_one_writer(args)
    except PipelineError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_ranks_that_transformers_counts_as_one_process_are_refused_before_writing(tmp_path: Path) -> None:
    for rank, message in enumerate(values_or_raise(run_ranks(_check_one_writer, 2, str(tmp_path)))):
        assert message is not None and message.startswith(f"[rank {rank}] the launcher started 2 processes, but ")
        assert "TrainingArguments counts 1" in message and "pass use_cpu=True (--use_cpu)" in message
