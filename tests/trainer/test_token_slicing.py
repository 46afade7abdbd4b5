"""`token_slices` before any process starts: parsing, the lengths' check against the batch, and
the slicing ``"auto"`` chooses (the 2-rank run against plain `Trainer` is in test_parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.graph.token_slices import capture_token_slices
from hf_ftpipe.trainer.token_slicing import capture_for_pipeline, choose_token_slices, slicing_step

from models import SEQ, tiny_batch, tiny_model


def _args(tmp_path: Path, **overrides: object) -> PipeTrainingArguments:
    return PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


@pytest.mark.parametrize(("given", "parsed"), [("3,1,4", [3, 1, 4]), ("auto", "auto")])
def test_command_line_gives_lengths_as_a_comma_separated_string(tmp_path: Path, given: str, parsed: object) -> None:
    command = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--token_slices", given]
    (args,) = HfArgumentParser(PipeTrainingArguments).parse_args_into_dataclasses(command)
    assert args.token_slices == parsed


def test_lengths_that_miss_the_sequence_length_are_refused_with_both_numbers(tmp_path: Path) -> None:
    args = _args(tmp_path, token_slices=[3, 4])
    microbatch = tiny_batch("gpt2", 2)
    with pytest.raises(ValueError, match=rf"`token_slices=\[3, 4\]` add up to 7 tokens, .* sequences of {SEQ}"):
        capture_for_pipeline(args, tiny_model("gpt2"), microbatch, watchdog=None)


@pytest.mark.parametrize(
    ("seq_len", "step"), [(5, 1), (8, 1), (16, 2), (64, 8), (100, 8), (1024, 8), (1023, 8), (1500, 12), (4096, 32)]
)
def test_step_is_terapipes_eight_tokens_finer_for_short_sequences_coarser_for_long(seq_len: int, step: int) -> None:
    assert slicing_step(seq_len) == step


def test_auto_chooses_lengths_that_cover_the_sequence_in_whole_steps() -> None:
    model = tiny_model("gpt2")
    full = capture_token_slices(model, tiny_batch("gpt2", 2), [SEQ]).full
    slicing = choose_token_slices(
        full.cost_graph, get_profile("a100-80gb", count=2), num_stages=2, hidden_size=32, microbatch_size=2
    )
    assert sum(slicing.slices) == SEQ and len(slicing.microbatches) == 1
    assert all(length % slicing_step(SEQ) == 0 for length in slicing.slices)
    assert slicing.step_time_s > 0
