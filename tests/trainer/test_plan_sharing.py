"""hf_ftpipe/trainer/plan_sharing.py: the plan rank 0 computes, as `PipeTrainingArguments` ask for it (no processes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.trainer import plan_sharing as planning

from toy_graphs import UNIT, chain

# Uneven ops: equal op counts (uniform, which auto runs first) balance them worse than seq-dp does.
GRAPH = SimpleNamespace(cost_graph=chain([3, 1, 4, 1, 5, 9, 2, 6]))
MICROBATCH = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}


def arguments(tmp_path: Path, **fields: object) -> PipeTrainingArguments:
    return PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)


def test_partition_time_budget_s_bounds_auto(tmp_path: Path) -> None:
    # A budget of 0 s: the first partitioner runs, every other is skipped; the default runs them all.
    profile = UNIT.with_count(2)
    hurried = planning._compute_partition(arguments(tmp_path, partition_time_budget_s=0), GRAPH, profile, MICROBATCH)
    assert hurried.partitioner == "uniform"
    planned = planning._compute_partition(arguments(tmp_path), GRAPH, profile, MICROBATCH)
    assert planned.partitioner != "uniform"
    assert planned.predicted.step_time_s < hurried.predicted.step_time_s


@pytest.mark.parametrize("budget", [-1.0, float("nan")])
def test_a_negative_time_budget_is_refused(tmp_path: Path, budget: float) -> None:
    with pytest.raises(ValueError, match="`partition_time_budget_s` .* must be at least 0"):
        arguments(tmp_path, partition_time_budget_s=budget)


def test_cost_table_measured_profiles_once_then_reads_the_cache(tmp_path: Path) -> None:
    from dataclasses import replace

    from cost_tables import roofline_table, tiny_gpt2_traced

    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.costmodel.measured import CostTable, cache_path

    traced = tiny_gpt2_traced(4)
    microbatch = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    profile = replace(get_profile("a100-80gb", count=2), link_latency_s=0.0, link_bandwidth_bytes_per_s=1e18)
    measured = planning._cost_table(arguments(tmp_path, cost_table="measured"), traced)
    path = cache_path(measured.key)
    assert measured.key.device == "cpu" and CostTable.load(path) == measured
    assert planning._cost_table(arguments(tmp_path, cost_table="measured"), traced) == measured  # from the cache
    # a table file: the plan is priced by it (a slow first layer moves the boundary the roofline's plan has)
    slow = roofline_table(traced.cost_graph, profile, slower={"transformer.h.0": 6.0})
    slow.save(tmp_path / "slow.json")
    by_table = planning._compute_partition(
        arguments(tmp_path, cost_table=str(tmp_path / "slow.json"), partitioner="seq-dp"), traced, profile, microbatch
    )
    by_roofline = planning._compute_partition(arguments(tmp_path, partitioner="seq-dp"), traced, profile, microbatch)
    assert by_table.node_stage != by_roofline.node_stage


def test_a_missing_cost_table_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`cost_table` is neither 'measured' nor a file: .*hf-ftpipe profile MODEL"):
        arguments(tmp_path, cost_table=str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    ("schedule", "stage_rank", "partitioner"),
    [
        ("1f1b", [0, 1], "seq-dp"),
        ("zbv", [0, 1, 1, 0], "seq-dp"),
        ("zb-h1", [0, 1], "auto"),
        ("zbv", [0, 1, 1, 0], "auto"),
    ],
    ids=["1f1b", "zbv", "zb-h1 file", "zbv file"],
)
def test_the_plan_has_the_placement_its_schedule_runs(
    tmp_path: Path, request: pytest.FixtureRequest, schedule: str, stage_rank: list[int], partitioner: str
) -> None:
    # A V by the schedule's trait, by name or from a file; a file's stages and ranks exactly, whatever auto picks.
    from hf_ftpipe.schedules import make_schedule

    if request.node.callspec.id.endswith("file"):
        (tmp_path / "order.txt").write_text(str(make_schedule(schedule, stage_rank, 4)), encoding="utf-8")
        schedule = str(tmp_path / "order.txt")
    args = arguments(tmp_path, pipeline_schedule=schedule, partitioner=partitioner)
    plan = planning._compute_partition(args, GRAPH, UNIT.with_count(2), MICROBATCH)
    assert plan.stage_device == stage_rank, plan.partitioner


def test_a_schedule_file_placed_as_no_partitioner_plans_asks_for_a_plan_file(tmp_path: Path) -> None:
    from hf_ftpipe.errors import PartitionError
    from hf_ftpipe.schedules import make_schedule

    (tmp_path / "order.txt").write_text(str(make_schedule("interleaved-1f1b", [0, 1, 0, 1], 4)), encoding="utf-8")
    args = arguments(tmp_path, pipeline_schedule=str(tmp_path / "order.txt"))
    with pytest.raises(
        PartitionError, match=r"places \[0, 1, 0, 1\]; the partitioners plan a chain .* `partition_file`"
    ):
        planning._compute_partition(args, GRAPH, UNIT.with_count(2), MICROBATCH)


def test_gpus_of_two_kinds_are_planned_position_by_position_and_refusals_name_what_to_use(tmp_path: Path) -> None:
    """The faster GPU of a pipeline takes more; the mixed partitioner and a V schedule refuse, naming what to use."""
    from dataclasses import replace

    from hf_ftpipe.errors import PartitionError

    slow = replace(UNIT, name="slow", peak_flops={d: f / 4 for d, f in UNIT.peak_flops.items()})
    gpus = [UNIT, slow]
    profile = replace(UNIT.with_count(2), name="unitx1+slowx1")  # as `pipeline_gpus` names it
    even = planning._compute_partition(arguments(tmp_path, partitioner="seq-dp"), GRAPH, UNIT.with_count(2), MICROBATCH)
    plan = planning._compute_partition(arguments(tmp_path, partitioner="seq-dp"), GRAPH, profile, MICROBATCH, gpus=gpus)
    assert plan.key.gpu_profile == "unitx1+slowx1"
    fast_share = sum(1 for stage in plan.node_stage.values() if plan.stage_device[stage] == 0)
    even_share = sum(1 for stage in even.node_stage.values() if even.stage_device[stage] == 0)
    assert fast_share > even_share  # the 4x faster GPU takes more of the chain
    with pytest.raises(PartitionError, match=r"mixes \['slow', 'unit'\]; use seq-dp or seq-greedy"):
        planning._compute_partition(arguments(tmp_path, partitioner="mixed"), GRAPH, profile, MICROBATCH, gpus=gpus)
    with pytest.raises(PartitionError, match=r"'zbv' runs a V placement.*\['unit', 'slow'\]; use a chain schedule"):
        planning._compute_partition(arguments(tmp_path, pipeline_schedule="zbv"), GRAPH, profile, MICROBATCH, gpus=gpus)
