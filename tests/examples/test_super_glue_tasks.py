"""The SuperGLUE task registry (T5 formats, labels, tokenization) and the shipped fixtures."""

import json
from pathlib import Path
from types import ModuleType

import pytest

from example_modules import load_example, regenerate_fixtures

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = EXAMPLES / "data"

# The Hub's columns, in the Hub's order (aps/super_glue; nyu-mll/glue for glue_rte).
HUB_COLUMNS = {
    "boolq": ["question", "passage", "idx", "label"],
    "cb": ["premise", "hypothesis", "idx", "label"],
    "copa": ["premise", "choice1", "choice2", "question", "idx", "label"],
    "multirc": ["paragraph", "question", "answer", "idx", "label"],
    "rte": ["premise", "hypothesis", "idx", "label"],
    "glue_rte": ["sentence1", "sentence2", "label", "idx"],
    "wic": ["word", "sentence1", "sentence2", "start1", "start2", "end1", "end2", "idx", "label"],
}


@pytest.fixture(scope="module")
def tasks() -> ModuleType:
    return load_example("super_glue_tasks")


@pytest.fixture(scope="module")
def tok():
    texts = ["anna sold the car", "not_entailment", "entailment", "False", "True", "rte hypothesis: premise:"]
    return load_example("local_tokenizer").build_t5_tokenizer(texts, vocab_size=128)


# One hand-written example per task and the exact T5 input string it must give.
FORMATS = [
    (
        "boolq",
        {"question": "is the sky blue", "passage": "The sky is  Blue.", "idx": 0, "label": 1},
        "boolq passage: The sky is  Blue. question: is the sky blue",
        "True",
    ),
    (
        "cb",
        {"premise": "Ann said it rained.", "hypothesis": "It rained.", "idx": 3, "label": 2},
        "cb hypothesis: It rained. premise: Ann said it rained.",
        "neutral",
    ),
    (
        "copa",
        {"premise": "The glass fell.", "choice1": "It broke.", "choice2": "It sang.", "question": "effect", "label": 0},
        "copa choice1: It broke. choice2: It sang. premise: The glass fell. question: effect",
        "choice1",
    ),
    (
        "multirc",
        {
            "paragraph": "<b>Sent 1: </b>Ann ran.<br><b>Sent 2: </b>Bo sat.<br>",
            "question": "Who <b>ran</b>?",
            "answer": "Ann",
            "idx": {"paragraph": 0, "question": 0, "answer": 0},
            "label": 0,
        },
        "multirc question: Who ran? answer: Ann paragraph: Sent 1: Ann ran. Sent 2: Bo sat. ",
        "False",
    ),
    (
        "rte",
        {"premise": "Ann sold the car.", "hypothesis": "Ann sold it.", "idx": 0, "label": 1},
        "rte hypothesis: Ann sold it. premise: Ann sold the car.",
        "not_entailment",
    ),
    (
        "glue_rte",
        {"sentence1": "Ann sold the car.", "sentence2": "Ann sold it.", "label": 0, "idx": 0},
        "rte sentence1: Ann sold the car. sentence2: Ann sold it.",
        "entailment",
    ),
    (
        "wic",
        {
            "word": "bank",
            "sentence1": "The River bank.",
            "sentence2": "The bank lent money.",
            "start1": 10,
            "start2": 4,
            "end1": 14,
            "end2": 8,
            "idx": 0,
            "label": 0,
        },
        "wic sentence1: The River bank. sentence2: The bank lent money. word: bank",
        "False",
    ),
]


@pytest.mark.parametrize("name, example, source, target", FORMATS, ids=[f[0] for f in FORMATS])
def test_formats_are_t5s(tasks, name, example, source, target):
    task = tasks.get_task(name)
    assert task.format_input(example) == source
    assert task.format_target(example) == target


def test_label_names_and_defaults(tasks):
    table = {name: (t.label_names, t.max_source_length, t.max_target_length) for name, t in tasks.TASKS.items()}
    assert table == {
        "boolq": (("False", "True"), 512, 4),
        "cb": (("entailment", "contradiction", "neutral"), 256, 8),
        "copa": (("choice1", "choice2"), 64, 8),
        "multirc": (("False", "True"), 512, 4),
        "rte": (("entailment", "not_entailment"), 320, 8),
        "glue_rte": (("entailment", "not_entailment"), 320, 8),
        "wic": (("False", "True"), 64, 4),
    }
    for name, task in tasks.TASKS.items():
        assert task.metric_config == ("rte" if name == "glue_rte" else name)
        hub = ("nyu-mll/glue", "rte") if name == "glue_rte" else ("aps/super_glue", name)
        assert (task.dataset_name, task.dataset_config_name) == hub
        assert set(task.columns) <= set(HUB_COLUMNS[name])


def test_rte_layout_is_read_from_the_columns(tasks):
    assert tasks.get_task("rte", HUB_COLUMNS["rte"]).name == "rte"
    assert tasks.get_task("rte", HUB_COLUMNS["glue_rte"]).name == "glue_rte"
    assert tasks.get_task("glue_rte", HUB_COLUMNS["glue_rte"]).name == "glue_rte"


def test_unknown_task_lists_the_valid_ones(tasks):
    with pytest.raises(ValueError, match=r"unknown task 'wsc'; choose one of \['boolq', 'cb'"):
        tasks.get_task("wsc")


def test_missing_columns_are_named(tasks):
    with pytest.raises(ValueError) as info:
        tasks.get_task("multirc", ["paragraph", "question", "label"])
    message = str(info.value)
    assert "task `multirc` needs the columns ['answer', 'idx']" in message
    assert "it has ['paragraph', 'question', 'label']" in message
    assert "aps/super_glue `multirc`" in message and "rename_column" in message
    with pytest.raises(ValueError, match=r"needs the columns \['premise'\]"):
        tasks.get_task("rte", ["hypothesis", "sentence1", "idx", "label"])


def test_bad_label_is_refused(tasks):
    with pytest.raises(ValueError, match=r"task `cb` has labels 0..2 \(entailment, contradiction, neutral\), got 3"):
        tasks.get_task("cb").format_target({"label": 3})


def _columns(rows: list[dict]) -> dict[str, list]:
    return {key: [row[key] for row in rows] for key in rows[0]}


RTE_ROWS = [
    {"premise": "anna sold the car", "hypothesis": "anna sold", "idx": 0, "label": 1},
    {"premise": "anna sold the car " * 20, "hypothesis": "anna", "idx": 1, "label": 0},
    {"premise": "anna", "hypothesis": "anna", "idx": 2, "label": -1},  # a test row: no target
]


def test_tokenize_batch_pads_truncates_and_keeps_eos(tasks, tok):
    task = tasks.get_task("rte")
    rows = RTE_ROWS
    out = tasks.tokenize_batch(
        tok, task, _columns(rows), max_source_length=24, max_target_length=5, pad_to_max_length=True
    )
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    short, long, _ = out["input_ids"]
    assert all(len(ids) == 24 for ids in out["input_ids"]) and all(len(m) == 24 for m in out["attention_mask"])
    expected = tok(task.format_input(rows[0])).input_ids  # the tokenizer's own EOS-terminated encoding
    assert short == expected + [0] * (24 - len(expected))
    assert out["attention_mask"][0] == [1] * len(expected) + [0] * (24 - len(expected))
    assert long[-1] == tok.eos_token_id and long.count(tok.eos_token_id) == 1 and 0 not in long
    assert out["attention_mask"][1] == [1] * 24
    target = tok("not_entailment").input_ids
    assert out["labels"][0] == target + [-100] * (5 - len(target))
    assert out["labels"][1][: len(tok("entailment").input_ids)] == tok("entailment").input_ids
    assert out["labels"][2] == [-100] * 5
    truncated = tasks.tokenize_batch(tok, task, _columns(rows[:1]), max_target_length=2)["labels"][0]
    assert truncated == [*target[:1], tok.eos_token_id]
    padded = tasks.tokenize_batch(tok, task, _columns(rows[:1]), pad_to_max_length=True)
    assert len(padded["input_ids"][0]) == 320  # task default


def test_tokenize_batch_leaves_padding_to_the_collator_by_default(tasks, tok):
    """Rows keep their own lengths (truncated, EOS kept); DataCollatorForSeq2Seq pads each batch to its
    longest input with the pad token and its longest label with -100: what padding to the lengths gives,
    cut at the batch's longest."""
    from transformers import DataCollatorForSeq2Seq

    task = tasks.get_task("rte")
    out = tasks.tokenize_batch(tok, task, _columns(RTE_ROWS), max_source_length=24, max_target_length=5)
    short, long, test_row = out["input_ids"]
    assert short == tok(task.format_input(RTE_ROWS[0])).input_ids
    assert len(long) == 24 and long[-1] == tok.eos_token_id
    assert test_row == tok(task.format_input(RTE_ROWS[2])).input_ids
    assert out["attention_mask"] == [[1] * len(ids) for ids in out["input_ids"]]
    assert out["labels"][0] == tok("not_entailment").input_ids and out["labels"][1] == tok("entailment").input_ids
    # no target: ignored labels as long as the task's longest label name, so a traced batch can generate it
    longest = max(len(tok(name).input_ids) for name in task.label_names)
    assert out["labels"][2] == [-100] * longest

    rows = [{name: out[name][i] for name in out} for i in range(3)]
    batch = DataCollatorForSeq2Seq(tok)(rows)
    padded = tasks.tokenize_batch(
        tok, task, _columns(RTE_ROWS), max_source_length=24, max_target_length=5, pad_to_max_length=True
    )
    labels_length = max(len(labels) for labels in out["labels"])
    assert batch["input_ids"].tolist() == padded["input_ids"]  # the long row fills the 24
    assert batch["attention_mask"].tolist() == padded["attention_mask"]
    assert batch["labels"].tolist() == [labels[:labels_length] for labels in padded["labels"]]


def test_tokenize_batch_checks_columns(tasks, tok):
    with pytest.raises(ValueError, match=r"task `wic` needs the columns \['sentence2', 'word'\]"):
        tasks.tokenize_batch(tok, tasks.get_task("wic"), {"sentence1": ["a"], "label": [0]})
    with pytest.raises(ValueError, match=r"lengths must be at least 1 \(the EOS\), got 0 / 8"):
        tasks.tokenize_batch(tok, tasks.get_task("rte"), {"premise": [], "hypothesis": [], "label": []}, 0)


@pytest.mark.parametrize("name", HUB_COLUMNS)
@pytest.mark.parametrize("split", ["train", "validation"])
def test_fixtures_load_in_the_hub_layout(tasks, name, split):
    from datasets import load_dataset

    path = DATA / f"{name}_{split}.jsonl"
    data = load_dataset("json", data_files={split: str(path)}, split=split)
    assert data.column_names == HUB_COLUMNS[name]
    assert len(data) == ({"train": 600, "validation": 200} if name == "rte" else {"train": 64, "validation": 32})[split]
    task = tasks.get_task("rte" if name == "glue_rte" else name, data.column_names)
    assert task.name == name
    labels = set(data["label"])
    assert labels == set(range(len(task.label_names)))
    for row in data:
        assert task.format_input(row).startswith(task.prefix + " ")
        assert task.format_target(row) in task.label_names
    if name == "multirc":
        assert data.features["idx"].keys() == {"paragraph", "question", "answer"}
        assert "<b>" not in task.format_input(data[0])
    if name == "wic":
        for row in data:
            for i in (1, 2):
                assert row[f"sentence{i}"][row[f"start{i}"] : row[f"end{i}"]].lower() == row["word"]


def test_validation_rows_are_not_in_train():
    for name in HUB_COLUMNS:
        if name == "multirc":
            continue  # rows are answer options: "Ann" is an answer in both splits
        train = {
            json.dumps({k: v for k, v in json.loads(line).items() if k != "idx"})
            for line in (DATA / f"{name}_train.jsonl").read_text().splitlines()
        }
        for line in (DATA / f"{name}_validation.jsonl").read_text().splitlines():
            assert json.dumps({k: v for k, v in json.loads(line).items() if k != "idx"}) not in train, name


def test_make_super_glue_regenerates_the_shipped_files(tmp_path):
    regenerate_fixtures("make_super_glue.py", tmp_path)
    for name in HUB_COLUMNS:
        for split in ("train", "validation"):
            file = f"{name}_{split}.jsonl"
            assert (tmp_path / file).read_bytes() == (DATA / file).read_bytes(), f"{file} is stale: rerun the script"
