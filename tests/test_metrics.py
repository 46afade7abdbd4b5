"""Metric functions against hand-computed values."""

import math

import pytest

from hf_ftpipe.metrics import accuracy, multirc_f1a_em, normalize_answer, perplexity, squad_em_f1


def test_accuracy_counts_matches():
    assert accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == 0.75
    assert accuracy(["entailment"], ["entailment"]) == 1.0


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [([0, 1], [0], "`predictions` has 2, `references` has 1"), ([], [], "empty")],
)
def test_accuracy_rejects_bad_lengths(predictions, references, message):
    with pytest.raises(ValueError, match=message):
        accuracy(predictions, references)


def test_multirc_by_hand():
    # Question q1: options (pred, gold) = (1,1) (0,0) (1,0) -> not exact.
    # Question q2: options (1,1) (0,1)                       -> not exact.
    # Question q3: options (0,0)                             -> exact.
    predictions = [1, 0, 1, 1, 0, 0]
    labels = [1, 0, 0, 1, 1, 0]
    question_ids = ["q1", "q1", "q1", "q2", "q2", "q3"]
    scores = multirc_f1a_em(predictions, labels, question_ids)
    # Over all options: TP = 2, predicted positive = 3, gold positive = 3 -> P = R = 2/3, F1 = 2/3.
    assert scores["f1a"] == pytest.approx(2 / 3)
    assert scores["exact_match"] == pytest.approx(1 / 3)


def test_multirc_groups_non_adjacent_options_and_tuple_ids():
    question_ids = [(0, 0), (0, 1), (0, 0), (0, 1)]
    scores = multirc_f1a_em([1, 1, 0, 0], [1, 1, 0, 1], question_ids)
    # (0,0) all correct; (0,1) misses its second option.
    assert scores["exact_match"] == 0.5
    # TP = 2, predicted positive = 2, gold positive = 3 -> P = 1, R = 2/3, F1 = 0.8.
    assert scores["f1a"] == pytest.approx(0.8)


def test_multirc_no_true_positive_scores_zero_f1():
    assert multirc_f1a_em([0, 0], [0, 0], ["q", "q"]) == {"f1a": 0.0, "exact_match": 1.0}


def test_multirc_rejects_non_binary_labels():
    with pytest.raises(ValueError, match=r"`labels` must hold 0 or 1.*\[2\]"):
        multirc_f1a_em([0, 1], [0, 2], ["q", "q"])


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The  Cat!", "cat"),
        ("an apple, a pear and THE plum.", "apple pear and plum"),
        ("theory", "theory"),  # articles only as whole words
        ("  ", ""),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_squad_exact_match_after_normalisation():
    scores = squad_em_f1(["The Cat!"], [["cat", "a dog"]])
    assert scores == {"exact_match": 1.0, "f1": 1.0}


def test_squad_partial_overlap_by_hand():
    # "big red barn" vs "the red barn door" -> tokens [big, red, barn] vs [red, barn, door]:
    # 2 shared, P = 2/3, R = 2/3, F1 = 2/3. Best over golds, averaged with a miss (F1 0).
    scores = squad_em_f1(["big red barn", "Paris"], [["the red barn door", "tractor"], ["London"]])
    assert scores["exact_match"] == 0.0
    assert scores["f1"] == pytest.approx((2 / 3 + 0.0) / 2)


def test_squad_f1_counts_repeated_tokens_once_each():
    # "the cat" normalises to [cat]; [cat, cat, dog] shares one "cat" with it:
    # P = 1/3, R = 1, F1 = 2 * (1/3) / (4/3) = 0.5.
    assert squad_em_f1(["cat cat dog"], [["the cat"]])["f1"] == pytest.approx(0.5)


def test_squad_empty_answers_match_only_empty():
    assert squad_em_f1(["the"], [["a"]]) == {"exact_match": 1.0, "f1": 1.0}
    assert squad_em_f1(["the"], [["cat"]]) == {"exact_match": 0.0, "f1": 0.0}


def test_squad_rejects_string_references():
    with pytest.raises(ValueError, match="pass a list of gold answers"):
        squad_em_f1(["cat"], ["cat"])
    with pytest.raises(ValueError, match=r"`references\[0\]` is empty"):
        squad_em_f1(["cat"], [[]])


def test_perplexity():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(42.0)) == pytest.approx(42.0)
    assert perplexity(1e4) == math.inf
    with pytest.raises(ValueError, match="NaN"):
        perplexity(float("nan"))
