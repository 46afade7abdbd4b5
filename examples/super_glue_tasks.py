"""The paper's SuperGLUE tasks as T5 text-to-text: formats, label names, lengths, datasets, tokenization.

    from super_glue_tasks import get_task, tokenize_batch
    task = get_task("wic")
    task.format_input({"word": "bank", "sentence1": "...", "sentence2": "...", ...})
    # 'wic sentence1: ... sentence2: ... word: bank'
    data = raw.map(lambda b: tokenize_batch(tokenizer, task, b), batched=True,
                   remove_columns=raw["train"].column_names)

Formats follow the T5 library's SuperGLUE/GLUE preprocessors (``t5/data/preprocessors.py``,
``glue``): ``"<task> key1: v1 key2: v2"`` joined with single spaces, keys in the task's order
(alphabetical unless T5 gives one), nothing lowercased or collapsed; the target is the label
name. MultiRC's paragraphs carry HTML: after joining, ``<br>`` becomes a space and ``<b>``,
``</b>`` are removed. Inputs and targets get EOS and are truncated at the end with EOS kept; they
are left for the collator to pad per batch, or (``pad_to_max_length``) padded to the lengths, as
T5's ``trim_and_pad`` did for FTPipe.

RTE comes in two column layouts: SuperGLUE's (premise, hypothesis; task ``rte``) and GLUE's
(sentence1, sentence2; task ``glue_rte``, the one FTPipe trained on). ``get_task("rte",
column_names)`` picks the layout from the data's columns, so ``--task_name rte`` works with
either; ``get_task("glue_rte")`` asks for the GLUE layout explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Task", "TASKS", "get_task", "tokenize_batch"]

_MULTIRC_MARKUP = [(re.compile(r"<br>"), " "), (re.compile(r"</?b>"), "")]


@dataclass(frozen=True, kw_only=True)
class Task:
    """One text-to-text task: how an example becomes strings, and where its data and metric live."""

    name: str
    """Registry key, e.g. ``"rte"`` or ``"glue_rte"``."""
    prefix: str
    """First word of every input, e.g. ``"rte"`` for both RTE layouts."""
    input_keys: tuple[str, ...]
    """Columns written into the input, in this order, each as ``key: value``."""
    label_names: tuple[str, ...]
    """Targets in label-id order: label ``i`` is trained to generate ``label_names[i]``."""
    max_source_length: int
    """Default input length in tokens (EOS included): longer inputs are truncated to it."""
    max_target_length: int
    """Default target length in tokens (EOS included): longer targets are truncated to it."""
    metric_config: str
    """Config of the ``t5_super_glue`` metric module that scores this task."""
    dataset_name: str
    """Hub dataset whose column layout this task reads."""
    dataset_config_name: str
    extra_columns: tuple[str, ...] = ()
    """Columns needed besides ``input_keys`` and ``label``: MultiRC's ``idx`` groups answers per question."""
    strip_markup: bool = False
    """MultiRC: ``<br>`` -> space, ``<b>``/``</b>`` removed, on the joined input."""

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column this task reads."""
        return (*self.input_keys, "label", *self.extra_columns)

    def check_columns(self, column_names: Iterable[str]) -> None:
        """Raise `ValueError` naming the columns this task needs that ``column_names`` lacks."""
        present = list(column_names)
        missing = [c for c in self.columns if c not in present]
        if missing:
            raise ValueError(
                f"task `{self.name}` needs the columns {missing}, which the dataset lacks "
                f"(it has {present}); use the layout of the Hub's {self.dataset_name} "
                f"`{self.dataset_config_name}` (columns {list(self.columns)}), or rename yours with "
                f"`Dataset.rename_column`"
            )

    def format_input(self, example: Mapping[str, Any]) -> str:
        """The T5 input string of one example, e.g. ``"rte hypothesis: ... premise: ..."``."""
        text = " ".join([self.prefix, *(f"{key}: {example[key]}" for key in self.input_keys)])
        if self.strip_markup:
            for pattern, replacement in _MULTIRC_MARKUP:
                text = pattern.sub(replacement, text)
        return text

    def format_target(self, example: Mapping[str, Any]) -> str:
        """The label name of one example, e.g. ``"not_entailment"`` for RTE label 1."""
        label = example["label"]
        if not isinstance(label, int) or not 0 <= label < len(self.label_names):
            raise ValueError(
                f"task `{self.name}` has labels 0..{len(self.label_names) - 1} "
                f"({', '.join(self.label_names)}), got {label!r}; test splits (label -1) have no target"
            )
        return self.label_names[label]


def _super_glue(name: str, keys: tuple[str, ...], labels: tuple[str, ...], lengths: tuple[int, int], **kw) -> Task:
    return Task(
        name=name,
        prefix=name,
        input_keys=keys,
        label_names=labels,
        max_source_length=lengths[0],
        max_target_length=lengths[1],
        metric_config=name,
        dataset_name="aps/super_glue",
        dataset_config_name=name,
        **kw,
    )


_BOOL = ("False", "True")
_RTE = ("entailment", "not_entailment")

# Lengths: FTPipe's configs for BoolQ, MultiRC, RTE and WiC. CB and COPA had none and the real
# data cannot be measured offline: COPA's one-sentence fields fit 64; CB's premises are
# multi-sentence dialogue excerpts, so 256 (the hypothesis comes first, so truncation only cuts
# the premise's end). Override both with the data's longest tokenized input, rounded up to 64.
TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        _super_glue("boolq", ("passage", "question"), _BOOL, (512, 4)),
        _super_glue("cb", ("hypothesis", "premise"), ("entailment", "contradiction", "neutral"), (256, 8)),
        _super_glue("copa", ("choice1", "choice2", "premise", "question"), ("choice1", "choice2"), (64, 8)),
        _super_glue(
            "multirc",
            ("question", "answer", "paragraph"),
            _BOOL,
            (512, 4),
            extra_columns=("idx",),
            strip_markup=True,
        ),
        _super_glue("rte", ("hypothesis", "premise"), _RTE, (320, 8)),
        Task(
            name="glue_rte",
            prefix="rte",
            input_keys=("sentence1", "sentence2"),
            label_names=_RTE,
            max_source_length=320,
            max_target_length=8,
            metric_config="rte",
            dataset_name="nyu-mll/glue",
            dataset_config_name="rte",
        ),
        _super_glue("wic", ("sentence1", "sentence2", "word"), _BOOL, (64, 4)),
    ]
}


def get_task(name: str, column_names: Iterable[str] | None = None) -> Task:
    """The task called ``name``, checked against the dataset's ``column_names`` when given.

    ``"rte"`` with GLUE's columns (sentence1, sentence2) and without SuperGLUE's (premise,
    hypothesis) resolves to ``"glue_rte"``.

    Raises:
        `ValueError`: an unknown name (the valid ones are listed), or columns the task needs missing.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    task = TASKS[name]
    if column_names is None:
        return task
    columns = set(column_names)
    if name == "rte" and {"sentence1", "sentence2"} <= columns and not {"premise", "hypothesis"} & columns:
        task = TASKS["glue_rte"]
    task.check_columns(column_names)
    return task


def _truncate(ids: Sequence[int], length: int, eos_id: int) -> list[int]:
    # T5's append_eos_after_trim: the last kept token is always EOS.
    return [*ids[: length - 1], eos_id]


def _pad(ids: list[int], length: int, pad_id: int) -> list[int]:
    return ids + [pad_id] * (length - len(ids))


def tokenize_batch(
    tokenizer,
    task: Task,
    batch: Mapping[str, list],
    max_source_length: int | None = None,
    max_target_length: int | None = None,
    pad_to_max_length: bool = False,
) -> dict[str, list[list[int]]]:
    """Model inputs for a batch of examples, for ``datasets.map(..., batched=True)``.

    Args:
        tokenizer (`PreTrainedTokenizerBase`):
            Needs ``eos_token_id`` and ``pad_token_id``; its own special tokens are not added.
        task (`Task`):
            Formats each example (see `Task.format_input`).
        batch (`Mapping[str, list]`):
            Column name -> values, as ``datasets.map`` passes them.
        max_source_length (`int`, *optional*, defaults to ``task.max_source_length``):
            The most ``input_ids`` tokens, EOS included: longer inputs are truncated, EOS kept.
        max_target_length (`int`, *optional*, defaults to ``task.max_target_length``):
            The most ``labels`` tokens, EOS included.
        pad_to_max_length (`bool`, defaults to `False`):
            Pad every row to those lengths (FTPipe's fixed shapes, for `default_data_collator`).
            Otherwise rows keep their own lengths and a collator pads each batch to its longest
            (`DataCollatorForSeq2Seq`, labels with -100).

    Returns:
        `dict`: ``input_ids``, ``attention_mask`` (1 on tokens, 0 on padding) and ``labels``
        (target ids, then -100 as padding). A row with label -1 (test splits) has no target: its
        labels are all -100, as long as the longest target (``max_target_length`` when padding;
        else the task's longest label name, at most that), so that a pipeline traced on such a
        batch can still generate every label. T5 builds its decoder inputs by shifting ``labels``
        right.
    """
    source_length = task.max_source_length if max_source_length is None else max_source_length
    target_length = task.max_target_length if max_target_length is None else max_target_length
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos_id is None or pad_id is None:
        raise ValueError(
            f"the tokenizer needs an EOS and a pad token (eos_token_id={eos_id}, pad_token_id={pad_id}); "
            "use a T5 tokenizer or set `tokenizer.eos_token` / `tokenizer.pad_token`"
        )
    if min(source_length, target_length) < 1:
        raise ValueError(f"lengths must be at least 1 (the EOS), got {source_length} / {target_length}")
    task.check_columns(batch.keys())
    num_rows = len(batch["label"])
    examples = [{column: batch[column][i] for column in task.columns} for i in range(num_rows)]
    sources = tokenizer([task.format_input(e) for e in examples], add_special_tokens=False).input_ids
    input_ids = [_truncate(ids, source_length, eos_id) for ids in sources]
    attention_mask = [[1] * len(ids) for ids in input_ids]
    labels = []
    for example in examples:
        if example["label"] == -1:
            labels.append(
                [-100] * (target_length if pad_to_max_length else _longest_target(tokenizer, task, target_length))
            )
            continue
        ids = tokenizer(task.format_target(example), add_special_tokens=False).input_ids
        labels.append(_truncate(ids, target_length, eos_id))
    if pad_to_max_length:
        input_ids = [_pad(ids, source_length, pad_id) for ids in input_ids]
        attention_mask = [_pad(mask, source_length, 0) for mask in attention_mask]
        labels = [_pad(ids, target_length, -100) for ids in labels]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _longest_target(tokenizer, task: Task, target_length: int) -> int:
    """Tokens of the task's longest label name, EOS included, at most ``target_length``."""
    names = tokenizer(list(task.label_names), add_special_tokens=False).input_ids
    return min(target_length, max(len(ids) for ids in names) + 1)
