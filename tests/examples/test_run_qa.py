"""examples/run_qa_pipe.py and its qa_features.py: windows and answer positions, post-processing on hand-made
logits, one real launch."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from datasets import Dataset

from hf_ftpipe.metrics import load_metric

from distributed import accelerate_launch
from doc_blocks import cpu_launch_arguments
from example_modules import DATA, EXAMPLES, load_example, regenerate_fixtures


@pytest.fixture(scope="module")
def qa() -> ModuleType:
    return load_example("qa_features")


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"squad_{split}.jsonl").read_text(encoding="utf-8").splitlines()]


# --- post-processing -----------------------------------------------------------------------------

CONTEXT = "Anna lives in Paris. Ben works as a baker in Rome."
#          0    5     11 14    20  25    31 34 36    42 45
QUESTION_TOKENS = [None] * 4  # [CLS] where does [SEP]: outside the context, so their offsets are blank


def _feature(example_id: str, context_offsets: list[tuple[int, int]]) -> dict:
    return {"example_id": example_id, "offset_mapping": QUESTION_TOKENS + context_offsets + [None]}


def _logits(length: int, peaks: dict[int, float]) -> np.ndarray:
    row = np.zeros(length, dtype=np.float32)
    for index, value in peaks.items():
        row[index] = value
    return row


def _post_process(qa, features: list[dict], starts: list[dict], ends: list[dict], **kwargs) -> dict[str, str]:
    length = len(features[0]["offset_mapping"])
    examples = Dataset.from_list([{"id": "a", "context": CONTEXT}])
    return qa.postprocess_predictions(
        examples,
        Dataset.from_list(features),
        np.stack([_logits(length, peaks) for peaks in starts]),
        np.stack([_logits(length, peaks) for peaks in ends]),
        **kwargs,
    )


# two windows of the context: "anna lives in paris ." and "paris . ben works as a baker", overlapping
# (token indices 4 to 8 and 4 to 9, after [CLS] where does [SEP]; None for the closing [SEP])
FIRST = [(0, 4), (5, 10), (11, 13), (14, 19), (19, 20)]
SECOND = [(14, 19), (19, 20), (21, 24), (25, 30), (31, 33), (34, 35)]


def test_best_span_of_the_second_window_maps_back_to_the_context_text(qa):
    features = [_feature("a", FIRST), _feature("a", SECOND)]
    # window 2: start at "ben" (index 6), end at "works" (index 7); window 1 is less sure of "paris"
    answers = _post_process(qa, features, starts=[{7: 2.0}, {6: 5.0}], ends=[{7: 2.0}, {7: 5.0}])
    assert answers == {"a": "Ben works"}


def test_best_across_windows_wins(qa):
    features = [_feature("a", FIRST), _feature("a", SECOND)]
    answers = _post_process(qa, features, starts=[{7: 9.0}, {6: 5.0}], ends=[{7: 9.0}, {7: 5.0}])
    assert answers == {"a": "Paris"}


def test_spans_outside_the_context_reversed_or_too_long_are_skipped(qa):
    features = [_feature("a", FIRST)]
    # the best pairs: in the question (1, 2), then reversed ("." -> "paris", 8 -> 7), then 4 tokens
    # (anna -> paris, 4 -> 7), too long for max_answer_length 3; the next is "lives in paris" (5 -> 7)
    starts = [{1: 50.0, 8: 40.0, 4: 30.0, 5: 5.0}]
    ends = [{2: 50.0, 7: 40.0, 6: 5.0}]
    assert _post_process(qa, features, starts, ends, n_best_size=4, max_answer_length=3) == {"a": "lives in Paris"}
    # with room for 4 tokens the long span wins
    assert _post_process(qa, features, starts, ends, n_best_size=4, max_answer_length=4) == {"a": "Anna lives in Paris"}


def test_padding_tokens_are_never_an_answer(qa):
    features = [_feature("a", FIRST + [None, None])]  # [SEP] [PAD] [PAD]: blank offsets
    answers = _post_process(qa, features, starts=[{10: 99.0, 4: 1.0}], ends=[{11: 99.0, 5: 1.0}])
    assert answers == {"a": "Anna lives"}


def test_an_example_without_any_valid_span_gets_an_empty_answer(qa):
    features = [{"example_id": "a", "offset_mapping": [None, None, None]}]
    assert _post_process(qa, features, starts=[{}], ends=[{}]) == {"a": ""}


# --- features ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    texts = [text for row in _rows("train") for text in (row["question"], row["context"])]
    return load_example("local_tokenizer").build_bert_tokenizer(texts, vocab_size=512)


def _one_example(context: str, answer: str, question: str = "  Where does Anna live?") -> dict[str, list]:
    start = context.index(answer)
    return {
        "id": ["x"],
        "question": [question],
        "context": [context],
        "answers": [{"text": [answer], "answer_start": [start]}],
    }


def test_windows_overlap_by_the_stride_and_mark_the_answer_or_cls(qa, tokenizer):
    context = " ".join(f"{name} lives in {city}." for name, city in zip("ABCDEFGHIJ", ["Oslo"] * 9 + ["Rome"]))
    batch = _one_example(context, "Rome")
    features = qa.prepare_features(batch, tokenizer, max_seq_length=24, doc_stride=8, keep_offsets=True)
    windows = len(features["input_ids"])
    assert windows > 2
    question_ids = tokenizer("Where does Anna live?")["input_ids"][:-1]  # [CLS] question, leading spaces gone
    for index in range(windows):
        ids = features["input_ids"][index]
        assert len(ids) == 24 or index == windows - 1  # unpadded: only the last window may be shorter
        assert len(ids) <= 24 and ids[: len(question_ids)] == question_ids
        offsets = features["offset_mapping"][index]
        # offsets are kept exactly for the tokens between the first [SEP] and the last one
        separators = [i for i, token in enumerate(ids) if token == tokenizer.sep_token_id]
        context_tokens = [i for i, pair in enumerate(offsets) if pair is not None]
        assert context_tokens == list(range(separators[0] + 1, separators[-1]))
        if index + 1 < windows:  # the next window starts doc_stride tokens before this one ends
            following = [i for i, pair in enumerate(features["offset_mapping"][index + 1]) if pair is not None]
            overlap = features["input_ids"][index + 1][following[0] : following[0] + 8]
            assert ids[context_tokens[-8] : context_tokens[-1] + 1] == overlap
    assert features["example_id"] == ["x"] * windows
    # "Rome" ends the context: only the last window holds it; the others point at [CLS] (index 0)
    positions = list(zip(features["start_positions"], features["end_positions"]))
    assert positions[:-1] == [(0, 0)] * (windows - 1)
    start, end = positions[-1]
    offsets = features["offset_mapping"][-1]
    assert context[offsets[start][0] : offsets[end][1]] == "Rome"
    # --pad_to_max_length: the same features, each padded to 24 tokens (blank offsets on the padding)
    padded = qa.prepare_features(
        batch, tokenizer, max_seq_length=24, doc_stride=8, keep_offsets=True, pad_to_max_length=True
    )
    assert len(features["input_ids"][-1]) < 24
    for name in ("input_ids", "offset_mapping", "start_positions", "end_positions"):
        for mine, theirs in zip(features[name], padded[name], strict=True):
            if isinstance(mine, list):
                assert len(theirs) == 24 and theirs[: len(mine)] == mine
                assert set(theirs[len(mine) :]) <= {tokenizer.pad_token_id, None}
            else:
                assert mine == theirs


def test_an_answer_cut_by_the_window_edge_points_at_cls(qa, tokenizer):
    context = "Anna lives in the old town of Lisbon near the river. " * 2
    batch = _one_example(context, "old town of Lisbon near the river")
    features = qa.prepare_features(batch, tokenizer, max_seq_length=16, doc_stride=4, keep_offsets=False)
    assert "offset_mapping" not in features and "example_id" not in features
    for index, (start, end) in enumerate(zip(features["start_positions"], features["end_positions"])):
        ids = features["input_ids"][index]
        assert (start, end) == (0, 0) or tokenizer.decode(ids[start : end + 1]) == "old town of lisbon near the river"
    assert (0, 0) in zip(features["start_positions"], features["end_positions"])


def test_answer_positions_take_whole_tokens(qa):
    offsets = [(0, 0), (0, 4), (5, 10), (11, 13), (14, 19), (0, 0)]
    sequence_ids = [None, 1, 1, 1, 1, None]
    assert qa.answer_positions(offsets, sequence_ids, 5, 13) == (2, 3)
    assert qa.answer_positions(offsets, sequence_ids, 6, 12) == (2, 3)  # inside tokens: the tokens around
    assert qa.answer_positions(offsets, sequence_ids, 14, 25) is None  # runs past the window


# --- the fixture ---------------------------------------------------------------------------------


def test_fixture_has_the_hub_layout_and_long_contexts(tokenizer):
    for split, size in (("train", 96), ("validation", 32)):
        rows = _rows(split)
        assert len(rows) == size and len({row["id"] for row in rows}) == size
        for row in rows:
            assert list(row) == ["id", "title", "context", "question", "answers"]
            assert list(row["answers"]) == ["text", "answer_start"]
            for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"]):
                assert row["context"][start : start + len(text)] == text
        # at the tiny default (64 tokens) some contexts need several windows
        assert any(len(tokenizer(row["context"])["input_ids"]) > 64 for row in rows)


def test_make_squad_regenerates_the_shipped_files(tmp_path):
    regenerate_fixtures("make_squad.py", tmp_path)
    for split in ("train", "validation"):
        name = f"squad_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: rerun make_squad.py"


# --- one launch ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train a tiny BERT for 6 steps on 2 processes, evaluate and predict on the validation fixture: the
    arguments of docs/examples.md's CPU command, then this test's, which shorten it and add Trainer's
    gradient accumulation and label smoothing."""
    output_dir = tmp_path_factory.mktemp("qa")
    start = time.monotonic()
    accelerate_launch(
        str(EXAMPLES / "run_qa_pipe.py"),
        *cpu_launch_arguments("docs/examples.md", "run_qa_pipe.py"),
        *("--output_dir", str(output_dir)),
        *("--max_steps", "6", "--save_strategy", "no", "--per_device_eval_batch_size", "12"),
        *("--gradient_accumulation_steps", "2", "--label_smoothing_factor", "0.1"),  # Trainer's loss options
        timeout_s=240,
        env={"HF_HUB_OFFLINE": "1"},  # the shipped squad_v1, without waiting for the Hub
    )
    print(f"run_qa_pipe.py launch: {time.monotonic() - start:.1f} s")
    return output_dir


def test_reported_scores_are_the_official_metric_of_the_written_answers(run):
    answers = json.loads((run / "predict_predictions.json").read_text(encoding="utf-8"))
    rows = _rows("validation")
    assert sorted(answers) == sorted(row["id"] for row in rows)  # every example answered
    contexts = {row["id"]: row["context"] for row in rows}
    assert all(text in contexts[id_] for id_, text in answers.items())
    expected = load_metric("squad_v1").compute(
        predictions=[{"id": id_, "prediction_text": text} for id_, text in answers.items()],
        references=[{"id": row["id"], "answers": row["answers"]} for row in rows],
    )
    evaluation = json.loads((run / "eval_results.json").read_text())
    prediction = json.loads((run / "predict_results.json").read_text())
    assert evaluation["eval_samples"] == prediction["predict_samples"] == len(rows)
    for prefix, results in (("eval", evaluation), ("predict", prediction)):
        assert results[f"{prefix}_exact_match"] == pytest.approx(expected["exact_match"])
        assert results[f"{prefix}_f1"] == pytest.approx(expected["f1"])
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 6
