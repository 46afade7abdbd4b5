"""The plan's micro-batch comes from the longest rows of every dataset the run will see, padded as the
collator pads them, even when the datasets' columns differ."""

from __future__ import annotations

from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_ftpipe.trainer.planned_shapes import longest_rows, planned_microbatch

from mlm_runs import tokenizer

COLUMNS = ["input_ids", "attention_mask"]


def rows(lengths: list[int], **extra: list) -> Dataset:
    return Dataset.from_dict({"input_ids": [[5] * n for n in lengths], **extra})


def test_datasets_with_different_columns_each_give_their_longest_row() -> None:
    """Training features with answer positions, evaluation features without (run_qa.py's): one batch of
    both would not collate, and planning for the first batch then fails on a longer one."""
    train = rows([3, 9, 4], start_positions=[0, 1, 2], end_positions=[1, 2, 3])
    evaluation = rows([5, 11, 2])
    longest = longest_rows([train, evaluation], DataCollatorWithPadding(tokenizer()), COLUMNS)
    assert longest is not None
    assert longest["input_ids"].shape[1] == longest["attention_mask"].shape[1] == 11
    assert longest["start_positions"].shape == (1,)


def test_the_collators_padding_rule_and_the_first_batch_bound_the_plan() -> None:
    padded = DataCollatorWithPadding(tokenizer(), pad_to_multiple_of=8)
    longest = longest_rows([rows([3, 9, 4])], padded, COLUMNS)
    assert longest["input_ids"].shape[1] == 16
    first = padded([{"input_ids": [5] * 20}])
    planned = planned_microbatch(first, rows=2, longest=longest, plan_max_length=None)
    assert planned["input_ids"] == (2, 24)  # the first batch is longer than the datasets' rows
    assert planned_microbatch(first, rows=2, longest=longest, plan_max_length=40)["input_ids"] == (2, 40)
