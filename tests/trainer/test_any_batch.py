"""PipeTrainer (2 CPU processes, under torchrun) takes the batches Hugging Face scripts make and gives
plain `Trainer`'s numbers on one process.

One launched job runs every case of `any_batch_runs.CASES`: token rows of different lengths padded
per batch (`DataCollatorWithPadding` for BERT, `DataCollatorForLanguageModeling(mlm=False)` for
GPT-2 with ``train_sampling_strategy="group_by_length"`` under 1f1b and, cut into token slices
planned for the longest row, under gpipe, `DataCollatorForSeq2Seq` for T5 with
``train_sampling_strategy="batch_rebalance"`` under 1f1b, and as `Seq2SeqTrainer` with
``predict_with_generate``: `PipeSeq2SeqTrainer`'s generated tokens and metrics, greedy at evaluate,
beam search at predict), a last batch of 1 row (13 samples, batch 4), predictions on rows without
labels (BERT, whose ``compute_metrics`` reads what ``include_for_metrics`` adds), and a
question-answering BERT trained on 5 samples with batch 8 and evaluated on longer features without
answer positions, as run_qa.py's are, by run_qa.py's kind of trainer subclass (`qa_subclass`:
evaluate and predict overridden, made on either base class); and `Trainer`'s training options:
gradient accumulation (G = 2, batches of different lengths in one window, an incomplete last window;
GPT-2 under zb-h1, where `Trainer` counts ``num_items_in_batch``, the same from a schedule file of zb-h1's
order whose last flush runs 3 of its 4 micro-batches, BERT's classification head, whose forward takes
``**kwargs`` but a mean of its own, so that `Trainer` sums the window's batch means, and question
answering, where it divides by G),
the order ``zb-auto`` builds for GPT-2's plan from its stage costs (written to ``output_dir`` and run from there),
label smoothing (T5 under zbv on a V placement, G = 2, with `Trainer`'s default fused
AdamW; GPT-2 under 1f1b, G = 2),
``compute_loss_func`` (GPT-2) and a subclass's ``compute_loss`` override (BERT, G = 2), on the last
stage (the GPT-2 ones under a plan that computes
the logits on rank 1 and the loss, from a view of them, on rank 0); ``torch_compile`` (GPT-2, each rank's
stages compiled, batches of three lengths). This process trains plain `Trainer` on the same case and
compares the number of steps, every logged loss, gradient norm and learning rate, evaluation,
prediction and the weights. The trained GPT-2 and T5 pipelines (1f1b) also generate with
`PipeTrainer.generate`, equal to `model.generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer

from hf_ftpipe.graph.token_slices import fit_slices

from any_batch_runs import CASES, GENERATING, collator, run
from distributed import REPO, torchrun
from generation_cases import assert_generated_like_one_process
from models import tiny_model
from trainer_comparison import (
    assert_metrics_close,
    assert_outputs_close,
    assert_steps_close,
    assert_weights_close,
    logged_steps,
)


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("pipe")
    torchrun(str(REPO / "tests" / "trainer" / "any_batch_job.py"), str(output))
    return output


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_pipe_trainer_matches_trainer_on_any_batch(pipeline_results: Path, tmp_path: Path, name: str) -> None:
    pipe = torch.load(pipeline_results / f"{name}.pt", weights_only=False)
    reference = run(name, str(tmp_path), Trainer)

    assert len(logged_steps(reference["history"])) == reference["global_step"] == CASES[name].steps
    assert pipe["global_step"] == CASES[name].steps
    given = CASES[name].pipe_args.get("token_slices")
    if given is not None:  # each step cut by the rule for its length, and the lengths differ
        steps = pipe["token_slices"]
        assert len(steps) == CASES[name].steps and all(s == list(fit_slices(given, sum(s))) for s in steps), steps
        assert len({sum(s) for s in steps}) > 1 and min(len(s) for s in steps) < len(given), steps
    assert_steps_close(pipe["history"], reference["history"])
    if CASES[name].schedule == "zb-auto":  # the order built for the plan ran, every stage's W after its B
        order = pipe["zb_auto_order"]
        assert order is not None and order.count("W") == order.count("B") > 0, order
    else:
        assert pipe["zb_auto_order"] is None
    if CASES[name].pipe_args.get("torch_compile"):  # compiled once per mode and 1-row shape, not per length
        assert pipe["compiled_graphs"] == 4, pipe["compiled_graphs"]
    else:
        assert pipe["compiled_graphs"] is None

    if CASES[name].model == "bert-qa":  # run_qa.py's trainer subclass on either base: logits, answers, scores
        start_end, label_ids, metrics = pipe["evaluate"]
        want_start_end, want_label_ids, want_metrics = reference["evaluate"]
        assert isinstance(want_start_end, tuple) and len(want_start_end) == 2 and want_label_ids is None
        assert_outputs_close(start_end, want_start_end, "evaluation start/end logits")
        assert_outputs_close(label_ids, want_label_ids, "evaluation label_ids")
        assert {"eval_exact_match", "eval_f1", "eval_runtime"} <= set(want_metrics), want_metrics
        assert_metrics_close(metrics, want_metrics, "evaluate() of the subclass")
        assert_outputs_close(pipe["predict_logits"], reference["predict_logits"], "prediction start/end logits")
    else:
        if CASES[name].metrics:  # include_for_metrics: every row's inputs and loss reached compute_metrics
            assert reference["evaluate"]["eval_input_rows"] == reference["evaluate"]["eval_loss_rows"] == 7
        assert_metrics_close(pipe["evaluate"], reference["evaluate"], "evaluate()")

    predictions, label_ids, metrics = pipe["predict"]
    want_predictions, want_label_ids, want_metrics = reference["predict"]
    if CASES[name].generate is not None:  # Seq2SeqTrainer's generated tokens, fed decoder_input_ids it drops
        batch = collator(CASES[name], tiny_model("t5"))([{"input_ids": [5, 6], "labels": [7, 1]}])
        assert "decoder_input_ids" in batch, "the collator made no decoder_input_ids: nothing to drop"
        assert want_predictions.shape[1] == 20 and want_predictions.dtype.kind == "i", want_predictions.shape
        assert want_metrics["test_generated_tokens"] > 0 and reference["evaluate"]["eval_generated_tokens"] > 0
    if CASES[name].model == "bert":  # predicted on rows without labels
        assert want_label_ids is None and "test_loss" not in want_metrics, "the reference had labels"
    if CASES[name].model == "bert-qa":  # answers as character spans, scored against the examples' by the subclass
        assert want_predictions.shape == want_label_ids.shape == (7, 2) and "test_f1" in want_metrics, want_metrics
    assert_outputs_close(predictions, want_predictions, "predict() predictions")
    assert_outputs_close(label_ids, want_label_ids, "predict() label_ids")
    assert_metrics_close(metrics, want_metrics, "predict() metrics")

    assert_weights_close(pipe["weights"], reference["weights"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATING)
def test_pipe_trainer_generate_equals_generate_under_1f1b(pipeline_results: Path, name: str) -> None:
    """Greedy, beam search and sampling on the trained pipeline, on every rank (GPT-2: left-padded prompts)."""
    assert CASES[name].schedule == "1f1b"
    model = tiny_model(CASES[name].model)
    model.load_state_dict(torch.load(pipeline_results / f"{name}.pt", weights_only=False)["weights"])
    assert_generated_like_one_process(pipeline_results / name, CASES[name].model, model)
