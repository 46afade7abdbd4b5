"""Every documented command and snippet works as written: README.md, docs/*.md, benchmarks/README.md.

Each ```bash and ```python block runs here, or is run by the test its marker names, or says why it
cannot run here (the markers: tests/helpers/doc_blocks.py, docs/development.md). The blocks that run
here run in one process, offline, each in a folder of its own (tests/helpers/doc_runner.py); a
```text block marked ``output`` must be what the block above prints. Python blocks also compile
and name only real `PipeTrainingArguments` fields; a GPU command of an example script sets what
its preset sets and is planned on CPU for its GPUs; every relative link resolves.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments

from doc_blocks import (
    KINDS,
    REPO,
    RUNNABLE,
    SKIP_REASONS,
    Block,
    Marker,
    all_blocks,
    argv,
    expected_output,
    missing_output,
    pages,
    parse_blocks,
)
from example_modules import EXAMPLES, load_example
from planning_graphs import SessionGraphs

BLOCKS = all_blocks()
RUN_HERE = [b for b in BLOCKS if b.runs_here]
PRESET_COMMANDS = [b for b in BLOCKS if b.marker("preset")]
RUNNER_DEADLINE_S = 240.0
IGNORED_BY_PRESETS = {"output_dir", "logging_steps", "report_to", "save_strategy", "use_cpu"}
"""Arguments a documented GPU command may set apart from its preset: where results go and what is logged."""


def _ids(block: Block) -> str:
    return block.where


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.markers or b.language in RUNNABLE], ids=_ids)
def test_every_block_runs_here_or_says_why(block: Block) -> None:
    for marker in block.markers:
        assert marker.kind in KINDS, f"{block.where}: unknown marker {marker.kind!r}; use one of {KINDS}"
        if marker.kind == "skip":
            assert marker.argument in SKIP_REASONS and marker.why, (
                f"{block.where}: `docs-test: skip REASON: why`, REASON one of {SKIP_REASONS}, got {marker}"
            )
        elif marker.kind == "run-by":
            test = REPO / marker.argument
            assert test.is_file() and test.name.startswith("test_"), f"{block.where}: no test file {marker.argument}"
            assert block.page in test.read_text(encoding="utf-8"), (
                f"{block.where}: {marker.argument} must read this block from {block.page} (doc_blocks.page_command)"
            )
        elif marker.kind == "preset":
            assert (EXAMPLES / "presets" / f"{marker.argument}.json").is_file(), f"{block.where}: no such preset"
        elif marker.kind == "output":
            assert block.language == "text", f"{block.where}: `docs-test: output` belongs on a ```text block"
    if block.marker("output"):
        before = [b for b in BLOCKS if b.page == block.page and b.line < block.line]
        assert before and before[-1].language in RUNNABLE, f"{block.where}: an output block follows the block it shows"
    if block.language in RUNNABLE:
        assert block.text.strip(), f"{block.where}: empty block"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every block that runs here, in one runner process: its results by block."""
    folder = tmp_path_factory.mktemp("docs")
    blocks = [
        {"where": b.where, "language": b.language, "text": b.text, "commands": b.command_lines()} for b in RUN_HERE
    ]
    (folder / "blocks.json").write_text(json.dumps(blocks), encoding="utf-8")
    results = folder / "results.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(folder / "hf_home"), "MPLBACKEND": "Agg"}
    started = time.monotonic()
    command = [sys.executable, str(REPO / "tests" / "helpers" / "doc_runner.py"), str(folder / "blocks.json")]
    try:
        runner = subprocess.run(
            [*command, str(results)], capture_output=True, text=True, timeout=RUNNER_DEADLINE_S, env=env, cwd=folder
        )
        failure = "" if runner.returncode == 0 else runner.stdout[-3000:] + runner.stderr[-5000:]
    except subprocess.TimeoutExpired as timeout:  # the results of the blocks that finished say which one hung
        failure = f"the blocks did not finish within {RUNNER_DEADLINE_S:g} s: {timeout}"
    done = json.loads(results.read_text()) if results.exists() else []
    timings = ", ".join(f"{r['where']} {r['seconds']:.1f} s" for r in done)
    print(f"documentation blocks: {time.monotonic() - started:.1f} s ({timings})")
    assert not failure, f"{failure}\nfinished: {timings}"
    return {r["where"]: r for r in done}


@pytest.mark.parametrize("block", RUN_HERE, ids=_ids)
def test_the_block_runs_as_written(block: Block, ran: dict[str, dict]) -> None:
    result = ran[block.where]
    assert result["ok"], f"{block.where} failed:\n{result['output'][-6000:]}"
    missing = missing_output(expected_output(block), result["output"])
    assert not missing, (
        f"{block.where} did not print these lines of the page:\n"
        + "\n".join(missing)
        + (f"\n\nIt printed:\n{result['output'][-6000:]}")
    )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=_ids)
def test_python_blocks_compile_and_name_real_arguments(block: Block) -> None:
    tree = ast.parse(block.text, filename=block.where)  # a SyntaxError names the line
    fields = {f.name for f in dataclasses.fields(PipeTrainingArguments)}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "PipeTrainingArguments":
            unknown = {k.arg for k in call.keywords if k.arg is not None} - fields
            assert not unknown, f"{block.where}: PipeTrainingArguments has no field {sorted(unknown)}"


@pytest.mark.parametrize("block", PRESET_COMMANDS, ids=_ids)
def test_a_gpu_command_sets_what_its_preset_sets_and_fits_its_gpus(block: Block) -> None:
    name = block.marker("preset").argument
    reproduce = load_example("reproduce_paper")
    preset = reproduce.read_preset(name)
    (line,) = block.command_lines()
    words = argv(line)
    script_at = next(i for i, word in enumerate(words) if word.endswith(".py"))
    assert words[:2] == ["accelerate", "launch"] and Path(words[script_at]).name == preset["_script"], block.where
    launch = words[2:script_at]
    assert launch[launch.index("--num_processes") + 1] == str(preset["_num_processes"]), block.where

    flags = words[script_at + 1 :]
    preset_keys = {key for key in preset if not key.startswith("_")} - IGNORED_BY_PRESETS
    given = {flag[2:] for flag in flags if flag.startswith("--")}
    assert given <= preset_keys | IGNORED_BY_PRESETS, f"{block.where}: not in {name}: {sorted(given - preset_keys)}"
    command = _parse(preset["_script"], flags)
    expected = _parse(preset["_script"], [str(reproduce.PRESETS / f"{name}.json")])
    differ = {key: (command[key], expected[key]) for key in preset_keys if command[key] != expected[key]}
    assert not differ, f"{block.where} differs from preset {name} (command, preset): {differ}"

    # Planned as `reproduce_paper.py --dry-run` plans it, by seq-dp: the memory-aware contiguous
    # partitioner that `auto` always runs, so a plan that fits here is one `auto` can keep.
    graphs, quick = SessionGraphs(), {**preset, "partitioner": "seq-dp"}
    row = reproduce.plan_preset(name, quick, graphs)
    assert row.planned != "does not fit", f"{block.where}: {name} does not fit {preset['_num_processes']} GPUs"
    # docs/examples.md: T5-3B and GPT2-XL need the recomputation the presets ask for
    without = reproduce.plan_preset(name, {**quick, "activation_checkpointing": False}, graphs)
    assert (without.planned == "does not fit") == name.startswith(("t5-3b", "gpt2-xl")), (name, without.planned)


def _parse(script: str, arguments: list[str]) -> dict[str, object]:
    """Every field of ``script``'s argument dataclasses, parsed from ``arguments`` as the script parses them."""
    module = load_example(script.removesuffix(".py"))
    parser = HfArgumentParser((module.ModelArguments, module.DataTrainingArguments, PipeTrainingArguments))
    common = load_example("common")
    parsed = common.parse_arguments(parser, module.default_arguments(), arguments)
    return {f.name: getattr(p, f.name) for p in parsed for f in dataclasses.fields(p)}


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", pages())
def test_relative_links_resolve(page: str) -> None:
    text = (REPO / page).read_text(encoding="utf-8")
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path if path else REPO / page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


PAGE = """Some text.

<!-- a note for people -->
<!-- docs-test: skip GPU: needs 8 GPUs -->
```bash
accelerate launch --num_processes 8 x.py \\
    --flag 1  # why
hf-ftpipe slices gpt2 [--json] --gpus 2
```

- a list item

  ```python
  print("hi")
  ```

  <!-- docs-test: output -->
  ```text
  hi
  ```
"""


def test_blocks_markers_and_commands_are_read_as_a_reader_reads_them() -> None:
    bash, python, text = parse_blocks("page.md", PAGE)
    assert (bash.line, bash.language, bash.markers) == (5, "bash", (Marker("skip", "GPU", "needs 8 GPUs"),))
    assert not bash.runs_here and python.runs_here and not text.runs_here
    assert bash.command_lines() == [
        "accelerate launch --num_processes 8 x.py --flag 1",
        "hf-ftpipe slices gpt2 [--json] --gpus 2",
    ]
    assert argv(bash.command_lines()[1]) == ["hf-ftpipe", "slices", "gpt2", "--gpus", "2"]
    assert python.text == 'print("hi")\n' and text.marker("output") == Marker("output")
    assert missing_output(["a", "c"], "a\nb\nc\n") == [] and missing_output(["c", "a"], "a\nb\nc\n") == ["a"]


def test_the_runner_reports_a_block_that_fails_as_failed(tmp_path: Path) -> None:
    blocks = [
        {"where": "ok.md:1", "language": "bash", "text": "", "commands": ["echo fine"]},
        {"where": "bash.md:1", "language": "bash", "text": "", "commands": ["echo one", "false", "echo never"]},
        {"where": "python.md:1", "language": "python", "text": "raise SystemExit(3)\n", "commands": []},
    ]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks), encoding="utf-8")
    runner = REPO / "tests" / "helpers" / "doc_runner.py"
    subprocess.run(
        [sys.executable, str(runner), str(tmp_path / "blocks.json"), str(tmp_path / "out.json")], check=True, timeout=60
    )
    ok, bash, python = json.loads((tmp_path / "out.json").read_text())
    assert ok["ok"] and "fine" in ok["output"]
    assert not bash["ok"] and "one" in bash["output"] and "never" not in bash["output"]
    assert not python["ok"] and "SystemExit: 3" in python["output"]
