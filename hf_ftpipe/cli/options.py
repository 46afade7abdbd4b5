"""How an ``hf-ftpipe`` subcommand is added, and the arguments several subcommands share: one wording each.

A subcommand is a parser of the ``hf-ftpipe`` subparsers that ``main`` runs as ``args.run(args)``
(`add_command`). An argument that means the same in several commands (``--json``, the model, the plan file,
the schedule and its micro-batches, the compute dtype, token slices) is added here, so that its
name, type and help cannot drift apart between them.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any, get_args

__all__ = [
    "add_command",
    "add_dtype_option",
    "add_json_option",
    "add_model_argument",
    "add_plan_argument",
    "add_schedule_options",
    "add_token_slices_option",
]


def add_command(
    commands: Any, name: str, run: Callable[[argparse.Namespace], int], help: str
) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``commands`` (the ``hf-ftpipe`` subparsers), run as ``run(args)``:
    ``help`` is its line in ``hf-ftpipe --help``, ``run``'s docstring its description (what it
    does, for ``hf-ftpipe name --help`` and for whoever reads ``run``)."""
    command = commands.add_parser(name, help=help, description=inspect.cleandoc(run.__doc__ or ""))
    command.set_defaults(run=run)
    return command


def add_json_option(command: argparse.ArgumentParser, help: str = "print JSON instead of a table") -> None:
    """``--json``: print the result as JSON rather than for people."""
    command.add_argument("--json", action="store_true", help=help)


def add_model_argument(command: argparse.ArgumentParser, kind: str = "") -> None:
    """The positional ``model``, anything `hf_ftpipe.graph.sources.load_model_for_planning` reads;
    ``kind`` (e.g. ``"a causal LM"``) narrows it for a command that takes only some models."""
    command.add_argument(
        "model",
        help=(f"{kind}: " if kind else "")
        + "a shipped short name (t5-3b, gpt2-xl, bert-large: offline), a folder with config.json, "
        "a config JSON file, or a Hub model id",
    )


def add_plan_argument(command: argparse.ArgumentParser) -> None:
    """The positional ``plan``: a partition file the command reads."""
    command.add_argument("plan", help="a partition JSON file (hf-ftpipe partition -o, or partitions/...)")


def add_schedule_options(command: argparse.ArgumentParser) -> None:
    """``--schedule`` (default gpipe) and ``--num-microbatches`` (default 4): the step to plan or print."""
    from hf_ftpipe.costmodel.options import Schedule

    command.add_argument("--schedule", choices=get_args(Schedule), default="gpipe", help="default: gpipe")
    command.add_argument("--num-microbatches", type=int, default=4, help="micro-batches per step (default: 4)")


def add_dtype_option(command: argparse.ArgumentParser) -> None:
    """``--dtype``: the compute dtype the costs are priced in."""
    command.add_argument("--dtype", help="compute dtype for the costs, e.g. bfloat16 (default: the weights')")


def add_token_slices_option(command: argparse.ArgumentParser, more: str = "") -> None:
    """``--token-slices K`` (TeraPipe), for the schedules that take slices; ``more`` ends the help."""
    command.add_argument(
        "--token-slices", type=int, metavar="K", help="gpipe/1f1b: cut each sequence into K token slices" + more
    )
