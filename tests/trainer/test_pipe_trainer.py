"""PipeTrainer launched for real with `accelerate launch`, two CPU processes, one stage each."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_ftpipe import PipeTrainingArguments

from distributed import REPO, job_env
from distributed import accelerate_launch as launch
from doc_blocks import page_command
from models import tiny_model

JOB = str(REPO / "tests" / "trainer" / "pipe_job.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of the job's runs that the tests read: its defaults (gpipe, weights from the model's
    initialisation) in ``gpipe``, async in ``async``, and in ``empty`` the defaults on a model built
    without weights, from ``initial``, the model's initialisation saved."""
    root = tmp_path_factory.mktemp("runs")
    tiny_model("gpt2").save_pretrained(root / "initial")
    jobs = [
        {"output_dir": str(root / "gpipe")},
        {"output_dir": str(root / "async"), "schedule": "async"},
        {"output_dir": str(root / "empty"), "weights_path": str(root / "initial")},
    ]
    launch(JOB, json.dumps(jobs))
    return root


@pytest.fixture(scope="module")
def gpipe_run(runs: Path) -> Path:
    return runs / "gpipe"


def test_checkpoint_loads_with_plain_transformers_and_holds_the_pipeline_weights(gpipe_run: Path) -> None:
    result = json.loads((gpipe_run / "result.json").read_text())
    assert len(result["losses"]) == 6 and all(math.isfinite(loss) for loss in result["losses"])
    assert math.isfinite(result["metrics"]["eval_loss"])

    model = AutoModelForCausalLM.from_pretrained(gpipe_run)
    saved = model.state_dict()
    stage_weights = {**torch.load(gpipe_run / "rank0.pt"), **torch.load(gpipe_run / "rank1.pt")}
    assert set(torch.load(gpipe_run / "rank0.pt")) != set(torch.load(gpipe_run / "rank1.pt"))  # really split
    for name, value in stage_weights.items():
        torch.testing.assert_close(saved[name], value, atol=0, rtol=0, msg=name)
    trained = {name for name, p in model.named_parameters()}
    assert trained <= set(stage_weights) | {"lm_head.weight"}  # lm_head is tied to transformer.wte


def test_async_job_trains_and_saves_the_drained_weights_with_tied_copies_reconciled(runs: Path) -> None:
    folder = runs / "async"
    result = json.loads((folder / "result.json").read_text())
    assert len(result["losses"]) == 6 and all(math.isfinite(loss) for loss in result["losses"])
    assert math.isfinite(result["metrics"]["eval_loss"])
    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    rank0, rank1 = torch.load(folder / "rank0.pt"), torch.load(folder / "rank1.pt")
    for name, value in {**rank0, **rank1}.items():
        torch.testing.assert_close(saved[name], value, atol=0, rtol=0, msg=name)
    tied = "transformer.wte.weight"  # one copy per rank, updated apart, equal again after the drain
    torch.testing.assert_close(rank0[tied], rank1[tied], atol=0, rtol=0)
    assert not torch.equal(rank0[tied], tiny_model("gpt2").state_dict()[tied])


def test_model_built_without_weights_loads_each_stage_from_the_checkpoint(runs: Path, gpipe_run: Path) -> None:
    full = json.loads((gpipe_run / "result.json").read_text())
    empty = json.loads((runs / "empty" / "result.json").read_text())
    assert empty["losses"] == full["losses"]
    expected = AutoModelForCausalLM.from_pretrained(gpipe_run).state_dict()
    for name, value in AutoModelForCausalLM.from_pretrained(runs / "empty").state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)


def test_quickstart_prints_the_accuracy_the_readme_quotes_and_saves_a_loadable_model(tmp_path: Path) -> None:
    """README.md's Quickstart demo as written (its `accelerate launch`, in a folder of its own): the run is
    deterministic, so on the versions the README names it prints exactly the accuracy quoted there."""
    words = page_command("README.md", "examples/run_glue_pipe.py")
    demo = words[len(words) - words[::-1].index("&&") :]  # the venv and the install come before
    assert demo[:2] == ["accelerate", "launch"] and demo[-1] == "examples/run_glue_pipe.py", demo
    (tmp_path / "examples").symlink_to(REPO / "examples")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this venv's `accelerate`
    env = job_env({"PATH": path})
    result = subprocess.run(demo, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    printed = re.search(r"eval accuracy: (\d\.\d+)", result.stdout)
    assert printed, result.stdout[-3000:]
    quoted, torch_versions, transformers_versions, per_kernels = _readme_quickstart_accuracy()
    quoted = per_kernels.get(torch.backends.cpu.get_cpu_capability(), quoted)
    if torch.__version__.split("+")[0] in torch_versions and transformers.__version__ in transformers_versions:
        assert printed.group(1) == quoted, f"README.md quotes {quoted}; the demo printed {printed.group(0)}"
    else:  # other versions may draw other random numbers
        assert abs(float(printed.group(1)) - float(quoted)) <= 0.05, f"README.md quotes {quoted}: {printed.group(0)}"
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pipe_output" / "glue")
    assert model.config.d_model == 64


def _readme_quickstart_accuracy() -> tuple[str, set[str], set[str], dict[str, str]]:
    """The accuracy README.md's Quickstart quotes, the torch and transformers versions it was measured on,
    and the accuracies it quotes for CPU kernels that round differently (capability → accuracy)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8").replace("\n", " ")
    quoted = re.search(
        r"`eval accuracy: (\d\.\d+)` after [^;]*?on torch ([\d.]+) with transformers ([\d.]+(?: and [\d.]+)*);", readme
    )
    assert quoted, "README.md's Quickstart quotes `eval accuracy: X` after ..., on torch V with transformers V [and V];"
    other = r"`eval accuracy: (\d\.\d+)` where torch's CPU kernels are its (\w+) ones"
    per_kernels = {kernels: accuracy for accuracy, kernels in re.findall(other, readme)}
    return quoted.group(1), {quoted.group(2)}, set(quoted.group(3).split(" and ")), per_kernels


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_microbatches": 3}, "`per_device_train_batch_size=8` is not a multiple of `num_microbatches=3`"),
        (
            {"gradient_accumulation_steps": 2, "pipeline_schedule": "async"},
            "updates each stage inside the pipeline as its micro-batches stream through",
        ),
        ({"gradient_accumulation_steps": 2, "pipeline_schedule": "2bw"}, "use pipeline_schedule='gpipe' or '1f1b'"),
        ({"pipeline_schedule": "zero-bubble"}, "choose one of ['gpipe', '1f1b', 'async', '2bw', 'zb-h1', 'zbv', "),
        ({"async_update_interval": 2}, "only applies to pipeline_schedule='async' (got 'gpipe')"),
        ({"async_weight_prediction": True, "pipeline_schedule": "2bw"}, "only applies to pipeline_schedule='async'"),
        ({"partitioner": "magic"}, "`partitioner='magic'` is not available; choose one of ['auto',"),
        ({"token_slices": [3, 0, 5]}, "holds lengths that are not positive integers ([0])"),
        ({"token_slices": "512,half"}, "is neither 'auto' nor comma-separated slice lengths"),
        ({"token_slices": []}, "must be 'auto' or a non-empty list of slice lengths"),
        ({"token_slices": "auto", "pipeline_schedule": "async"}, "use one of ['gpipe', '1f1b'], or drop"),
    ],
)
def test_arguments_name_the_problem_and_the_fix(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("eval_batch", [2, 3, 6])
def test_an_eval_batch_size_fewer_than_or_not_a_multiple_of_the_microbatches_is_taken(
    tmp_path: Path, eval_batch: int
) -> None:
    # Before: refused ("not a multiple of `num_microbatches=4`") where Trainer takes it; evaluation runs a
    # batch of fewer rows in fewer micro-batches (the numbers: tests/faults/test_same_batch.py).
    args = PipeTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", num_microbatches=4,
        per_device_train_batch_size=8, per_device_eval_batch_size=eval_batch,
    )  # fmt: skip
    assert args.per_device_eval_batch_size == eval_batch


def test_a_schedule_file_is_taken_for_the_micro_batches_of_one_flush(tmp_path: Path) -> None:
    from hf_ftpipe.schedules import make_schedule

    order = tmp_path / "order.txt"
    order.write_text(str(make_schedule("zbv", [0, 1, 1, 0], 4)), encoding="utf-8")
    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "pipeline_schedule": str(order)}
    args = PipeTrainingArguments(num_microbatches=2, gradient_accumulation_steps=2, **common)
    assert args.schedule_traits.v_placement and args.schedule_traits.split_backward and args.schedule_traits.flushes
    with pytest.raises(ValueError) as error:
        PipeTrainingArguments(num_microbatches=4, gradient_accumulation_steps=2, **common)
    assert str(error.value) == (
        f"`pipeline_schedule={str(order)!r}` orders 4 micro-batches, but each optimizer step runs num_microbatches=4 "
        "x gradient_accumulation_steps=2 = 8 in one flush; write the file for 8 (`hf-ftpipe schedule "
        "--num-microbatches 8 ...`), or set num_microbatches and gradient_accumulation_steps to make 4. A step "
        "with fewer (a short last batch) runs the file's order less the missing micro-batches' actions"
    )
    with pytest.raises(ValueError, match=r"`token_slices=\[4, 4\]` with pipeline_schedule='.*order.txt': this "):
        PipeTrainingArguments(num_microbatches=4, token_slices=[4, 4], **common)
    with pytest.raises(ValueError, match=r"`push_partition_to_hub=True` with the schedule file '.*order.txt': a plan"):
        PipeTrainingArguments(num_microbatches=4, push_partition_to_hub=True, partition_repo="me/plans", **common)


def test_a_missing_schedule_file_names_both_choices(tmp_path: Path) -> None:
    missing = str(tmp_path / "order.csv")
    with pytest.raises(ValueError) as error:
        PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", pipeline_schedule=missing)
    assert str(error.value) == (
        f"`pipeline_schedule={missing!r}`: pipeline schedule file {missing!r} does not exist; give an existing file "
        "or a schedule's name, one of ['gpipe', '1f1b', 'async', '2bw', 'zb-h1', 'zbv', 'interleaved-1f1b', 'zb-auto']"
    )
