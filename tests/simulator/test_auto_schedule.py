"""zb-auto: the zero-bubble order timed by the plan's stage costs, checked by the simulator and run from its file."""

from __future__ import annotations

from pathlib import Path

from hf_ftpipe.schedules import check_order, make_schedule
from hf_ftpipe.simulator import PipelineCosts, StageEdge, auto_schedule, simulate_costs


def pipeline(stage_rank: list[int], forward_s: list[float]) -> PipelineCosts:
    """A chain on ``stage_rank``, each backward twice its forward (W half of it), free links."""
    edges = [StageEdge(s, s + 1, 8, 8) for s in range(len(stage_rank) - 1)]
    return PipelineCosts(stage_rank=stage_rank, forward_s=forward_s, backward_s=[2 * f for f in forward_s], edges=edges)


def test_on_unequal_stages_zb_auto_is_faster_than_zb_h1_and_runs_from_its_file(tmp_path: Path) -> None:
    # A Mixed-Pipe-like V with unequal stages: rank 0 runs stages 0 and 3 (1 s and 1 s forward),
    # rank 1 stages 1 and 2 (2 s and 0.5 s). Timed by these costs, the order leaves 61 s a step
    # against zb-h1's 62 s (unit costs) and 1f1b's 63.5 s, simulated.
    costs = pipeline([0, 1, 1, 0], [1.0, 2.0, 0.5, 1.0])
    schedule, result = auto_schedule(costs, 8)
    assert schedule.name == "zb-auto" and schedule.traits.split_backward
    check_order(schedule.global_order(), [0, 1, 1, 0], schedule.edges, range(8), split_backward=True)
    assert result.step_time_s == 61 < simulate_costs(costs, "zb-h1", 8).step_time_s == 62
    path = tmp_path / "zb-auto.txt"
    path.write_text(str(schedule), encoding="utf-8")
    assert simulate_costs(costs, str(path), 8).step_time_s == 61  # what runs is what was simulated
    assert simulate_costs(costs, "zb-auto", 8).step_time_s == 61  # the name simulates the order built for the costs


def test_on_equal_stages_zb_auto_is_zb_h1s_order() -> None:
    costs = pipeline([0, 1], [1.0, 1.0])
    schedule, result = auto_schedule(costs, 4)
    # Equal stages of F 1 s, B 1 s, W 1 s are zb-h1's unit costs: the same order, 13 s.
    assert str(schedule) == str(make_schedule("zb-h1", [0, 1], 4))
    assert result.step_time_s == 13


def test_zb_auto_without_stage_costs_is_zb_h1s_order_which_prices_its_plans() -> None:
    # What the partitioners and the memory rules walk for a `zb-auto` plan, before its costs are known.
    schedule = make_schedule("zb-auto", [0, 1], 4)
    assert schedule.name == "zb-auto" and schedule.traits.split_backward and schedule.traits.flushes
    assert str(schedule) == (
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3\n"
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3"
    )
