"""examples/run_glue_pipe.py: every task in one real 2-process launch, and its pieces as pure code."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from datasets import load_dataset
from transformers import Adafactor, AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.metrics import load_metric

from example_modules import DATA, load_example

SCORE_KEYS = {"cb": {"accuracy", "f1"}, "multirc": {"exact_match", "f1_a"}}


@pytest.fixture(scope="module")
def glue() -> ModuleType:
    return load_example("run_glue_pipe")


@pytest.fixture(scope="module")
def run(t5_examples_run: Path) -> Path:
    """The launch of t5_examples_job.py (tests/examples/conftest.py): main() once per task, results in
    OUT/<case>/. Its multirc case runs the arguments of docs/examples.md's multirc command
    (t5_examples_job.CASES)."""
    return t5_examples_run


def _results(run: Path, case: str, split: str) -> dict:
    return json.loads((run / case / f"{split}_results.json").read_text())


@pytest.mark.parametrize("case", ["boolq", "cb", "copa", "multirc", "rte", "rte_glue", "wic"])
def test_each_task_reports_its_t5_scores(run, case):
    evaluation = _results(run, case, "eval")
    task = case.removesuffix("_glue")
    scores = {key.removeprefix("eval_") for key in evaluation} - {"loss", "runtime", "samples"}
    scores -= {"samples_per_second", "steps_per_second", "epoch"}
    assert scores == SCORE_KEYS.get(task, {"accuracy"})
    assert all(0.0 <= evaluation[f"eval_{key}"] <= 100.0 for key in scores)
    assert evaluation["eval_samples"] == (12 if task == "multirc" else 8)
    everything = json.loads((run / case / "all_results.json").read_text())
    assert everything["train_samples"] == 64
    steps = json.loads((run / case / "trainer_state.json").read_text())["global_step"]
    assert steps == (40 if case == "rte_glue" else 2)


def test_scores_are_those_of_the_saved_model_generating_on_one_process(run, glue):
    """GLUE-layout RTE: the pipeline's generated labels, scored, equal model.generate's on one process."""
    folder = run / "rte_glue"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    rows = load_dataset("json", data_files=str(DATA / "glue_rte_validation.jsonl"), split="train").select(range(8))
    task = glue.get_task("rte", rows.column_names)
    assert task.name == "glue_rte"
    # the evaluation batch as the script collates it: padded to its longest input
    features = glue.tokenize_batch(tokenizer, task, rows[:], max_source_length=32, max_target_length=4)
    batch = DataCollatorForSeq2Seq(tokenizer)([{name: features[name][i] for name in features} for i in range(8)])
    # the pipeline is planned for the data's longest label, a label name and EOS (at most 4), and
    # generates up to that + 1 tokens
    label_length = min(4, max(len(tokenizer(name).input_ids) for name in task.label_names))
    with torch.no_grad():
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            num_beams=1,
            max_length=label_length + 1,
        )
    labels = glue.generated_labels(tokenizer, task, generated.numpy())
    assert set(labels) & set(task.label_names), f"nothing learnt in 40 steps: {labels}"
    references = [task.label_names[label] for label in rows["label"]]
    expected = load_metric("t5_super_glue", "rte").compute(predictions=labels, references=references)
    assert _results(run, "rte_glue", "eval")["eval_accuracy"] == pytest.approx(expected["accuracy"])
    # --do_predict on the same first rows with label -1: the labels written are the generated ones
    lines = (folder / "predict_results_glue_rte.txt").read_text().splitlines()
    assert lines == ["index\tprediction", *(f"{i}\t{label}" for i, label in enumerate(labels[:5]))]
    predicted = _results(run, "rte_glue", "predict")
    assert predicted["predict_samples"] == 5 and "predict_loss" not in predicted  # no label tokens


def test_generated_text_that_decodes_like_a_label_is_that_label(glue):
    task = glue.get_task("boolq")
    tokenizer = load_example("local_tokenizer").build_t5_tokenizer(["is it true or false"], vocab_size=512)
    ids = tokenizer(["True", "false", "maybe"], padding=True).input_ids  # the local tokenizer lowercases
    generated = [[tokenizer.pad_token_id, *row] for row in ids]  # decoder start token first
    assert glue.generated_labels(tokenizer, task, torch.tensor(generated).numpy()) == ["True", "False", "maybe"]


def test_adafactor_flag_builds_ftpipe_optimizer(glue, tmp_path):
    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=1e-3)
    assert glue.ftpipe_adafactor(glue.ModelArguments(), args) is None  # --optim decides
    optimizer_cls, kwargs = glue.ftpipe_adafactor(glue.ModelArguments(adafactor_scale_parameter=True), args)
    assert optimizer_cls is Adafactor
    assert kwargs == {"lr": 1e-3, "scale_parameter": True, "relative_step": False, "warmup_init": False}
    assert args.optim == "adafactor"  # the planner counts Adafactor's state


def test_data_defaults_to_the_task_fixture_and_hub_config(glue):
    data = glue.DataTrainingArguments(task_name="multirc")
    assert (data.train_file, data.validation_file) == (
        str(DATA / "multirc_train.jsonl"),
        str(DATA / "multirc_validation.jsonl"),
    )
    hub = glue.DataTrainingArguments(task_name="wic", dataset_name="aps/super_glue")
    assert (hub.train_file, hub.dataset_config_name) == (None, "wic")
