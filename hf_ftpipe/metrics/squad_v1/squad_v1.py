"""SQuAD v1.1 exact match and F1, as the official evaluate-v1.1 script defines them.

A drop-in for the ``squad`` module on the Hub (same inputs, same outputs) that loads offline:

    >>> import evaluate
    >>> squad = evaluate.load("path/to/squad_v1")
    >>> squad.compute(
    ...     predictions=[{"id": "q1", "prediction_text": "The Cat!"}],
    ...     references=[{"id": "q1", "answers": {"text": ["cat"], "answer_start": [0]}}],
    ... )
    {'exact_match': 100.0, 'f1': 100.0}

Rules (Rajpurkar et al., 2016; evaluate-v1.1.py): both answers are normalised (lowercase, strip
punctuation, drop the articles a/an/the, collapse whitespace); EM is equality of the normalised
strings; F1 is the F1 of the shared tokens, counted with multiplicity, and 0 when no token is
shared (even when both answers normalise to nothing); each question takes its best score over its
gold answers; the scores are means over questions, times 100. A question without a prediction
scores 0.

Self-contained on purpose (only the standard library, ``datasets`` and ``evaluate``), so the
folder can be pushed to the Hub as it is. One import per line: evaluate's import scanner misreads
``import a, b``.
"""

import re
import string
from collections import Counter
from collections.abc import Sequence

import datasets
import evaluate

_CITATION = """\
@inproceedings{rajpurkar-etal-2016-squad,
    title = "{SQ}u{AD}: 100,000+ Questions for Machine Comprehension of Text",
    author = "Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy",
    booktitle = "Proceedings of EMNLP 2016",
    year = "2016",
    pages = "2383--2392",
}
"""

_DESCRIPTION = """\
SQuAD v1.1 exact match and token F1 (the official evaluate-v1.1 definition), times 100. Same
inputs and outputs as the `squad` module on the Hub, but self-contained so it loads offline.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of `{"id": str, "prediction_text": str}`, one per answered question.
    references: list of `{"id": str, "answers": {"text": list[str], "answer_start": list[int]}}`,
        one per question; every question needs at least one gold answer.
Returns:
    exact_match: mean over questions of the best exact match over gold answers, times 100.
    f1: mean over questions of the best token F1 over gold answers, times 100.
Examples:
    >>> squad = evaluate.load("path/to/squad_v1")
    >>> squad.compute(
    ...     predictions=[{"id": "q1", "prediction_text": "big red barn"}],
    ...     references=[{"id": "q1", "answers": {"text": ["the red barn door"], "answer_start": [0]}}],
    ... )
    {'exact_match': 0.0, 'f1': 66.66666666666666}
"""

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, drop punctuation and articles, collapse spaces.

    >>> normalize_answer("The  Cat!")
    'cat'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    """1.0 if the two answers are equal after :func:`normalize_answer`, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of two answers after :func:`normalize_answer`; 0.0 when they share no token."""
    prediction_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    num_same = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        # evaluate-v1.1 scores 0 here, even when both answers normalise to nothing ("the" vs "a").
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_em_f1(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """SQuAD exact match and token F1, each the best over a question's gold answers, averaged.

    Args:
        predictions (`Sequence[str]`):
            One predicted answer string per question.
        references (`Sequence[Sequence[str]]`):
            Per question, the non-empty list of acceptable gold answers (``answers["text"]``).

    Returns:
        `dict[str, float]`: ``{"exact_match": ..., "f1": ...}``, fractions in ``[0, 1]``.
    """
    if len(predictions) != len(references):
        raise ValueError(
            f"metric inputs must have one entry per question, but `predictions` has {len(predictions)}, "
            f"`references` has {len(references)}"
        )
    if not references:
        raise ValueError("metric inputs are empty (predictions, references): nothing to score")
    for i, golds in enumerate(references):
        if isinstance(golds, str):
            raise ValueError(
                f"`references[{i}]` is the string {golds!r}; pass a list of gold answers, e.g. [{golds!r}]"
            )
        if len(golds) == 0:
            raise ValueError(f"`references[{i}]` is empty: every question needs at least one gold answer")
    exact = sum(max(exact_match_score(p, g) for g in golds) for p, golds in zip(predictions, references))
    f1 = sum(max(f1_score(p, g) for g in golds) for p, golds in zip(predictions, references))
    return {"exact_match": exact / len(references), "f1": f1 / len(references)}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SquadV1(evaluate.Metric):
    """SQuAD v1.1 EM/F1 in the Hub `squad` module's input format."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                    "references": {
                        "id": datasets.Value("string"),
                        "answers": datasets.Sequence(
                            {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
                        ),
                    },
                }
            ),
            codebase_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
            reference_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
        )

    def _compute(self, predictions: list[dict], references: list[dict]) -> dict[str, float]:
        by_id = {p["id"]: p["prediction_text"] for p in predictions}
        unknown = sorted(set(by_id) - {r["id"] for r in references})
        if unknown:
            raise ValueError(f"predictions for question ids absent from `references`: {unknown[:5]}")
        # As in evaluate-v1.1, a question without a prediction still counts, with score 0: the
        # mean over answered questions is scaled by their share.
        answered = [r for r in references if r["id"] in by_id]
        if not answered:
            return {"exact_match": 0.0, "f1": 0.0}
        scores = squad_em_f1([by_id[r["id"]] for r in answered], [r["answers"]["text"] for r in answered])
        share = len(answered) / len(references)
        return {name: 100.0 * value * share for name, value in scores.items()}
