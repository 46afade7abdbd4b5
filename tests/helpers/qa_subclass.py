"""A question-answering trainer written against `Trainer`'s public hooks, as transformers'
``examples/pytorch/question-answering/trainer_qa.py`` writes its ``QuestionAnsweringTrainer``: it
overrides ``evaluate`` and ``predict``, switches ``compute_metrics`` off around
``evaluation_loop``, post-processes the start and end logits of the features into one answer
per example, scores the answers with ``compute_metrics``, prefixes the keys with
``metric_key_prefix``, adds the speed metrics, logs, and calls the ``on_evaluate`` callbacks
and the memory tracker. `question_answering_trainer(base)` makes it on `Trainer` or on
`PipeTrainer`: the pipeline must need nothing but the change of base class.

The data is any_batch_runs' question-answering rows: each evaluation feature (``example_id``,
``offset_mapping``) is its own example; the gold answer is the character span of the feature's
largest token and the next one, as the training positions are.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from datasets import Dataset
from transformers import EvalPrediction
from transformers.trainer_utils import PredictionOutput, speed_metrics


def question_answering_trainer(base: type) -> type:
    """``QuestionAnswering<base>``: ``base`` with trainer_qa.py's `evaluate` and `predict`."""

    class QuestionAnswering(base):
        def __init__(
            self, *args: Any, eval_examples: Dataset | None = None, post_process_function: Any = None, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.eval_examples = eval_examples
            self.post_process_function = post_process_function
            self.features_output: Any = None
            """The last loop's output on the features (start and end logits), for the comparison."""

        def evaluate(
            self,
            eval_dataset: Dataset | None = None,
            eval_examples: Dataset | None = None,
            ignore_keys: list[str] | None = None,
            metric_key_prefix: str = "eval",
        ) -> dict[str, float]:
            self._memory_tracker.start()
            features = self.eval_dataset if eval_dataset is None else eval_dataset
            examples = self.eval_examples if eval_examples is None else eval_examples
            output = self._features_loop(
                self.get_eval_dataloader(features), "Evaluation", ignore_keys, metric_key_prefix
            )
            if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
                answers = self.post_process_function(examples, features, output.predictions)
                metrics = {**_prefixed(self.compute_metrics(answers), metric_key_prefix), **output.metrics}
            else:
                metrics = output.metrics
            if self.args.should_log:
                self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            self._memory_tracker.stop_and_update_metrics(metrics)
            return metrics

        def predict(
            self,
            predict_dataset: Dataset,
            predict_examples: Dataset,
            ignore_keys: list[str] | None = None,
            metric_key_prefix: str = "test",
        ) -> PredictionOutput:
            loader = self.get_test_dataloader(predict_dataset)
            output = self._features_loop(loader, "Prediction", ignore_keys, metric_key_prefix)
            if self.post_process_function is None or self.compute_metrics is None:
                return output
            answers = self.post_process_function(predict_examples, predict_dataset, output.predictions, "predict")
            metrics = {**_prefixed(self.compute_metrics(answers), metric_key_prefix), **output.metrics}
            return PredictionOutput(predictions=answers.predictions, label_ids=answers.label_ids, metrics=metrics)

        def _features_loop(self, loader: Any, description: str, ignore_keys: Any, metric_key_prefix: str) -> Any:
            compute_metrics, self.compute_metrics = self.compute_metrics, None  # answers are scored, not logits
            start_time = time.time()
            try:
                output = self.evaluation_loop(
                    loader,
                    description=description,
                    prediction_loss_only=True if compute_metrics is None else None,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=metric_key_prefix,
                )
            finally:
                self.compute_metrics = compute_metrics
            steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
            output.metrics.update(speed_metrics(metric_key_prefix, start_time, output.num_samples, steps))
            self.features_output = output
            return output

    QuestionAnswering.__name__ = QuestionAnswering.__qualname__ = f"QuestionAnswering{base.__name__}"
    return QuestionAnswering


def gold_examples(features: Dataset) -> Dataset:
    """One example per feature, its answer the character span of the largest token and the next."""
    spans = []
    for ids, offsets in zip(features["input_ids"], features["offset_mapping"], strict=True):
        start = int(np.argmax(ids))
        end = min(start + 1, len(ids) - 1)
        spans.append([offsets[start][0], offsets[end][1]])
    return Dataset.from_dict({"id": features["example_id"], "answer": spans})


def best_spans(examples: Dataset, features: Dataset, predictions: Any, stage: str = "eval") -> EvalPrediction:
    """The post-processing function: each feature's best span (start ≤ end, inside its own tokens:
    the loop pads shorter batches' logits with -100) as characters, by example id."""
    start_logits, end_logits = predictions
    answers = {}
    for row, (example_id, offsets) in enumerate(zip(features["example_id"], features["offset_mapping"], strict=True)):
        n = len(offsets)
        start = int(np.argmax(start_logits[row][:n]))
        end = start + int(np.argmax(end_logits[row][start:n]))
        answers[example_id] = [offsets[start][0], offsets[end][1]]
    predicted = np.array([answers[i] for i in examples["id"]])
    return EvalPrediction(predictions=predicted, label_ids=np.array(examples["answer"]))


def span_metrics(answers: EvalPrediction) -> dict[str, float]:
    """``compute_metrics`` on post-processed answers: exact match and the character overlap (F1), ×100."""
    predicted, gold = answers.predictions, answers.label_ids
    exact = float(np.mean(np.all(predicted == gold, axis=1))) * 100
    overlap = np.clip(np.minimum(predicted[:, 1], gold[:, 1]) - np.maximum(predicted[:, 0], gold[:, 0]), 0, None)
    lengths = (predicted[:, 1] - predicted[:, 0]) + (gold[:, 1] - gold[:, 0])
    f1 = float(np.mean(2 * overlap / np.maximum(lengths, 1))) * 100
    return {"exact_match": exact, "f1": f1}


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
