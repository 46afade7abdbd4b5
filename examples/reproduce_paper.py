"""Reproduce FTPipe's table of tasks (Eliad et al., USENIX ATC'21) from the presets in ``presets/``.

Each preset is one row of the paper's table under one schedule (``t5-3b_boolq_async.json``,
``t5-3b_boolq_gpipe.json``, ...): the arguments of its example script (``_script``), plus the
number of processes to launch (``_num_processes``) and the shipped model config to plan with
(``_plan_model``). This script plans every preset on the meta device (no weights), launches it
with ``accelerate launch --num_processes N examples/<script> <preset>``, and writes a Markdown
table: the metric reached beside the paper's, the measured samples/s (``train_samples_per_second``
in ``all_results.json``) beside the planned ones, the schedule and the partitioner.

On a box with 8 GPUs (hours per preset)::

    python examples/reproduce_paper.py                       # every preset
    python examples/reproduce_paper.py 't5-3b_wic_*' bert-large_squad_async

Anywhere, in a minute or two on a CPU: plan only, the metric and measured columns left empty::

    python examples/reproduce_paper.py --dry-run [--gpus 8 --gpu-profile rtx2080ti]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments

EXAMPLES = Path(__file__).resolve().parent
PRESETS = EXAMPLES / "presets"
EMPTY = "—"


@dataclass(frozen=True)
class PaperRow:
    """One row of FTPipe's table: the task as the paper names it, its metric, and the value reached."""

    task: str
    metric: str
    result_keys: tuple[str, ...]
    """The keys of ``all_results.json`` that make up ``metric``, in its order."""
    paper: str | None
    """``None`` for the tasks FTPipe did not run (CB, COPA)."""


# FTPipe's table of tasks and the metric each reached (seed 001, USENIX ATC'21; REFERENCE.md,
# "FTPipe — 8× RTX 2080 Ti"), keyed by the preset's name without its schedule.
PAPER: dict[str, PaperRow] = {
    "t5-3b_boolq": PaperRow("T5-3B BoolQ", "accuracy", ("eval_accuracy",), "89.05"),
    "t5-3b_rte": PaperRow("T5-3B RTE", "accuracy", ("eval_accuracy",), "90.97"),
    "t5-3b_wic": PaperRow("T5-3B WiC", "accuracy", ("eval_accuracy",), "74.92"),
    "t5-3b_multirc": PaperRow("T5-3B MultiRC", "F1a / EM", ("eval_f1_a", "eval_exact_match"), "85.6 / 59.3"),
    "t5-3b_cb": PaperRow("T5-3B CB (not in the paper)", "F1 / accuracy", ("eval_f1", "eval_accuracy"), None),
    "t5-3b_copa": PaperRow("T5-3B COPA (not in the paper)", "accuracy", ("eval_accuracy",), None),
    "gpt2-xl_wikitext2": PaperRow("GPT2-XL WikiText-2", "perplexity", ("perplexity",), "12.02"),
    "bert-large_squad": PaperRow("BERT-large SQuAD 1.1", "F1 / EM", ("eval_f1", "eval_exact_match"), "93.3 / 87.2"),
}


@dataclass
class Row:
    """What the table shows for one preset."""

    preset: str
    paper: PaperRow
    schedule: str
    partitioner: str = EMPTY
    planned: str = EMPTY
    reached: str = EMPTY
    measured: str = EMPTY


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        names = select_presets(args.presets)
    except ValueError as error:
        print(f"reproduce_paper.py: error: {error}", file=sys.stderr)
        return 2
    from hf_ftpipe.hub.catalog import GraphCache

    graphs = GraphCache(log=lambda line: print(line, file=sys.stderr))
    rows, failed = [], 0
    for name in names:
        preset = read_preset(name, gpus=args.gpus, gpu_profile=args.gpu_profile)
        started = time.perf_counter()
        row = plan_preset(name, preset, graphs)
        print(f"{name}: planned in {time.perf_counter() - started:.1f} s: {row.planned} samples/s", file=sys.stderr)
        if not args.dry_run:
            failed += not run_preset(name, preset, row)
        rows.append(row)
    table = markdown_table(rows)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(table, encoding="utf-8")
    print(table, end="")
    print(f"wrote {output}", file=sys.stderr)
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Reproduce FTPipe's table from examples/presets/.")
    parser.add_argument(
        "presets", nargs="*", help="preset names or globs, e.g. t5-3b_boolq_async 't5-3b_wic_*' (default: all)"
    )
    parser.add_argument("--dry-run", action="store_true", help="only plan each preset on the meta device")
    parser.add_argument("--gpus", type=int, help="number of GPUs (processes), instead of the presets' 8")
    parser.add_argument("--gpu-profile", help="GPU profile, instead of the presets' rtx2080ti")
    parser.add_argument("--output", default="pipe_output/paper/table.md", help="the Markdown table's file")
    return parser


def select_presets(patterns: Sequence[str]) -> list[str]:
    """The preset names (file stems in ``presets/``) that ``patterns`` match, all when none is given."""
    names = sorted(path.stem for path in PRESETS.glob("*.json"))
    if not patterns:
        return names
    chosen = [name for name in names if any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatch(name, p) for name in names)]
    if unmatched:
        raise ValueError(f"no preset matches {unmatched}; the presets are {names}")
    return chosen


def read_preset(name: str, *, gpus: int | None = None, gpu_profile: str | None = None) -> dict[str, Any]:
    """The preset ``name`` as a dict, with ``--gpus`` and ``--gpu-profile`` applied when given."""
    preset = json.loads((PRESETS / f"{name}.json").read_text(encoding="utf-8"))
    if gpus is not None:
        preset["_num_processes"] = gpus
    if gpu_profile is not None:
        preset["gpu_profile"] = gpu_profile
    return preset


def plan_preset(name: str, preset: dict[str, Any], graphs: Any) -> Row:
    """Plan ``preset`` as `PipeTrainer` would on its GPUs: the partitioner and predicted samples/s.

    The model is the shipped config ``_plan_model`` on the meta device, traced for one
    micro-batch of the preset's lengths (``graphs``, a `GraphCache`, traces each shape once).
    """
    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.errors import PlanDoesNotFitError
    from hf_ftpipe.hub.setups import FineTuningTask
    from hf_ftpipe.partitioners.registry import run_partitioner
    from hf_ftpipe.plan.request import PlanRequest
    from hf_ftpipe.trainer.plan_sharing import memory_options, planned_optimizer

    args = training_arguments(preset)
    row = Row(preset=name, paper=PAPER[name.rsplit("_", 1)[0]], schedule=args.pipeline_schedule)
    seq_len, target_len = _lengths(preset)
    # run_glue_pipe.py's FTPipe Adafactor sets `optim` to adafactor itself (ftpipe_adafactor)
    optimizer = "adafactor" if preset.get("adafactor_scale_parameter") else planned_optimizer(args)
    microbatch_size = args.per_device_train_batch_size // args.num_microbatches
    setup = FineTuningTask(
        name=name,
        dataset=row.paper.task,
        model=preset["_plan_model"],
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        target_len=target_len,
        optimizer=optimizer,
    )
    graph = graphs(setup)
    profile = get_profile(args.gpu_profile, count=preset["_num_processes"])
    try:
        request = PlanRequest(
            profile=profile,
            num_microbatches=args.num_microbatches,
            microbatch_size=microbatch_size,
            schedule=args.pipeline_schedule,
            optimizer=optimizer,
            memory=memory_options(args),
        )
        plan = run_partitioner(args.partitioner, graph, request)
    except PlanDoesNotFitError:
        row.partitioner, row.planned = args.partitioner, "does not fit"
        return row
    row.partitioner = plan.partitioner
    row.planned = f"{plan.predicted.throughput_samples_per_s:.2f}"
    return row


def training_arguments(preset: dict[str, Any]) -> PipeTrainingArguments:
    """The preset's `PipeTrainingArguments`; the script's own fields and ``_`` notes are skipped."""
    fields = {key: value for key, value in preset.items() if not key.startswith("_")}
    (args,) = HfArgumentParser(PipeTrainingArguments).parse_dict(fields, allow_extra_keys=True)
    return args


def _lengths(preset: dict[str, Any]) -> tuple[int, int | None]:
    """Input (and target) tokens per sample, under each example script's name for them."""
    for source, target in (("max_source_length", "max_target_length"), ("max_seq_length", None), ("block_size", None)):
        if source in preset:
            return preset[source], preset[target] if target else None
    raise ValueError(f"the preset sets no length: one of max_source_length, max_seq_length, block_size; got {preset}")


def run_preset(name: str, preset: dict[str, Any], row: Row) -> bool:
    """Launch ``preset`` with accelerate and fill ``row`` from its ``all_results.json``; ``False`` if it failed."""
    output_dir = Path(preset["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    launched = output_dir / "preset.json"  # what ran, --gpus and --gpu-profile applied
    launched.write_text(json.dumps(preset, indent=2) + "\n", encoding="utf-8")
    command = [
        "accelerate",
        "launch",
        "--num_processes",
        str(preset["_num_processes"]),
        str(EXAMPLES / preset["_script"]),
        str(launched),
    ]
    print(f"{name}: {' '.join(command)}", file=sys.stderr)
    status = subprocess.run(command, check=False).returncode
    results_file = output_dir / "all_results.json"
    if status != 0 or not results_file.is_file():
        row.reached = f"failed (exit status {status})"
        return False
    results = json.loads(results_file.read_text(encoding="utf-8"))
    row.reached = " / ".join(_number(results.get(key)) for key in row.paper.result_keys)
    row.measured = _number(results.get("train_samples_per_second"))
    return True


def _number(value: float | None) -> str:
    return EMPTY if value is None else f"{value:.2f}"


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, the paper's values beside what was reached and planned."""
    header = ("preset", "task", "metric", "reached", "paper", "measured samples/s", "planned samples/s")
    header += ("schedule", "partitioner")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = (
            row.preset,
            row.paper.task,
            row.paper.metric,
            row.reached,
            row.paper.paper or EMPTY,
            row.measured,
            row.planned,
            row.schedule,
            row.partitioner,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
