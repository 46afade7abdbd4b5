"""`hf-ftpipe partition` and `hf-ftpipe compare` on the shipped T5-3B config, offline.

T5-3B is traced once for the session (planning_graphs: several seconds); every command line reuses
that graph. The two commands of docs/planning.md ("Planning from the command line") run here as
the page writes them, and so does its Python plan of the same setup ("Inspecting a plan before
spending GPU hours"), on that graph: its `trace_model` call gets the session's trace of the same
model at the same shapes instead of tracing again.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import hf_ftpipe
from hf_ftpipe.cli import parser as cli
from hf_ftpipe.graph import load_model_for_planning
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.registry import available_partitioners
from hf_ftpipe.plan import Partition, validate_partition

from doc_blocks import expected_output, missing_output, page_block, page_command
from planning_graphs import cli_traces, planning_graph

# FTPipe's BoolQ setting: micro-batch 4, input 512, target 4, on 8 RTX 2080 Ti.
T5_BOOLQ = ["t5-3b", "--gpus", "8", "--gpu-profile", "rtx2080ti", "--batch-size", "4", "--seq-len", "512"]
T5_BOOLQ += ["--target-len", "4", "--schedule", "async"]
# The page's commands, less "hf-ftpipe": the same setup, with what makes it fit (recompute, Adafactor, 8 micro-batches).
COMPARE = page_command("docs/planning.md", "hf-ftpipe compare t5-3b")[1:]
PARTITION = page_command("docs/planning.md", "hf-ftpipe partition t5-3b")[1:]
KEYS = {
    "partitioner",
    "feasible",
    "throughput_samples_per_s",
    "worst_over_ideal",
    "max_memory_fraction",
    "num_stages",
    "stages_per_gpu",
    "time_s",
}


@pytest.fixture(scope="module")
def traces() -> Iterator[None]:
    """Offline, and every trace of one model and shape made once (the first command line traces)."""
    with cli_traces():
        yield


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.usefixtures("traces")
def test_compare_json_has_one_row_per_registered_partitioner() -> None:
    assert COMPARE[:2] == ["compare", "t5-3b"] and set(T5_BOOLQ) <= set(COMPARE)
    code, out, err = run(*COMPARE, "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert sorted(row["partitioner"] for row in rows) == available_partitioners()  # auto included
    for row in rows:
        assert KEYS <= set(row), row["partitioner"]
    auto = next(row for row in rows if row["partitioner"] == "auto")
    feasible = [row for row in rows if row["feasible"] and row["partitioner"] != "auto"]
    assert auto["feasible"] and auto["chosen"] in {row["partitioner"] for row in feasible}
    assert auto["throughput_samples_per_s"] == max(row["throughput_samples_per_s"] for row in feasible)
    assert all(row["max_memory_fraction"] <= 0.9 for row in feasible)
    # Beside each prediction, the simulated step of its schedule: no shorter than the analytical one.
    assert all(row["simulated_step_s"] >= row["analytical_step_s"] * (1 - 1e-9) for row in feasible)


@pytest.mark.usefixtures("traces")
def test_compare_prints_a_table_and_says_what_would_fit_when_nothing_does() -> None:
    # Without recomputation T5-3B is too big for 8 GPUs; a short budget keeps the search for what fits short.
    code, out, _ = run("compare", *T5_BOOLQ, "--time-budget-s", "1")
    assert code == 0
    assert out.splitlines()[1].split()[:3] == ["partitioner", "fits", "samples/s"]
    assert "auto: no partitioner found a plan that fits 8 × rtx2080ti" in out and "It would fit on" in out


@pytest.mark.usefixtures("traces")
def test_partition_writes_a_plan_that_loads_and_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert PARTITION[:2] == ["partition", "t5-3b"] and PARTITION[-2:] == ["-o", "t5-3b-8x2080ti.json"]
    path = tmp_path / "plan.json"
    code, out, err = run(*PARTITION[:-2], "--partitioner", "seq-dp", "-o", str(path))
    assert code == 0, err
    assert "partitioner: seq-dp" in out and f"wrote {path}" in out
    plan = Partition.from_json(path)
    graph = planning_graph("t5-3b", 4, 512, 4)
    validate_partition(plan, graph, memory_capacity_bytes=11 * 2**30)
    assert plan.key.schedule == "async" and plan.key.num_gpus == 8 and plan.key.input_shapes["labels"] == [4, 4]

    monkeypatch.chdir(tmp_path)  # the page's command writes t5-3b-8x2080ti.json where it runs
    code, out, _ = run(*PARTITION, "--json")
    summary = json.loads(out)
    assert code == 0 and summary["chosen_by_auto"] and len(summary["gpus"]) == summary["num_gpus"] == 8
    validate_partition(Partition.from_json(tmp_path / "t5-3b-8x2080ti.json"), graph, memory_capacity_bytes=11 * 2**30)


@pytest.mark.usefixtures("traces")
def test_nothing_fits_is_exit_status_2_with_what_would_fit() -> None:
    code, out, err = run("partition", *T5_BOOLQ, "--time-budget-s", "1")
    assert code == 2 and out == ""
    assert "error: no partitioner found a plan that fits" in err and "It would fit on" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--partitioner", "magic"], "unknown partitioner 'magic'; choose one of ['auto',"),
        (["--gpu-profile", "gtx-480"], "unknown GPU profile 'gtx-480'; use one of ["),
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--headroom", "1.5"], "`headroom`"),
    ],
)
def test_user_errors_are_exit_status_2_with_the_valid_choices(change: list[str], message: str) -> None:
    argv = [*T5_BOOLQ]
    for flag, value in zip(change[::2], change[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    code, out, err = run("partition", *argv)
    assert code == 2 and out == "" and message in err, err
    assert "Traceback" not in err


@pytest.mark.usefixtures("traces")
def test_an_unknown_model_lists_the_names_that_work_offline() -> None:
    code, _, err = run("compare", "someone/no-such-model", *T5_BOOLQ[1:])
    assert code == 2
    assert "cannot find model 'someone/no-such-model' offline" in err and "bert-large, gpt2-xl, t5-3b" in err


def test_argparse_errors_and_help() -> None:
    code, _, err = run("compare", *T5_BOOLQ, "--schedule", "zero-bubble")
    assert code == 2 and "invalid choice: 'zero-bubble'" in err
    result = subprocess.run([sys.executable, "-m", "hf_ftpipe", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "partition" in result.stdout and "compare" in result.stdout


@pytest.mark.usefixtures("traces")
def test_partition_asked_for_a_v_placement_puts_two_stages_on_each_gpu() -> None:
    v = ["--partitioner", "seq-dp", "--placement", "v", "--schedule", "zbv", "--json"]
    # Recomputed, each stage of the V holds what W reads of all 8 micro-batches at some moment of
    # zbv's order (docs/memory.md): more than the 9.9 GiB of an RTX 2080 Ti, which seq-dp says.
    code, _, err = run(*PARTITION[:-2], *v)
    assert code == 2 and "no contiguous split into 16 stages fits the 9.90 GiB usable per GPU" in err, err
    assert "half of it per stage in a V" in err and "e.g. l4" in err
    on_l4 = ["l4" if arg == "rtx2080ti" else arg for arg in PARTITION[:-2]]
    code, out, err = run(*on_l4, *v)
    assert code == 0, err
    summary = json.loads(out)
    # 16 stages in a V on 8 GPUs: GPU g runs stages g and 15 − g; the GPU's check sums the two.
    assert summary["num_stages"] == 16 and [g["stages"] for g in summary["gpus"]] == [[g, 15 - g] for g in range(8)]
    assert summary["max_memory_fraction"] <= 0.9


def test_the_pages_python_plan_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block = page_block("docs/planning.md", "graph = trace_model(model, microbatch)")
    shipped = load_model_for_planning("t5-3b").config.to_dict()
    traced: list[dict[str, tuple[int, ...]]] = []

    def trace_model(model: object, microbatch: dict) -> CostGraph:
        """The session's trace of what the page traces: the shipped T5-3B on meta, at its shapes."""
        assert type(model).__name__ == "T5ForConditionalGeneration" and model.config.to_dict() == shipped
        assert all(p.is_meta for p in model.parameters())
        traced.append({name: tuple(value.shape) for name, value in microbatch.items()})
        return planning_graph("t5-3b", 4, 512, 4)

    monkeypatch.setattr(hf_ftpipe, "trace_model", trace_model)
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__main__"})
    assert traced == [{"input_ids": (4, 512), "labels": (4, 4)}]
    printed = capsys.readouterr().out
    missing = missing_output(expected_output(block), printed)
    assert not missing, f"{block.where} did not print these lines of the page:\n" + "\n".join([*missing, printed])
    plan = Partition.from_json(tmp_path / "t5-3b-8x2080ti.json")
    assert plan.partitioner == "seq-dp" and plan.key.num_gpus == 8
