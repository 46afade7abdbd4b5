"""`PipeTrainer` for extractive question answering: predictions on features, scores on examples.

As Hugging Face's ``QuestionAnsweringTrainer`` (``examples/pytorch/question-answering``): a long
context is split into several features (windows), the pipeline predicts start and end logits
per feature, and a post-processing function turns them into one answer text per example, which
the official SQuAD metric scores. So `evaluate` returns ``eval_exact_match`` and ``eval_f1``
(beside ``eval_loss`` and the speed metrics) and `predict` returns the answers by example id.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from datasets import Dataset
from transformers.trainer_utils import PredictionOutput, speed_metrics

from hf_ftpipe import PipeTrainer
from hf_ftpipe.metrics import load_metric

# (examples, features, start_logits, end_logits) -> {example id: answer text}
PostProcess = Callable[[Dataset, Dataset, np.ndarray, np.ndarray], dict[str, str]]
# what post-processing reads from the features, and the model does not take
FEATURE_ONLY_COLUMNS = ("example_id", "offset_mapping")


class QuestionAnsweringPipeTrainer(PipeTrainer):
    """`PipeTrainer` whose `evaluate` and `predict` answer questions and score the answers.

    The arguments come in the order of run_qa.py's ``QuestionAnsweringTrainer`` (``predict(features,
    examples)``), so a script written for that one calls this one alike.

    Args:
        eval_examples (`Dataset`, *optional*):
            The raw examples behind ``eval_dataset`` (its features): ``id``, ``context`` and, to be
            scored, ``answers``.
        post_process_function (`Callable`):
            ``(examples, features, start_logits, end_logits) -> {id: text}``.
        metric_name (`str`, defaults to ``"squad"``):
            Loaded with `hf_ftpipe.metrics.load_metric` on first use (the official SQuAD v1.1
            script, or its shipped copy offline).
        *args, **kwargs:
            `PipeTrainer`'s. The features keep ``example_id`` and ``offset_mapping``; they are
            dropped before batching, since the model takes neither.
    """

    def __init__(
        self,
        *args: Any,
        eval_examples: Dataset | None = None,
        post_process_function: PostProcess,
        metric_name: str = "squad",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.eval_examples = eval_examples
        self.post_process_function = post_process_function
        self.metric_name = metric_name
        self._metric = None

    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        eval_examples: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Predict on the features, answer the examples, score them: ``{prefix}_exact_match``,
        ``{prefix}_f1`` (×100), ``{prefix}_loss`` and the speed metrics; logged as `Trainer.evaluate` does."""
        features = self.eval_dataset if eval_dataset is None else eval_dataset
        examples = self.eval_examples if eval_examples is None else eval_examples
        if features is None or examples is None:
            raise ValueError("evaluation needs features and their examples: pass `eval_dataset` and `eval_examples`")
        output = self._predict_features(features, "Evaluation", ignore_keys, metric_key_prefix)
        answers = self.post_process_function(examples, features, *output.predictions)
        metrics = {**output.metrics, **self.score(answers, examples, metric_key_prefix)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(
        self,
        test_dataset: Dataset,
        test_examples: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "predict",
    ) -> PredictionOutput:
        """Answer the examples behind ``test_dataset``: ``predictions`` is ``{id: text}``; the metrics
        hold ``{prefix}_exact_match`` and ``{prefix}_f1`` when the examples have ``answers``."""
        if test_examples is None:
            raise ValueError("prediction needs the examples behind the features: pass `test_examples`")
        output = self._predict_features(test_dataset, "Prediction", ignore_keys, metric_key_prefix)
        answers = self.post_process_function(test_examples, test_dataset, *output.predictions)
        metrics = dict(output.metrics)
        if "answers" in test_examples.column_names:
            metrics.update(self.score(answers, test_examples, metric_key_prefix))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        return PredictionOutput(predictions=answers, label_ids=None, metrics=metrics)

    def score(self, answers: dict[str, str], examples: Dataset, metric_key_prefix: str) -> dict[str, float]:
        """The official SQuAD exact match and F1 of ``answers`` against the examples' ``answers``."""
        if self._metric is None:
            self._metric = load_metric(self.metric_name)
        missing = [id_ for id_ in examples["id"] if id_ not in answers]
        if missing:  # an example without features would silently count as wrong
            raise ValueError(f"{len(missing)} examples have no predicted answer, e.g. {missing[:3]}")
        scores = self._metric.compute(
            predictions=[{"id": id_, "prediction_text": answers[id_]} for id_ in examples["id"]],
            references=[{"id": id_, "answers": gold} for id_, gold in zip(examples["id"], examples["answers"])],
        )
        return {f"{metric_key_prefix}_{name}": value for name, value in scores.items()}

    def _predict_features(
        self, features: Dataset, description: str, ignore_keys: list[str] | None, metric_key_prefix: str
    ) -> Any:
        """`Trainer.evaluation_loop` over the features (start and end logits of every one, none
        dropped: the pipeline takes a short last batch as it is), without `compute_metrics`. Batches
        of different lengths are joined as `Trainer` joins them, the shorter padded with -100."""
        inputs = features.remove_columns([c for c in FEATURE_ONLY_COLUMNS if c in features.column_names])
        dataloader = self.get_eval_dataloader(inputs)
        compute_metrics, self.compute_metrics = self.compute_metrics, None  # answers are scored, not logits
        start_time = time.time()
        try:
            output = self.evaluation_loop(
                dataloader,
                description=description,
                prediction_loss_only=False,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        finally:
            self.compute_metrics = compute_metrics
        if output.num_samples != len(features):
            raise RuntimeError(f"{description.lower()} saw {output.num_samples} of {len(features)} features")
        steps = math.ceil(output.num_samples / self.args.eval_batch_size)
        output.metrics.update(speed_metrics(metric_key_prefix, start_time, output.num_samples, steps))
        return output
