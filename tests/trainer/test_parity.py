"""PipeTrainer (gpipe, 2 CPU processes) gives plain `Trainer`'s numbers on one process.

One launched job trains a tiny GPT-2 (label padding: micro-batches differ in label tokens; AdamW),
the same GPT-2 cut into uneven token slices (TeraPipe), with and without gradient accumulation
(G = 2: the slices of two batches in one flush), T5 (Adafactor) and BERT classifier (SGD);
this process runs plain `Trainer` on the same seed, data and arguments (once per model) and
compares every logged loss and gradient norm, the learning rates, `evaluate()`, `predict()` and
the final weights. The BERT run plans from costs measured on rank 0 (``cost_table="measured"``).
The job's T5 then predicts with generation through the pipeline, and its T5 and
GPT-2 generate with `PipeTrainer.generate` (greedy, beams, sampling), which must equal
`model.generate` on the trained weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    EvalPrediction,
    Trainer,
)

from hf_ftpipe.costmodel import CostTable

from distributed import REPO
from distributed import accelerate_launch as launch
from generation_cases import assert_generated_like_one_process
from parity_runs import (
    COST_TABLES,
    KINDS,
    STEPS,
    TOKEN_SLICES,
    base_kind,
    compute_metrics,
    make_data,
    reference_key,
    run,
)
from trainer_comparison import (
    assert_metrics_close,
    assert_outputs_close,
    assert_steps_close,
    assert_weights_close,
    logged_steps,
)

LOADERS = {"gpt2": AutoModelForCausalLM, "t5": AutoModelForSeq2SeqLM, "bert": AutoModelForSequenceClassification}


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("pipe")
    launch(str(REPO / "tests" / "trainer" / "parity_job.py"), str(output))
    return output


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict, Path]]:
    """Plain `Trainer`'s results and output folder for a kind's model, run once per model: the sliced
    GPT-2 compares with the same run as the whole-sequence one."""
    done: dict[tuple[str, int], tuple[dict, Path]] = {}

    def results(kind: str) -> tuple[dict, Path]:
        key = reference_key(kind)
        if key not in done:
            output = tmp_path_factory.mktemp(f"trainer-{key[0]}")
            done[key] = (run(kind, str(output), Trainer), output)
        return done[key]

    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_pipe_trainer_matches_trainer(
    pipeline_results: Path, trainer_results: Callable[[str], tuple[dict, Path]], kind: str
) -> None:
    pipe = torch.load(pipeline_results / kind / "result.pt", weights_only=False)
    reference, reference_dir = trainer_results(kind)
    assert pipe["token_slices"] == TOKEN_SLICES.get(kind), "the pipeline did not run the slices asked for"

    assert len(logged_steps(reference["history"])) == STEPS
    assert_steps_close(pipe["history"], reference["history"])

    assert_metrics_close(pipe["evaluate"], reference["evaluate"], "evaluate()")
    predictions, label_ids, metrics = pipe["predict"]
    want_predictions, want_labels, want_metrics = reference["predict"]
    assert_outputs_close(predictions, want_predictions, "predict() predictions")
    np.testing.assert_array_equal(label_ids, want_labels)
    assert_metrics_close(metrics, want_metrics, "predict() metrics")

    loader = LOADERS[base_kind(kind)]
    trained = loader.from_pretrained(pipeline_results / kind).state_dict()
    assert_weights_close(trained, loader.from_pretrained(reference_dir).state_dict())


@pytest.mark.distributed
@pytest.mark.slow
def test_measured_costs_are_timed_on_rank_0_alone_and_both_ranks_run_its_plan(pipeline_results: Path) -> None:
    """BERT's run (``cost_table="measured"``; its training matches `Trainer`'s above): each rank had
    its own HF_HOME, and a profile is cached where it is made, so only rank 0's holds a table."""
    assert COST_TABLES == {"bert": "measured"}
    run = pipeline_results / "bert"
    tables = sorted((run / "hf_home-rank0" / "hf_ftpipe" / "costs").glob("*.json"))
    assert len(tables) == 1, f"rank 0 should have profiled once, found {tables}"
    assert not (run / "hf_home-rank1" / "hf_ftpipe" / "costs").exists(), "rank 1 profiled too"
    table = CostTable.load(tables[0])
    plans = [json.loads((run / f"plan-rank{r}.json").read_text()) for r in (0, 1)]
    assert plans[0]["partition"] == plans[1]["partition"]
    assert (plans[0]["source"], plans[1]["source"]) == ("computed", None)  # planned on rank 0, received on 1
    key = plans[0]["partition"]["key"]
    assert (table.key.device, table.key.model_class) == ("cpu", "BertForSequenceClassification")
    assert (table.key.model_fingerprint, table.key.input_shapes) == (key["model_fingerprint"], key["input_shapes"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("result_key", ["generate", "generate_eos"])
def test_t5_generation_through_the_pipeline_equals_generate(pipeline_results: Path, result_key: str) -> None:
    """``generate``: the model's own EOS; ``generate_eos``: a second EOS id that most rows produce
    first, so rows end at different steps."""
    result = torch.load(pipeline_results / "t5" / "result.pt", weights_only=False)
    generated, metrics = result[result_key][:2]
    model = AutoModelForSeq2SeqLM.from_pretrained(pipeline_results / "t5").eval()
    eos = [1, result["generate_eos"][2]] if result_key == "generate_eos" else 1
    data = make_data("t5", 6, seed=2)
    labels = torch.tensor(data["labels"])
    with torch.no_grad():
        expected = model.generate(
            input_ids=torch.tensor(data["input_ids"]),
            attention_mask=torch.tensor(data["attention_mask"]),
            do_sample=False,
            num_beams=1,
            max_new_tokens=labels.shape[1],
            eos_token_id=eos,
        )
    expected = torch.nn.functional.pad(expected, (0, labels.shape[1] + 1 - expected.shape[1]), value=0)
    np.testing.assert_array_equal(generated, expected.numpy())
    assert (expected[:, 1:] != 0).any(), "generation produced only padding: the check would be trivial"
    if result_key == "generate_eos":
        assert (expected[:, 2:] == 0).any(), "no row ended early: the check would not cover EOS"

    reference = compute_metrics(EvalPrediction(predictions=expected.numpy(), label_ids=labels.numpy()))
    assert metrics["test_accuracy"] == pytest.approx(reference["accuracy"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_pipe_trainer_generate_equals_generate(pipeline_results: Path, kind: str) -> None:
    """Greedy, beam search and sampling under gpipe, on every rank (GPT-2: left-padded prompts)."""
    model = LOADERS[kind].from_pretrained(pipeline_results / kind)
    assert_generated_like_one_process(pipeline_results / kind, kind, model)
