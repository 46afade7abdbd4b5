"""Task metrics as plain functions: no network, no ``evaluate.load`` (its metric scripts live on the Hub).

Definitions follow the benchmarks' own papers: SuperGLUE (Wang et al., 2019) for RTE/BoolQ/WiC
accuracy and MultiRC F1a/EM, SQuAD (Rajpurkar et al., 2016) for answer EM/F1. Every score is a
fraction in ``[0, 1]``, not a percentage; multiply by 100 to compare with leaderboards.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Hashable, Sequence

__all__ = [
    "accuracy",
    "multirc_f1a_em",
    "normalize_answer",
    "perplexity",
    "squad_em_f1",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def _check_same_length(**sequences: Sequence[object]) -> int:
    lengths = {name: len(values) for name, values in sequences.items()}
    if len(set(lengths.values())) != 1:
        shown = ", ".join(f"`{name}` has {n}" for name, n in lengths.items())
        raise ValueError(f"metric inputs must have one entry per example, but {shown}")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError(f"metric inputs are empty ({', '.join(lengths)}): nothing to score")
    return n


def accuracy(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    """Fraction of predictions equal to their reference (RTE, BoolQ, WiC, CB, COPA).

    Args:
        predictions (`Sequence[Hashable]`):
            Predicted labels, e.g. class ids or label strings.
        references (`Sequence[Hashable]`):
            Gold labels, in the same order and of the same length.

    Returns:
        `float`: ``correct / total`` in ``[0, 1]``.
    """
    n = _check_same_length(predictions=predictions, references=references)
    return sum(p == r for p, r in zip(predictions, references)) / n


def _binary_f1(predictions: Sequence[int], labels: Sequence[int]) -> float:
    true_pos = sum(1 for p, y in zip(predictions, labels) if p == 1 and y == 1)
    pred_pos = sum(1 for p in predictions if p == 1)
    gold_pos = sum(1 for y in labels if y == 1)
    if true_pos == 0:
        # Same convention as scikit-learn's zero_division=0: no true positive scores 0.
        return 0.0
    precision = true_pos / pred_pos
    recall = true_pos / gold_pos
    return 2 * precision * recall / (precision + recall)


def multirc_f1a_em(
    predictions: Sequence[int],
    labels: Sequence[int],
    question_ids: Sequence[Hashable],
) -> dict[str, float]:
    """MultiRC's two scores: F1 over all answer options (F1a) and exact match per question (EM).

    MultiRC labels every candidate answer of a question as true (1) or false (0). SuperGLUE
    reports F1a, the binary F1 of the positive class over every answer option of the split, and
    EM, the fraction of questions whose options are *all* predicted correctly.

    Args:
        predictions (`Sequence[int]`):
            Per answer option, 1 if predicted correct, else 0.
        labels (`Sequence[int]`):
            Per answer option, the gold 0/1 label.
        question_ids (`Sequence[Hashable]`):
            Per answer option, the id of its question, e.g. ``(paragraph, question)`` from the
            dataset's ``idx`` column. Options of one question need not be adjacent.

    Returns:
        `dict[str, float]`: ``{"f1a": ..., "exact_match": ...}``, both in ``[0, 1]``. F1a is 0
        when no option is both predicted and labelled true.
    """
    _check_same_length(predictions=predictions, labels=labels, question_ids=question_ids)
    for name, values in (("predictions", predictions), ("labels", labels)):
        bad = sorted({v for v in values if v not in (0, 1)}, key=repr)
        if bad:
            raise ValueError(f"`{name}` must hold 0 or 1 per answer option, found {bad[:5]}")
    all_correct: dict[Hashable, bool] = {}
    for p, y, q in zip(predictions, labels, question_ids):
        all_correct[q] = all_correct.get(q, True) and p == y
    return {
        "f1a": _binary_f1(predictions, labels),
        "exact_match": sum(all_correct.values()) / len(all_correct),
    }


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, drop punctuation and articles, squeeze spaces.

    >>> normalize_answer("The  Cat!")
    'cat'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _token_f1(prediction: str, reference: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    ref_tokens = normalize_answer(reference).split()
    if not pred_tokens or not ref_tokens:
        # An empty answer matches only an empty answer (SQuAD 2.0's rule; 1.1 always scored 0).
        return float(pred_tokens == ref_tokens)
    num_same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_em_f1(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """SQuAD exact match and token F1, each the best over a question's gold answers, averaged.

    Both compare answers after :func:`normalize_answer`. F1 counts shared tokens (with
    multiplicity) between prediction and gold answer.

    Args:
        predictions (`Sequence[str]`):
            One predicted answer string per question.
        references (`Sequence[Sequence[str]]`):
            Per question, the non-empty list of acceptable gold answers
            (the dataset's ``answers["text"]``).

    Returns:
        `dict[str, float]`: ``{"exact_match": ..., "f1": ...}``, both in ``[0, 1]``.
    """
    n = _check_same_length(predictions=predictions, references=references)
    for i, (_, golds) in enumerate(zip(predictions, references)):
        if isinstance(golds, str):
            raise ValueError(
                f"`references[{i}]` is the string {golds!r}; pass a list of gold answers, e.g. [{golds!r}]"
            )
        if not golds:
            raise ValueError(f"`references[{i}]` is empty: every question needs at least one gold answer")
    exact = 0.0
    f1 = 0.0
    for prediction, golds in zip(predictions, references):
        normalized = normalize_answer(prediction)
        exact += max(float(normalized == normalize_answer(g)) for g in golds)
        f1 += max(_token_f1(prediction, g) for g in golds)
    return {"exact_match": exact / n, "f1": f1 / n}


def perplexity(mean_loss: float) -> float:
    """Perplexity ``exp(mean_loss)`` of a language model, from its mean token cross-entropy in nats.

    Returns ``inf`` where the exponential overflows a float (losses above ~709).
    """
    if math.isnan(mean_loss):
        raise ValueError("`mean_loss` is NaN: the evaluation loss diverged, perplexity is undefined")
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf
