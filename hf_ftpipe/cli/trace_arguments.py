"""How a command that traces a model (``partition``, ``compare``, ``profile``) is told the model's
inputs beyond their size, and the model with sample inputs it makes of them: one home, so that the
commands trace alike."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["TASKS", "add_trace_arguments", "model_and_inputs"]

TASKS = ["seq2seq-lm", "causal-lm", "masked-lm", "question-answering", "sequence-classification"]
"""``graph.sources.Task``'s values, written out: importing it would load torch for every ``--help``."""


def add_trace_arguments(command: Any) -> None:
    """Add ``--target-len``, ``--task`` and ``--attention-mask`` to the subparser ``command``."""
    command.add_argument("--target-len", type=int, help="target length of an encoder-decoder (default: seq-len)")
    command.add_argument(
        "--task", choices=TASKS, help="head to put on the model instead of the config's `architectures`"
    )
    command.add_argument("--attention-mask", action="store_true", help="trace with an attention_mask input")


def model_and_inputs(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model ``args.model`` names (with ``args.task``'s head) and sample inputs of one micro-batch."""
    from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for

    model = load_model_for_planning(args.model, task=args.task)
    inputs = sample_inputs_for(
        model, args.batch_size, args.seq_len, args.target_len, attention_mask=args.attention_mask
    )
    return model, inputs
