"""A plan that fits nowhere: GPT2-XL, micro-batch 8 × 1024 tokens, on 2 × RTX 2080 Ti (11 GB).

Every partitioner fails; the report must answer in seconds, with one figure for the memory per
GPU and one GPU count that agree with the partitioners' own estimate, and with fixes named as the
reader names them: flags on the command line, keyword arguments in Python, `PipeTrainingArguments`
fields for PipeTrainer. GPT2-XL is traced once (meta device, shipped config; several seconds), or
measured at this shape from the session's capture of it (tests/helpers/planning_graphs.py).
docs/planning.md shows this case; its command and the lines it prints are checked here.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import hf_ftpipe.partitioners  # noqa: F401  (registers the partitioners)
from hf_ftpipe._units import format_bytes
from hf_ftpipe.cli import parser as cli
from hf_ftpipe.costmodel import MemoryOptions, estimate_memory, get_profile, usable_capacity
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners import partition_auto, partition_seq_dp
from hf_ftpipe.partitioners.contiguous import CutOrder
from hf_ftpipe.partitioners.registry import available_partitioners
from hf_ftpipe.trainer import plan_sharing as planning
from hf_ftpipe.trainer.arguments import PipeTrainingArguments

from doc_blocks import argv, expected_output, missing_output, page_block
from planning_graphs import cli_traces, planning_graph

ARGV = ["gpt2-xl", "--gpus", "2", "--gpu-profile", "rtx2080ti", "--batch-size", "8", "--seq-len", "1024"]
OPTIONS = {"num_microbatches": 4, "microbatch_size": 8}  # the CLI's defaults: gpipe, AdamW, 10% headroom
PROFILE = get_profile("rtx2080ti", count=2)
SECONDS = 10.0  # after the trace


@pytest.fixture(scope="module")
def graph() -> Iterator[CostGraph]:
    """GPT2-XL's graph at the case's shape, as `hf-ftpipe` traces it; the commands get it instead of
    tracing again, offline."""
    with cli_traces():
        yield planning_graph("gpt2-xl", 8, 1024)


@pytest.fixture(scope="module")
def compared(graph: CostGraph) -> tuple[int, str, str, float]:
    """`hf-ftpipe compare` on the case: status, stdout, stderr, seconds (the trace excluded)."""
    return run("compare", *ARGV)


def run(*argv: str) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - started


def cli_flags() -> set[str]:
    """Every option string of `hf-ftpipe compare`."""
    subparsers = next(a for a in cli._parser()._actions if a.dest == "command")
    compare = subparsers.choices["compare"]
    return {flag for action in compare._actions for flag in action.option_strings}


def test_compare_says_once_what_would_fit_in_seconds_with_cli_flags(compared: tuple) -> None:
    code, out, err, seconds = compared
    assert code == 0, err
    assert seconds < SECONDS, f"compare took {seconds:.1f} s after the trace:\n{out}"

    # The reasons in full: one line per partitioner, none cut short.
    assert "…" not in out
    for name in available_partitioners():
        if name != "auto":
            line = next(line for line in out.splitlines() if line.startswith(f"  - {name}: "))
            assert line.endswith(("on its fullest GPU", "headroom)")), line

    # One memory figure, the leanest split's need plus the headroom, said once.
    needs = re.findall(r"at least ([\d.]+ GiB)", out)
    assert len(needs) == 1, out
    assert out.count(needs[0]) == 1, out
    leanest = re.search(r"the leanest contiguous split needs ([\d.]+) GiB on its fullest GPU", out)
    assert leanest and format_bytes(float(leanest.group(1)) * 2**30 / 0.9) == needs[0]
    seq_dp = re.search(r"  - seq-dp: .* the best split needs ([\d.]+ GiB) on its fullest GPU", out)
    assert seq_dp and seq_dp.group(1) == f"{leanest.group(1)} GiB"  # the same split, the same figure

    # One GPU count besides the 2 asked for: none as asked, and one with the fix that makes it fit.
    assert "No number of rtx2080ti fits: `linear` (lm_head) alone needs" in out
    assert not re.search(r"at least \d+ GPUs|more than \d+ ×", out), out
    counts = set(re.findall(r"(\d+) × rtx2080ti", out)) - {"2"}
    assert len(counts) == 1, out
    count = int(counts.pop())
    fix = re.search(
        rf"With (`--recompute` and )?`--schedule 1f1b`, {count} × rtx2080ti would fit \(`--gpus {count}`\)\.", out
    )
    assert fix, out

    # Fixes as flags that `hf-ftpipe compare` has, never Python.
    assert set(re.findall(r"--[a-z][a-z-]*", out)) <= cli_flags(), out
    assert "recompute=True" not in out and "MemoryOptions(" not in out


def test_the_figures_agree_with_the_partitioners_estimate(graph: CostGraph, compared: tuple) -> None:
    code, out, _, _ = compared
    assert code == 0
    usable = usable_capacity(PROFILE, MemoryOptions())

    # `linear` (lm_head) in a stage of its own: GPipe holds all 4 micro-batches wherever it is.
    alone = re.search(r"`linear` \(lm_head\) alone needs ([\d.]+ GiB) on a GPU of its own", out)
    assert alone
    cut = CutOrder.of(graph)
    i = cut.cuttable.index("linear")
    node_stage = cut.node_stage([0, i, i + 1, len(cut.cuttable)])
    memory = estimate_memory(graph, node_stage, [0, 1, 2], num_microbatches=4, optimizer="adamw", schedule="gpipe")
    assert format_bytes(memory[1]) == alone.group(1) and memory[1] > usable

    # The count named with the fix named (1F1B, recomputation if said) fits by seq-dp, one fewer does not.
    fix = re.search(r"With (`--recompute` and )?`--schedule 1f1b`, (\d+) × rtx2080ti would fit", out)
    assert fix, out
    count = int(fix.group(2))
    fixed = {**OPTIONS, "schedule": "1f1b", "memory": MemoryOptions(recompute=fix.group(1) is not None)}
    plan = partition_seq_dp(graph, PROFILE.with_count(count), **fixed)
    assert max(g.memory_bytes for g in plan.predicted.gpus) <= usable
    with pytest.raises(PartitionError):
        partition_seq_dp(graph, PROFILE.with_count(count - 1), **fixed)


def test_partition_fails_with_the_same_figures_and_status_2(compared: tuple) -> None:
    # The command of docs/planning.md, "A plan that fits nowhere", and the lines the page shows.
    block = page_block("docs/planning.md", "hf-ftpipe partition gpt2-xl --gpus 2 --gpu-profile rtx2080ti")
    assert argv(block.command_lines()[0]) == ["hf-ftpipe", "partition", *ARGV]
    code, out, err, seconds = run("partition", *ARGV)
    assert code == 2 and out == "" and "Traceback" not in err
    assert seconds < SECONDS
    advice = [line for line in compared[1].splitlines() if line.startswith(("It would", "No number", "With "))]
    assert len(advice) == 3 and all(line in err for line in advice)
    assert not missing_output(expected_output(block), err), f"docs/planning.md shows other lines than:\n{err}"


def test_python_callers_get_keyword_arguments(graph: CostGraph) -> None:
    started = time.perf_counter()
    with pytest.raises(PlanDoesNotFitError) as info:
        partition_auto(graph, PROFILE, **OPTIONS)
    message = str(info.value)
    assert time.perf_counter() - started < SECONDS
    assert re.search(r'With (`memory=MemoryOptions\(recompute=True\)` and )?`schedule="1f1b"`, \d+ ', message), message
    assert "`memory=MemoryOptions(recompute=True)`" in message
    assert '`optimizer="adafactor"`' in message and "fewer `num_microbatches`" in message
    assert not re.search(r"--[a-z]", message), message
    assert len(re.findall(r"at least [\d.]+ GiB", message)) == 1


def test_pipe_trainer_gets_its_argument_names(graph: CostGraph, tmp_path) -> None:
    args = PipeTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=32,
        gpu_profile="rtx2080ti",
    )
    microbatch = {"input_ids": torch.empty(8, 1024, dtype=torch.long, device="meta")}
    with pytest.raises(PlanDoesNotFitError) as info:
        planning._compute_partition(args, SimpleNamespace(cost_graph=graph), PROFILE, microbatch)
    message = str(info.value)
    assert re.search(r'With (`activation_checkpointing=True` and )?`pipeline_schedule="1f1b"`, \d+ ', message), message
    assert "`activation_checkpointing=True`" in message
    assert "(`accelerate launch --num_processes" in message
    assert '`optim="adafactor"`' in message and "a smaller `per_device_train_batch_size`" in message
    assert "MemoryOptions(" not in message and "--recompute" not in message and "`schedule=" not in message
