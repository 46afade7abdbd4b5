"""Metrics against values worked out by hand from the official definitions.

The plain functions are the shipped modules' own; the `evaluate` modules are also loaded by path,
offline, and the loader's fallback is checked in a subprocess with the Hub out of reach.
"""

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_ftpipe.metrics import (
    accuracy,
    load_metric,
    macro_f1,
    multirc_f1a_em,
    normalize_answer,
    perplexity,
    rouge_scores,
    shipped_metric_path,
    split_sentences,
    squad_em_f1,
)

REPO = Path(__file__).resolve().parents[2]


# --- plain functions (fractions) ---------------------------------------------------------------


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


def test_cb_macro_f1_by_hand_with_a_class_never_predicted():
    # Classes 0 entailment, 1 contradiction, 2 neutral; -1 is an invalid prediction.
    #   gold: 0 0 0 1 1 2
    #   pred: 0 0 1 1 0 -1
    # class 0: TP 2 (rows 1, 2), FP 1 (row 5), FN 1 (row 3)  -> F1 = 4 / (4 + 1 + 1) = 2/3
    # class 1: TP 1 (row 4),     FP 1 (row 3), FN 1 (row 5)  -> F1 = 2 / (2 + 1 + 1) = 1/2
    # class 2: never predicted,  TP 0,         FN 1 (row 6)  -> F1 = 0
    # macro F1 = (2/3 + 1/2 + 0) / 3 = 7/18
    gold = [0, 0, 0, 1, 1, 2]
    predicted = [0, 0, 1, 1, 0, -1]
    assert macro_f1(predicted, gold, num_classes=3) == pytest.approx(7 / 18)
    assert accuracy(predicted, gold) == pytest.approx(3 / 6)


def test_multirc_by_hand():
    # Question A: options (pred, gold) = (1,1) (0,0) (1,1) -> all right, EM 1.
    # Question B: options (1,1) (1,0)                       -> one wrong, EM 0.
    # EM = (1 + 0) / 2 = 1/2.
    # F1a over all 5 options: TP 3, FP 1 (B's second), FN 0 -> F1 = 6 / (6 + 1 + 0) = 6/7.
    scores = multirc_f1a_em([1, 0, 1, 1, 1], [1, 0, 1, 1, 0], ["A", "A", "A", "B", "B"])
    assert scores == {"f1a": pytest.approx(6 / 7), "exact_match": 0.5}


def test_multirc_groups_non_adjacent_options_and_tuple_ids():
    question_ids = [(0, 0), (0, 1), (0, 0), (0, 1)]
    scores = multirc_f1a_em([1, 1, 0, 0], [1, 1, 0, 1], question_ids)
    # (0,0) all right; (0,1) misses its second option -> EM 1/2.
    # TP 2, FP 0, FN 1 -> F1 = 4 / (4 + 0 + 1) = 0.8.
    assert scores == {"f1a": pytest.approx(0.8), "exact_match": 0.5}


def test_multirc_invalid_prediction_is_forced_wrong():
    # gold 1 1 0 0, pred 1 -1 -1 0: the invalid ones count as the opposite of gold (0, then 1).
    # Forced: 1 0 1 0 -> TP 1, FP 1, FN 1 -> F1 = 2 / (2 + 1 + 1) = 1/2; the question is wrong.
    assert multirc_f1a_em([1, -1, -1, 0], [1, 1, 0, 0], ["q"] * 4) == {"f1a": 0.5, "exact_match": 0.0}


def test_multirc_no_true_positive_scores_zero_f1():
    assert multirc_f1a_em([0, 0], [0, 0], ["q", "q"]) == {"f1a": 0.0, "exact_match": 1.0}


def test_multirc_rejects_non_binary_labels():
    with pytest.raises(ValueError, match=r"`labels` must hold 0 or 1.*\[2\]"):
        multirc_f1a_em([0, 1], [0, 2], ["q", "q"])


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The  Cat!", "cat"),  # lowercase, punctuation, article, spaces
        ("an apple, a pear and THE plum.", "apple pear and plum"),
        ("theory", "theory"),  # articles only as whole words
        ("U.S.-based", "usbased"),  # punctuation is deleted, not turned into spaces
        (" \t a\n ", ""),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_squad_exact_match_after_normalisation_and_max_over_golds():
    # "The Cat!" -> "cat": equal to the first gold, so EM 1 and F1 1 (the max over golds).
    assert squad_em_f1(["The Cat!"], [["cat", "a dog"]]) == {"exact_match": 1.0, "f1": 1.0}
    # Against "a dog" alone it would score 0: the order of the golds does not matter.
    assert squad_em_f1(["The Cat!"], [["a dog", "cat"]]) == {"exact_match": 1.0, "f1": 1.0}


def test_squad_partial_overlap_by_hand():
    # "big red barn" vs "the red barn door" -> [big, red, barn] vs [red, barn, door]: 2 shared,
    # P = R = 2/3, F1 = 2/3; vs "tractor": 0. Best 2/3, averaged with a miss: (2/3 + 0) / 2.
    scores = squad_em_f1(["big red barn", "Paris"], [["the red barn door", "tractor"], ["London"]])
    assert scores["exact_match"] == 0.0
    assert scores["f1"] == pytest.approx((2 / 3 + 0.0) / 2)


def test_squad_f1_counts_repeated_tokens_once_each():
    # "the cat" -> [cat]; [cat, cat, dog] shares one "cat": P = 1/3, R = 1, F1 = 2 (1/3) / (4/3) = 1/2.
    assert squad_em_f1(["cat cat dog"], [["the cat"]])["f1"] == pytest.approx(0.5)


def test_squad_answers_that_normalise_to_nothing_follow_v1_1():
    # evaluate-v1.1: "the" and "a" both normalise to "" -> EM 1; no shared token -> F1 0.
    assert squad_em_f1(["the"], [["a"]]) == {"exact_match": 1.0, "f1": 0.0}


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


# ROUGE by hand (rouge_score's rules: lowercase, punctuation is a word break; F = 2PR / (P + R)).
# 1: "the cat sat on the mat" vs "the cat lay on the mat": 6 tokens each.
#    unigrams shared with multiplicity: the, the, cat, on, mat = 5 -> P = R = 5/6.
#    bigrams: the-cat, on-the, the-mat of 5 -> 3/5. LCS "the cat on the mat" = 5 -> 5/6; one line: Lsum = L.
# 2: two sentences, swapped: "the dog ran.\nthe cat sat." vs "the cat sat.\nthe dog ran."
#    unigrams: all 6 -> 1. bigrams: the-cat, cat-sat, the-dog, dog-ran of 5 (not ran-the / sat-the) -> 4/5.
#    LCS over the whole text: "the cat sat" or "the dog ran" = 3 of 6 -> 1/2.
#    Lsum: each reference sentence finds itself among the predicted ones: 3 + 3 of 6 -> 1.
# 3: "cats running" vs "the cat runs quickly", Porter-stemmed: [cat, run] vs [the, cat, run, quickli].
#    unigrams: 2 -> P = 1, R = 1/2, F = 2/3. bigram cat-run: P = 1, R = 1/3, F = 1/2. LCS 2: 2/3 (L and Lsum).
#    Unstemmed, "cats" and "running" match nothing: all 0.
ROUGE_PAIRS = [
    ("the cat sat on the mat", "the cat lay on the mat"),
    ("the dog ran.\nthe cat sat.", "the cat sat.\nthe dog ran."),
    ("cats running", "the cat runs quickly"),
]
ROUGE_BY_HAND = {
    "rouge1": [5 / 6, 1.0, 2 / 3],
    "rouge2": [3 / 5, 4 / 5, 1 / 2],
    "rougeL": [5 / 6, 1 / 2, 2 / 3],
    "rougeLsum": [5 / 6, 1.0, 2 / 3],
}


def test_rouge_by_hand_per_pair_and_mean():
    predictions, references = zip(*ROUGE_PAIRS)
    per_pair = rouge_scores(predictions, references, use_aggregator=False, use_stemmer=True)
    assert per_pair.keys() == ROUGE_BY_HAND.keys()
    for name, values in ROUGE_BY_HAND.items():
        assert per_pair[name] == pytest.approx(values), name
    mean = rouge_scores(predictions, references, use_stemmer=True)
    assert mean == {name: pytest.approx(sum(values) / 3) for name, values in ROUGE_BY_HAND.items()}
    # the exact mean: rouge1 (5/6 + 1 + 2/3) / 3 = 5/6, rougeL (5/6 + 1/2 + 2/3) / 3 = 2/3
    assert (mean["rouge1"], mean["rougeL"]) == (pytest.approx(5 / 6), pytest.approx(2 / 3))
    unstemmed = rouge_scores(predictions[2:], references[2:], use_aggregator=False)
    assert unstemmed == {name: [0.0] for name in ROUGE_BY_HAND}


def test_rouge_takes_the_best_of_several_references_and_a_type_list():
    # pair 1 against a miss and its own reference: the reference that scores best counts, per type
    scores = rouge_scores(
        ["the cat sat on the mat"], [["a dog barked", "the cat lay on the mat"]], ["rouge2", "rougeL"]
    )
    assert scores == {"rouge2": pytest.approx(3 / 5), "rougeL": pytest.approx(5 / 6)}


def test_rouge_rejects_bad_inputs():
    with pytest.raises(ValueError, match="`predictions` has 2, `references` has 1"):
        rouge_scores(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"`references\[0\]` is an empty list"):
        rouge_scores(["a"], [[]])


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        (
            "Anna opened a bakery. It sells bread!  Is it good? Yes",
            ["Anna opened a bakery.", "It sells bread!", "Is it good?", "Yes"],
        ),
        ('He said "stop." Then (quietly.) he left...  ', ['He said "stop."', "Then (quietly.)", "he left..."]),
        ("3.5 percent, no break inside numbers.", ["3.5 percent, no break inside numbers."]),
        ("Dr. Smith came.", ["Dr.", "Smith came."]),  # punkt would keep "Dr. Smith" together
        ("one\ntwo", ["one\ntwo"]),  # a line break alone ends no sentence
        ("  ", []),
    ],
)
def test_split_sentences(text, sentences):
    assert split_sentences(text) == sentences


# --- the shipped evaluate modules, loaded by path (offline) ------------------------------------


@pytest.fixture(scope="module")
def evaluate():
    return pytest.importorskip("evaluate")


@pytest.mark.parametrize(
    ("task", "predictions", "references"),
    [
        # 3 of 4 right; "maybe" is no label, so it is wrong. accuracy = 3/4 -> 75.
        ("boolq", ["True", "False", "maybe", "True"], ["True", "False", "False", "True"]),
        ("copa", ["choice1", "choice2", "choice3", "choice1"], ["choice1", "choice2", "choice1", "choice1"]),
        (
            "rte",
            ["entailment", "not_entailment", "", "entailment"],
            ["entailment", "not_entailment", "entailment", "entailment"],
        ),
        ("wic", ["False", "True", "true", "True"], ["False", "True", "True", "True"]),  # case matters
    ],
)
def test_t5_super_glue_accuracy_tasks(evaluate, task, predictions, references):
    metric = evaluate.load(str(shipped_metric_path("t5_super_glue")), task)
    assert metric.compute(predictions=predictions, references=references) == {"accuracy": 75.0}


def test_t5_super_glue_cb_by_hand_names_and_ids(evaluate):
    # The macro-F1 case above, as T5 text: F1 = 7/18 -> 38.88...; accuracy 3/6 -> 50.
    metric = evaluate.load(str(shipped_metric_path("t5_super_glue")), "cb")
    gold = ["entailment", "entailment", "entailment", "contradiction", "contradiction", "neutral"]
    predicted = ["entailment", "entailment", "contradiction", "contradiction", "entailment", "neither"]
    expected = {"accuracy": 50.0, "f1": pytest.approx(100 * 7 / 18)}
    assert metric.compute(predictions=predicted, references=gold) == expected
    # The Hub's super_glue inputs (label ids; -1 for no label) give the same scores.
    assert metric.compute(predictions=[0, 0, 1, 1, 0, -1], references=[0, 0, 0, 1, 1, 2]) == expected


def test_t5_super_glue_multirc_groups_by_paragraph_and_question(evaluate):
    # Paragraph 0 question 0: options True/True, False/False  -> all right.
    # Paragraph 1 question 0: options True/True, True/False   -> one wrong (same question index,
    #   other paragraph: a separate question). EM = 1/2 -> 50.
    # F1a: TP 2, FP 1, FN 0 -> 4 / (4 + 1) = 0.8 -> 80.
    metric = evaluate.load(str(shipped_metric_path("t5_super_glue")), "multirc")
    options = [(0, 0, "True", "True"), (1, 0, "True", "True"), (0, 0, "False", "False"), (1, 0, "True", "False")]
    predictions = [
        {"idx": {"paragraph": p, "question": q, "answer": a}, "prediction": pred}
        for a, (p, q, pred, _) in enumerate(options)
    ]
    references = [gold for *_, gold in options]
    expected = {"exact_match": 50.0, "f1_a": pytest.approx(80.0)}
    assert metric.compute(predictions=predictions, references=references) == expected
    # The Hub's super_glue inputs: label ids (False 0, True 1) give the same scores.
    for prediction in predictions:
        prediction["prediction"] = int(prediction["prediction"] == "True")
    assert metric.compute(predictions=predictions, references=[int(r == "True") for r in references]) == expected


def test_t5_super_glue_rejects_unknown_task_and_unlabelled_references(evaluate):
    path = str(shipped_metric_path("t5_super_glue"))
    with pytest.raises(ValueError, match=r"unknown t5_super_glue task 'record'.*'boolq'"):
        evaluate.load(path, "record")
    with pytest.raises(ValueError, match="reference -1 is not a rte label"):
        evaluate.load(path, "rte").compute(predictions=[0], references=[-1])


def test_squad_v1_takes_the_hub_squad_inputs(evaluate):
    # q1: "The Cat!" equals gold "cat" after normalisation -> EM 1, F1 1 (max over golds).
    # q2: "big red barn" vs "the red barn door" -> EM 0, F1 2/3.
    # EM = 100 * (1 + 0) / 2 = 50; F1 = 100 * (1 + 2/3) / 2 = 100 * 5/6. Matched by id, not order.
    squad = evaluate.load(str(shipped_metric_path("squad_v1")))
    predictions = [{"id": "q2", "prediction_text": "big red barn"}, {"id": "q1", "prediction_text": "The Cat!"}]
    references = [
        {"id": "q1", "answers": {"text": ["a dog", "cat"], "answer_start": [0, 7]}},
        {"id": "q2", "answers": {"text": ["the red barn door"], "answer_start": [3]}},
    ]
    scores = squad.compute(predictions=predictions, references=references)
    assert scores == {"exact_match": 50.0, "f1": pytest.approx(100 * 5 / 6)}


def test_rouge_mean_takes_the_hub_rouge_inputs(evaluate):
    rouge = evaluate.load(str(shipped_metric_path("rouge_mean")))
    predictions, references = zip(*ROUGE_PAIRS)
    scores = rouge.compute(predictions=list(predictions), references=list(references), use_stemmer=True)
    assert scores == {name: pytest.approx(sum(values) / 3) for name, values in ROUGE_BY_HAND.items()}
    # one list of references per prediction, a custom tokenizer, per-pair values
    scores = rouge.compute(
        predictions=["The CAT"],
        references=[["dog", "cat the"]],
        rouge_types=["rouge1", "rougeL"],
        use_aggregator=False,
        tokenizer=str.split,  # case kept: "The" and "CAT" match nothing in "cat the"
    )
    assert scores == {"rouge1": [0.0], "rougeL": [0.0]}


# --- the loader ---------------------------------------------------------------------------------


def test_load_metric_prefers_the_official_module(evaluate, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(evaluate, "load", lambda path, config_name=None, **kw: calls.append(path) or "official")
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.metrics"):
        assert load_metric("super_glue", "rte") == "official"
    assert calls == ["super_glue"]
    assert not caplog.records


def test_load_metric_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown metric 'glue'.*'squad'"):
        load_metric("glue")


def test_load_metric_falls_back_offline(tmp_path):
    # A fresh process: evaluate reads HF_EVALUATE_OFFLINE and its caches at import. HF_HOME points
    # to an empty folder so no cached copy of the official modules can be found.
    script = (
        "from hf_ftpipe.metrics import load_metric\n"
        "squad = load_metric('squad')\n"
        "print(squad.compute(predictions=[{'id': 'q', 'prediction_text': 'the cat'}],"
        " references=[{'id': 'q', 'answers': {'text': ['Cat.'], 'answer_start': [0]}}]))\n"
        "print(load_metric('rouge').compute(predictions=['the cat sat'], references=['the cat ran']))\n"
        "try:\n"
        "    load_metric('super_glue', 'cb')\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HOME": str(tmp_path),
        "HF_EVALUATE_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "{'exact_match': 100.0, 'f1': 100.0}"
    # "the cat sat" vs "the cat ran": unigrams 2 of 3, bigram the-cat 1 of 2, LCS 2 of 3
    assert lines[1] == str({"rouge1": 2 / 3, "rouge2": 0.5, "rougeL": 2 / 3, "rougeLsum": 2 / 3})
    # super_glue has no drop-in on its scale: a clear error names the shipped module instead.
    assert lines[2].startswith("HubError evaluate could not load the official 'super_glue' ("), lines[1]
    assert lines[2].endswith(
        "offline, use load_metric('t5_super_glue', 'cb'): the same inputs, scored ×100 as T5 reports them "
        "(the official module gives fractions)"
    ), lines[2]
    warnings = [line for line in result.stderr.splitlines() if "hf_ftpipe's shipped" in line]
    assert len(warnings) == 2, result.stderr
    assert "could not load 'squad'" in warnings[0] and "'squad_v1'" in warnings[0]
    assert "could not load 'rouge'" in warnings[1] and "'rouge_mean'" in warnings[1]
