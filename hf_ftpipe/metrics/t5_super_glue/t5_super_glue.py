"""SuperGLUE scores for text-to-text models, as the T5 library reports them (times 100).

Predictions and references are label names, the strings a T5 model generates ("entailment",
"True", "choice2"...), or label ids in the dataset's order, as the Hub's ``super_glue`` module
takes them. Load one task by path, offline:

    >>> import evaluate
    >>> metric = evaluate.load("path/to/t5_super_glue", "cb")
    >>> metric.compute(predictions=["entailment", "neutral"], references=["entailment", "contradiction"])
    {'accuracy': 50.0, 'f1': 33.33333333333333}

Rules (Wang et al., 2019; T5's ``t5/evaluation/metrics.py``):

- boolq, copa, rte, wic: accuracy.
- cb: accuracy and the macro F1 over the three classes, each class's F1 being
  ``2 TP / (2 TP + FP + FN)`` and 0 for a class with no true positive.
- multirc: F1a, the binary F1 of "True" over every answer option, and EM, the share of questions
  (options grouped by paragraph and question index) whose options are all right. MultiRC
  predictions carry the dataset's ``idx``, as in the Hub's ``super_glue`` module:
  ``{"idx": {"paragraph": p, "question": q, "answer": a}, "prediction": "True"}``.
- A prediction that is not a label of the task counts as wrong: it matches no reference, is no
  class's positive in CB, and is taken as the opposite of the reference in MultiRC's F1a.

Self-contained on purpose (only the standard library, ``datasets`` and ``evaluate``), so the
folder can be pushed to the Hub as it is. One import per line: evaluate's import scanner misreads
``import a, b``.
"""

from collections.abc import Hashable, Sequence

import datasets
import evaluate

_CITATION = """\
@inproceedings{wang2019superglue,
  title={Super{GLUE}: A Stickier Benchmark for General-Purpose Language Understanding Systems},
  author={Wang, Alex and Pruksachatkun, Yada and Nangia, Nikita and Singh, Amanpreet and Michael, Julian
          and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={Advances in Neural Information Processing Systems 32},
  year={2019}
}
@article{raffel2020t5,
  title={Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer},
  author={Raffel, Colin and Shazeer, Noam and Roberts, Adam and Lee, Katherine and Narang, Sharan
          and Matena, Michael and Zhou, Yanqi and Li, Wei and Liu, Peter J.},
  journal={Journal of Machine Learning Research},
  volume={21},
  number={140},
  pages={1--67},
  year={2020}
}
"""

_DESCRIPTION = """\
SuperGLUE metrics for text-to-text (T5) models, times 100: accuracy (boolq, copa, rte, wic),
accuracy and macro F1 over 3 classes (cb), F1a and exact match per question (multirc). A
prediction outside the task's labels counts as wrong.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: label names (the generated text, stripped) or label ids, one per example; for
        multirc, `{"idx": {"paragraph": int, "question": int, "answer": int}, "prediction": ...}`.
    references: gold label names or label ids, one per example.
Returns:
    boolq, copa, rte, wic: `accuracy`.
    cb: `accuracy`, `f1` (macro over entailment, contradiction, neutral).
    multirc: `exact_match` (per question), `f1_a` (binary F1 of "True" over all answer options).
Examples:
    >>> metric = evaluate.load("path/to/t5_super_glue", "rte")
    >>> metric.compute(predictions=["entailment", "yes"], references=["entailment", "not_entailment"])
    {'accuracy': 50.0}
"""

# Label names in the dataset's label-id order (T5 generates the names).
LABEL_NAMES: dict[str, tuple[str, ...]] = {
    "boolq": ("False", "True"),
    "cb": ("entailment", "contradiction", "neutral"),
    "copa": ("choice1", "choice2"),
    "multirc": ("False", "True"),
    "rte": ("entailment", "not_entailment"),
    "wic": ("False", "True"),
}
INVALID = -1


def _check_same_length(predictions: Sequence[object], references: Sequence[object]) -> None:
    if len(predictions) != len(references):
        raise ValueError(
            f"metric inputs must have one entry per example, but `predictions` has {len(predictions)}, "
            f"`references` has {len(references)}"
        )
    if not references:
        raise ValueError("metric inputs are empty (predictions, references): nothing to score")


def to_label_ids(values: Sequence[object], label_names: Sequence[str]) -> list[int]:
    """Label ids of label names or ids; anything else (unknown text, id out of range) is ``INVALID``."""
    ids = []
    for value in values:
        if isinstance(value, str):
            ids.append(label_names.index(value) if value in label_names else INVALID)
        else:
            # Ids arrive as int64 through evaluate's features; a fractional id is no label.
            ids.append(int(value) if value == int(value) and 0 <= value < len(label_names) else INVALID)
    return ids


def accuracy(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    """Fraction of predictions equal to their reference, in ``[0, 1]``."""
    _check_same_length(predictions, references)
    return sum(p == r for p, r in zip(predictions, references)) / len(references)


def macro_f1(predictions: Sequence[int], references: Sequence[int], num_classes: int) -> float:
    """Mean over classes ``0 .. num_classes - 1`` of each class's F1, in ``[0, 1]``.

    A class's F1 is ``2 TP / (2 TP + FP + FN)``, 0 when it has no true positive (scikit-learn's
    ``f1_score(labels=range(num_classes), average="macro")``, which T5 calls). A prediction that
    is no class (``INVALID``) adds a false negative to its reference's class only.
    """
    _check_same_length(predictions, references)
    total = 0.0
    for c in range(num_classes):
        true_pos = sum(p == c and r == c for p, r in zip(predictions, references))
        false_pos = sum(p == c and r != c for p, r in zip(predictions, references))
        false_neg = sum(p != c and r == c for p, r in zip(predictions, references))
        total += 2 * true_pos / (2 * true_pos + false_pos + false_neg) if true_pos else 0.0
    return total / num_classes


def multirc_f1a_em(
    predictions: Sequence[int], labels: Sequence[int], question_ids: Sequence[Hashable]
) -> dict[str, float]:
    """MultiRC's F1a over all answer options and exact match per question, fractions in ``[0, 1]``.

    Args:
        predictions (`Sequence[int]`):
            Per answer option, 1 (true) or 0 (false); any other value is an invalid prediction,
            forced wrong: it counts as the opposite of the label (T5's ``f1_score_with_invalid``).
        labels (`Sequence[int]`):
            Per answer option, the gold 0/1 label.
        question_ids (`Sequence[Hashable]`):
            Per answer option, its question, e.g. ``(paragraph, question)`` from the ``idx`` column.
            Options of one question need not be adjacent.

    Returns:
        `dict[str, float]`: ``{"f1a": ..., "exact_match": ...}``; F1a is 0 without a true positive.
    """
    _check_same_length(predictions, labels)
    _check_same_length(question_ids, labels)
    bad = sorted({y for y in labels if y not in (0, 1)}, key=repr)
    if bad:
        raise ValueError(f"`labels` must hold 0 or 1 per answer option, found {bad[:5]}")
    forced = [p if p in (0, 1) else 1 - y for p, y in zip(predictions, labels)]
    true_pos = sum(p == 1 and y == 1 for p, y in zip(forced, labels))
    false_pos = sum(p == 1 and y == 0 for p, y in zip(forced, labels))
    false_neg = sum(p == 0 and y == 1 for p, y in zip(forced, labels))
    f1a = 2 * true_pos / (2 * true_pos + false_pos + false_neg) if true_pos else 0.0
    all_right: dict[Hashable, bool] = {}
    for p, y, q in zip(forced, labels, question_ids):
        all_right[q] = all_right.get(q, True) and p == y
    return {"f1a": f1a, "exact_match": sum(all_right.values()) / len(all_right)}


def _features(task: str, label: datasets.Value) -> datasets.Features:
    if task == "multirc":
        idx = {name: datasets.Value("int64") for name in ("answer", "paragraph", "question")}
        return datasets.Features({"predictions": {"idx": idx, "prediction": label}, "references": label})
    return datasets.Features({"predictions": label, "references": label})


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class T5SuperGlue(evaluate.Metric):
    """T5's SuperGLUE scores on label names or ids; the config name is the task."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in LABEL_NAMES:
            raise ValueError(
                f"unknown t5_super_glue task {self.config_name!r}: pass one of {sorted(LABEL_NAMES)} "
                f"as config_name, e.g. evaluate.load(path, 'rte')"
            )
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            # Strings first: evaluate picks the first format the first example fits, and a string
            # such as "1" would also fit int64.
            features=[
                _features(self.config_name, datasets.Value("string")),
                _features(self.config_name, datasets.Value("int64")),
            ],
            codebase_urls=["https://github.com/google-research/text-to-text-transfer-transformer"],
            reference_urls=["https://super.gluebenchmark.com/"],
        )

    def _compute(self, predictions: list, references: list) -> dict[str, float]:
        names = LABEL_NAMES[self.config_name]
        gold = to_label_ids(references, names)
        if INVALID in gold:
            bad = references[gold.index(INVALID)]
            raise ValueError(
                f"reference {bad!r} is not a {self.config_name} label: references must be one of "
                f"{list(names)} or their ids 0..{len(names) - 1} (test splits have no labels)"
            )
        if self.config_name == "multirc":
            predicted = to_label_ids([p["prediction"] for p in predictions], names)
            questions = [(p["idx"]["paragraph"], p["idx"]["question"]) for p in predictions]
            scores = multirc_f1a_em(predicted, gold, questions)
            return {"exact_match": 100.0 * scores["exact_match"], "f1_a": 100.0 * scores["f1a"]}
        predicted = to_label_ids(predictions, names)
        scores = {"accuracy": 100.0 * accuracy(predicted, gold)}
        if self.config_name == "cb":
            scores["f1"] = 100.0 * macro_f1(predicted, gold, num_classes=len(names))
        return scores
