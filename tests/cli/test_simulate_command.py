"""`hf-ftpipe simulate`: the table per rank, the JSON, and the timeline it draws (file and data)."""

from __future__ import annotations

import json

import pytest

from hf_ftpipe.cli.timeline_plot import COLORS, plot_timeline
from hf_ftpipe.plan import Partition
from hf_ftpipe.simulator import PipelineCosts, StageEdge, simulate, simulate_costs, timeline_bars
from tests.cli.test_plans import MIXED_PLAN, PAPER_PLAN, PNG_SIGNATURE, run, table_rows

pytest.importorskip("matplotlib")


def test_simulate_prints_a_row_per_rank_and_draws_the_timeline(tmp_path) -> None:
    image = tmp_path / "timeline.png"
    code, out, err = run("simulate", str(PAPER_PLAN), "--schedule", "1f1b", "--plot", str(image))
    assert code == 0, err
    expected = simulate(Partition.from_json(PAPER_PLAN), "1f1b")
    assert f"1f1b, 8 micro-batches: step {expected.step_time_s * 1e3:.1f} ms" in out
    assert (
        f"analytical (cost model, 8 × the slowest GPU, no fill or drain): {expected.analytical_step_s * 1e3:.1f}" in out
    )
    rows = table_rows(out, "rank")
    assert [row[0] for row in rows] == [str(r) for r in range(8)]
    assert [float(row[1]) for row in rows] == pytest.approx([b * 1e3 for b in expected.busy_s], abs=0.06)
    assert image.read_bytes()[:8] == PNG_SIGNATURE and f"wrote {image}" in out


def test_simulate_json_is_the_whole_result() -> None:
    code, out, err = run("simulate", str(MIXED_PLAN), "--json", "--num-microbatches", "4")
    assert code == 0, err
    data = json.loads(out)
    assert data["num_microbatches"] == 4 and data["schedule"] == Partition.from_json(MIXED_PLAN).key.schedule
    assert data["bubble_fraction"] == pytest.approx(1 - sum(data["busy_s"]) / (data["num_ranks"] * data["step_time_s"]))
    assert {e["kind"] for e in data["events"]} >= {"F", "B"} and len(data["memory"]) == data["num_ranks"]


def test_simulate_names_a_bad_request() -> None:
    code, _, err = run("simulate", str(PAPER_PLAN), "--schedule", "async", "--token-slices", "2")
    assert code == 2 and "does not take token slices" in err


def test_the_plot_draws_every_action_and_every_gap(tmp_path) -> None:
    # gpipe, 2 ranks × 4 micro-batches, forward 1 s, backward 2 s (the literal timeline of
    # tests/simulator/test_timelines.py): read back from the figure, each box where it belongs.
    costs = PipelineCosts(stage_rank=[0, 1], forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], edges=[StageEdge(0, 1, 8, 8)])
    result = simulate_costs(costs, "gpipe", 4)
    drawn = plot_timeline(result, tmp_path / "gantt.png")
    assert (tmp_path / "gantt.png").read_bytes()[:8] == PNG_SIGNATURE
    assert drawn == timeline_bars(result)
    rank0 = [(b.kind, b.start_s, b.duration_s, b.text) for b in drawn if b.rank == 0]
    assert rank0 == [
        ("F", 0, 1, "0"), ("F", 1, 1, "1"), ("F", 2, 1, "2"), ("F", 3, 1, "3"),
        ("idle", 4, 3, ""),  # waiting for rank 1's first backward
        ("B", 7, 2, "0"), ("B", 9, 2, "1"), ("B", 11, 2, "2"), ("B", 13, 2, "3"),
    ]  # fmt: skip
    rank1 = [(b.kind, b.start_s, b.duration_s) for b in drawn if b.rank == 1]
    assert rank1[0] == ("idle", 0, 1) and rank1[-1] == ("idle", 13, 2)
    assert set(COLORS) >= {b.kind for b in drawn}


def test_the_plot_of_a_shipped_plan_draws_its_bars(tmp_path) -> None:
    result = simulate(Partition.from_json(MIXED_PLAN), "1f1b", num_microbatches=2)  # GPUs with several stages
    drawn = plot_timeline(result, tmp_path / "mixed.png", title="mixed")
    expected = timeline_bars(result)
    assert [(b.rank, b.kind) for b in drawn] == [(b.rank, b.kind) for b in expected]
    assert [b.start_s for b in drawn] == pytest.approx([b.start_s for b in expected], abs=1e-6)
    for rank in range(result.num_ranks):  # the boxes of a row tile it from 0 to the step's end
        row = [b for b in drawn if b.rank == rank]
        assert sum(b.duration_s for b in row) == pytest.approx(result.step_time_s, rel=1e-6)


def test_show_puts_the_simulated_step_beside_the_analytical_one() -> None:
    expected = simulate(Partition.from_json(PAPER_PLAN))  # the plan's own schedule, async
    code, out, err = run("show", str(PAPER_PLAN), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["simulated_step_ms"] == pytest.approx(expected.step_time_s * 1e3)
    assert summary["analytical_step_ms"] == pytest.approx(8 * summary["step_time_ms"])
    assert summary["simulated_bubble"] == pytest.approx(expected.bubble_fraction)
    code, out, err = run("show", str(PAPER_PLAN))
    assert f"simulated: {expected.step_time_s * 1e3:.1f} ms per step of 8 micro-batches" in out


def test_rank_by_is_for_auto_only() -> None:
    code, _, err = run("partition", "t5-3b", "--gpus", "2", "--gpu-profile", "rtx2080ti", "--batch-size", "1",
                       "--seq-len", "8", "--partitioner", "seq-dp", "--rank-by", "simulated")  # fmt: skip
    assert code == 2 and "--rank-by chooses among auto's candidates" in err


def test_write_zb_auto_writes_the_order_that_simulates_as_printed(tmp_path) -> None:
    # The Mixed-Pipe plan: zb-auto is timed by its stages' recorded times; the file runs as a schedule.
    order = tmp_path / "zb-auto.txt"
    code, out, err = run("simulate", str(MIXED_PLAN), "--write-zb-auto", str(order), "--json")
    assert code == 0, err
    data = json.loads(out)
    plan = Partition.from_json(MIXED_PLAN)
    from_file = simulate(plan, str(order))
    assert data["step_time_s"] == pytest.approx(from_file.step_time_s)
    assert data["step_time_s"] <= simulate(plan, "zb-h1").step_time_s
    assert data["schedule"] in ("zb-auto", "zb-h1") and f"wrote {order}" in err
