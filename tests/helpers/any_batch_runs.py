"""The runs compared in tests/trainer/test_any_batch.py: batches as Hugging Face scripts make them
(dynamic padding, a short last batch, fewer samples than a batch, no labels), trained by PipeTrainer
(any_batch_job.py, 2 ranks) or plain `Trainer` (in the test) with the same model, data and seed.

Rows have different lengths and the collator pads each batch to its own longest row, so no two
steps need share a shape. Each case trains whole epochs, so the number of steps is the data
loader's, not a ``max_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
)

from any_batch_data import LONGEST, evaluation_rows, make_rows
from any_batch_parts import (
    LOGITS_APART,
    StepSlices,
    class_weighted_loss,
    generated_metrics,
    input_metrics,
    named_partitioner,
    token_loss,
    write_schedule_file,
)
from generation_cases import generate_on_every_rank
from mlm_runs import tokenizer
from models import tiny_model
from qa_subclass import best_spans, gold_examples, question_answering_trainer, span_metrics

GENERATING = ("gpt2", "t5")
"""The cases whose trained pipeline also generates with `PipeTrainer.generate` (`generation_cases`)."""


@dataclass(frozen=True)
class Case:
    """One comparison: a tiny model of ``model``, its data and collator, and how it trains."""

    model: str
    collator: str
    """``padding`` (`DataCollatorWithPadding`), ``causal`` (`DataCollatorForLanguageModeling`,
    ``mlm=False``: labels are the padded inputs, padding -100) or ``seq2seq`` (`DataCollatorForSeq2Seq`)."""
    train_rows: int
    batch_size: int
    epochs: int
    steps: int
    """The run's optimizer steps, worked out by hand: ceil(train_rows / batch_size) * epochs."""
    schedule: str = "gpipe"
    num_microbatches: int = 2
    schedule_file: bool = False
    """PipeTrainer runs `schedule` from a file: the order ``hf-ftpipe schedule`` prints for it, for the
    micro-batches of one flush on stages [0, 1] (`write_schedule_file`)."""
    args: dict[str, Any] = field(default_factory=dict)
    pipe_args: dict[str, Any] = field(default_factory=dict)
    """PipeTrainingArguments only (plain `Trainer` has no such thing)."""
    loss: str | None = None
    """``compute_loss_func`` (`token_loss`) or ``compute_loss`` (a subclass overriding it with
    `class_weighted_loss`): a loss computed from the model's outputs."""
    metrics: bool = False
    """``compute_metrics`` (`input_metrics`) reading what ``include_for_metrics`` adds: the inputs and the losses."""
    generate: dict[str, Any] | None = None
    """`Seq2SeqTrainer` (`PipeSeq2SeqTrainer`) with ``predict_with_generate``: ``evaluate()``'s generation
    keywords (``predict()`` takes the arguments' ``generation_max_length``), metrics by `generated_metrics`."""


CASES = {
    # 13 rows in batches of 4: the last batch of each epoch has 1 row, fewer than the micro-batches.
    # compute_metrics reads the inputs and per-row losses that include_for_metrics adds to EvalPrediction.
    "bert": Case(
        "bert",
        "padding",
        train_rows=13,
        batch_size=4,
        epochs=2,
        steps=8,
        args={"include_for_metrics": ["inputs", "loss"]},
        metrics=True,
    ),
    # Batches of rows of about one length, in the sampler's random order; 14 rows: a last batch of 2.
    # SGD: Adam turns rounding differences in the smallest gradients into visibly different steps.
    "gpt2": Case(
        "gpt2",
        "causal",
        train_rows=14,
        batch_size=4,
        epochs=1,
        steps=4,
        schedule="1f1b",
        args={"train_sampling_strategy": "group_by_length", "optim": "sgd", "learning_rate": 0.1},
    ),
    # The same, each sequence cut into token slices planned for the longest row (12) under gpipe: a batch of
    # L tokens keeps the slices that fit and cuts the last (9 as 5, 3, 1); batches of rows of about one length.
    "gpt2-sliced": Case(
        "gpt2",
        "causal",
        train_rows=14,
        batch_size=4,
        epochs=1,
        steps=4,
        args={"train_sampling_strategy": "group_by_length", "optim": "sgd", "learning_rate": 0.1},
        pipe_args={"token_slices": [5, 3, 4]},
    ),
    # Targets of different lengths too: the collator pads labels with -100 and makes decoder_input_ids;
    # batches drawn by transformers 5.24's cost-balancing sampler, which deals ranks their share; under 1f1b.
    # Seq2SeqTrainer with predict_with_generate: evaluate(max_length=4, num_beams=1) over generation_max_length=9,
    # greedy; predict's: 8 tokens (labels longer than the planned 5) by beam search (generation_num_beams=2: 8
    # rows a batch, in pieces of 4), both through the pipeline without the batch's decoder_input_ids, padded to
    # the model's generation max_length, 20.
    "t5": Case(
        "t5",
        "seq2seq",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=3,
        schedule="1f1b",
        args={
            "train_sampling_strategy": "batch_rebalance",
            "predict_with_generate": True,
            "generation_max_length": 9,
            "generation_num_beams": 2,
        },
        generate={"max_length": 4, "num_beams": 1},
    ),
    # 5 samples, batch 8: one step per epoch, of micro-batches of 2, 1, 1 and 1 rows. Trained on answer
    # positions; evaluated on features without them, as run_qa.py's are. SGD: the span head's bias (and
    # the last LayerNorm's) have no gradient but rounding noise (a shift of all logits leaves the
    # softmax alone), which Adam would scale up to whole steps of either sign.
    "bert-qa": Case(
        "bert-qa",
        "padding",
        train_rows=5,
        batch_size=8,
        epochs=2,
        steps=2,
        num_microbatches=4,
        args={"optim": "sgd", "learning_rate": 0.1, "include_for_metrics": ["inputs", "loss"]},
    ),
    # Gradient accumulation, G = 2: 18 rows in batches of 4 are windows of 2, 2 and 1 batches (the last of
    # 2 rows), each batch padded to its own length (the first window's: 11 and 12 tokens), run as one
    # flush of up to 4 micro-batches; the loss over the window's label tokens (num_items_in_batch). Under
    # zb-h1: each backward split into B and a later W, the same update.
    "gpt2-accumulate": Case(
        "gpt2",
        "causal",
        train_rows=18,
        batch_size=4,
        epochs=1,
        steps=3,
        schedule="zb-h1",
        args={"gradient_accumulation_steps": 2, "optim": "sgd", "learning_rate": 0.1},
    ),
    # The same from a schedule file: zb-h1's order for 2 x 2 micro-batches as `hf-ftpipe schedule` prints it.
    # 13 rows: windows of 4 + 4 rows and 4 + 1, the last a flush of 3 micro-batches that runs the file's order
    # less micro-batch 3's actions (its second batch has 1 row, fewer than num_microbatches).
    "gpt2-file": Case(
        "gpt2",
        "causal",
        train_rows=13,
        batch_size=4,
        epochs=1,
        steps=2,
        schedule="zb-h1",
        schedule_file=True,
        args={"gradient_accumulation_steps": 2, "optim": "sgd", "learning_rate": 0.1},
    ),
    # zb-auto: zb-h1's list scheduler timed by the stage costs of the plan `auto` makes, its order written to
    # output_dir and run from there; 10 rows in batches of 4, the last flush 1 micro-batch of 2 rows (the
    # order less micro-batch 1's actions).
    "gpt2-zb-auto": Case(
        "gpt2",
        "causal",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=3,
        schedule="zb-auto",
        args={"optim": "sgd", "learning_rate": 0.1},
    ),
    # G = 2 without num_items_in_batch (no `labels`: answer positions): each batch's mean over G.
    "bert-qa-accumulate": Case(
        "bert-qa",
        "padding",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=2,
        args={"gradient_accumulation_steps": 2, "optim": "sgd", "learning_rate": 0.1},
    ),
    # Label smoothing (LabelSmoother on the logits, last stage) with G = 2: batches of 4, 4, 2 in 2 windows;
    # under zbv, on the V placement the trainer plans for it (stages [0, 1, 1, 0]). Trainer's default optimizer,
    # fused AdamW, which reads each gradient's memory in its weight's order: W's must have the weight's strides.
    "t5-smoothing": Case(
        "t5",
        "seq2seq",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=2,
        schedule="zbv",
        args={"gradient_accumulation_steps": 2, "label_smoothing_factor": 0.1},
    ),
    # compute_loss_func, and a subclass's compute_loss override (with G = 2), on the model's outputs. GPT-2's
    # loss stage reads a view of the logits, which another rank computes: the pipeline sends it the logits too.
    "gpt2-loss-func": Case(
        "gpt2",
        "causal",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=3,
        loss="compute_loss_func",
        args={"optim": "sgd", "learning_rate": 0.1},
        pipe_args={"partitioner": LOGITS_APART},
    ),
    # torch_compile: each rank compiles its stages through dynamo (backend "eager": aot_eager and inductor cost
    # tens of seconds more here), batches of 4, 4 and 2 rows of different lengths; equal to Trainer uncompiled.
    # The weights keep their names; 4 graphs per rank (training, evaluation, each also for a 1-row micro-batch).
    "gpt2-compile": Case(
        "gpt2",
        "causal",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=3,
        schedule="1f1b",
        args={"optim": "sgd", "learning_rate": 0.1},
        pipe_args={"torch_compile": True, "torch_compile_backend": "eager"},
    ),
    # G = 2 on BERT's classification head, whose forward takes **kwargs (so Trainer counts num_items_in_batch
    # and divides by no G) but takes a CrossEntropyLoss mean of its own: each batch's mean, summed over the
    # window. Batches of 4, 4 and 2 rows: the last window has one batch.
    "bert-accumulate": Case(
        "bert",
        "padding",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=2,
        args={"gradient_accumulation_steps": 2},
    ),
    "bert-compute-loss": Case(
        "bert",
        "padding",
        train_rows=14,
        batch_size=4,
        epochs=1,
        steps=2,
        loss="compute_loss",
        args={"gradient_accumulation_steps": 2},
    ),
    # Label smoothing (run_clm.py's --label_smoothing_factor) with G = 2 under 1f1b, the logits computed on
    # rank 1 and the loss on rank 0: the smoothed loss's gradient of the logits goes back to rank 1. Last: a
    # later case of the same shapes would find its plan in the cache.
    "gpt2-smoothing": Case(
        "gpt2",
        "causal",
        train_rows=10,
        batch_size=4,
        epochs=1,
        steps=2,
        schedule="1f1b",
        args={"gradient_accumulation_steps": 2, "label_smoothing_factor": 0.1, "optim": "sgd", "learning_rate": 0.1},
        pipe_args={"partitioner": LOGITS_APART},
    ),
}


def collator(case: Case, model: Any) -> Any:
    if case.collator == "padding":
        return DataCollatorWithPadding(tokenizer())
    if case.collator == "causal":
        return DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    return DataCollatorForSeq2Seq(tokenizer(), model=model)


def setup(name: str, output_dir: str, pipe: bool) -> dict[str, Any]:
    """Trainer's keyword arguments for case ``name``; ``pipe`` picks PipeTrainingArguments."""
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    from hf_ftpipe import PipeSeq2SeqTrainingArguments, PipeTrainingArguments

    case = CASES[name]
    common: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=case.batch_size,
        per_device_eval_batch_size=4,
        num_train_epochs=case.epochs,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    common.update(case.args)
    if pipe:
        pipe_class = PipeSeq2SeqTrainingArguments if case.generate is not None else PipeTrainingArguments
        flush = case.num_microbatches * case.args.get("gradient_accumulation_steps", 1)
        schedule = write_schedule_file(case.schedule, flush, output_dir) if case.schedule_file else case.schedule
        args = pipe_class(
            num_microbatches=case.num_microbatches, pipeline_schedule=schedule, **case.pipe_args, **common
        )
    else:
        args = (Seq2SeqTrainingArguments if case.generate is not None else TrainingArguments)(**common)
    model = tiny_model(case.model)
    return {
        "model": model,
        "args": args,
        "train_dataset": make_rows(case.model, case.train_rows, seed=1),
        "eval_dataset": evaluation_rows(case.model),
        "data_collator": collator(case, model),
        "processing_class": tokenizer(),  # group_by_length reads the model's input name from it
    }


def run(name: str, output_dir: str, trainer_class: type) -> dict[str, Any]:
    """Train, evaluate, predict (on the rows without labels where the case has labels to drop); the
    results of one run as plain data, with the trained weights."""
    pipe = trainer_class.__name__ == "PipeTrainer"
    named_partitioner[0] = CASES[name].pipe_args.get("partitioner")
    parts = setup(name, output_dir, pipe=pipe)
    generate = CASES[name].generate
    if generate is not None:
        from transformers import Seq2SeqTrainer

        from hf_ftpipe import PipeSeq2SeqTrainer

        trainer_class = PipeSeq2SeqTrainer if pipe else Seq2SeqTrainer
        parts["compute_metrics"] = generated_metrics
    loss = CASES[name].loss
    if loss == "compute_loss_func":
        parts["compute_loss_func"] = token_loss
    elif loss == "compute_loss":
        trainer_class = type(
            f"ClassWeighted{trainer_class.__name__}", (trainer_class,), {"compute_loss": class_weighted_loss}
        )
    if CASES[name].metrics:
        parts["compute_metrics"] = input_metrics
    kind = CASES[name].model
    if kind == "bert-qa":  # run_qa.py's trainer: evaluate and predict overridden, answers post-processed
        trainer_class = question_answering_trainer(trainer_class)
        parts.update(
            eval_examples=gold_examples(parts["eval_dataset"]),
            post_process_function=best_spans,
            compute_metrics=span_metrics,
        )
    trainer = trainer_class(**parts)
    slicings = StepSlices(trainer)
    trainer.add_callback(slicings)
    trainer.train()
    result: dict[str, Any] = {"history": trainer.state.log_history, "global_step": trainer.state.global_step}
    if kind == "bert-qa":  # features without positions, as run_qa.py's; its metrics, and the features' logits
        metrics = trainer.evaluate()
        output = trainer.features_output
        result["evaluate"] = (output.predictions, output.label_ids, metrics)
        predicted = trainer.predict(parts["eval_dataset"], parts["eval_examples"])
        result["predict"] = (predicted.predictions, predicted.label_ids, predicted.metrics)
        result["predict_logits"] = trainer.features_output.predictions
    else:
        result["evaluate"] = trainer.evaluate(**(generate or {}))
        # bert predicts rows longer than any it trained or evaluated on (a test split's longest sentence): the
        # plan is for the shorter ones, so PipeTrainer evaluates these in pieces of fewer rows.
        unseen = make_rows(kind, 7, seed=2, labelled=False, longest=LONGEST + 9)
        features = unseen if kind == "bert" else parts["eval_dataset"]
        predicted = trainer.predict(features)
        result["predict"] = (predicted.predictions, predicted.label_ids, predicted.metrics)
        if pipe and name in GENERATING:  # PipeTrainer.generate under 1f1b: every case
            generate_on_every_rank(trainer, kind, output_dir)
    result["weights"] = {n: v.detach().clone() for n, v in trainer.model.state_dict().items()}
    result["token_slices"] = slicings.seen
    order = Path(output_dir) / "zb-auto-order.txt"  # what zb-auto built and ran (hf_ftpipe.trainer.auto_order)
    result["zb_auto_order"] = order.read_text(encoding="utf-8") if order.is_file() else None
    compiler = getattr(getattr(trainer, "engine", None), "compiler", None)
    result["compiled_graphs"] = None if compiler is None else compiler.graphs
    return result
