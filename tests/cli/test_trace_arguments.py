"""The trace arguments the commands share (``cli.trace_arguments``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

import transformers

from hf_ftpipe.cli.trace_arguments import TASKS, add_trace_arguments, model_and_inputs
from hf_ftpipe.graph.sources import Task


def test_the_task_choices_are_the_tasks_a_model_is_loaded_for() -> None:
    assert TASKS == list(get_args(Task))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    add_trace_arguments(parser)
    return parser


def _shapes(inputs: dict) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in inputs.items()}


def test_the_arguments_make_the_model_and_one_microbatch(tmp_path: Path) -> None:
    t5 = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    t5.architectures = ["T5ForConditionalGeneration"]
    t5.to_json_file(tmp_path / "t5.json")
    argv = [str(tmp_path / "t5.json"), "--batch-size", "2", "--seq-len", "8", "--target-len", "3", "--attention-mask"]
    model, inputs = model_and_inputs(_parser().parse_args(argv))
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert _shapes(inputs) == {"input_ids": [2, 8], "labels": [2, 3], "attention_mask": [2, 8]}

    gpt2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    gpt2.architectures = ["GPT2LMHeadModel"]
    gpt2.to_json_file(tmp_path / "gpt2.json")
    argv = [str(tmp_path / "gpt2.json"), "--batch-size", "2", "--seq-len", "8", "--task", "sequence-classification"]
    model, inputs = model_and_inputs(_parser().parse_args(argv))
    assert type(model).__name__ == "GPT2ForSequenceClassification"
    assert _shapes(inputs) == {"input_ids": [2, 8], "labels": [2]}
