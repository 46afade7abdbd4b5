"""`auto` on toy partitioners: keeps the best feasible plan, reports all, says what would fit."""

from __future__ import annotations

import dataclasses

import pytest

from hf_ftpipe.costmodel.estimate import MemoryOptions, estimate
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import registry
from hf_ftpipe.partitioners.auto import (
    PartitionerResult,
    best_result,
    compare_partitioners,
    partition_auto,
    result_of,
    simulate_results,
)
from hf_ftpipe.plan.partition import Partition, PartitionKey

from toy_graphs import UNIT, chain, param

ARGS = {"num_microbatches": 2, "microbatch_size": 1}


def heavy_chain(param_bytes: int = 0):
    """8 ops of 100 FLOP (transfers of 16 bytes hide behind them); with ``param_bytes``, each op
    reads its own weight of that size."""
    graph = chain([100.0] * 8)
    if param_bytes:
        graph.params = {f"w{i}": param(f"w{i}", (param_bytes // 4,)) for i in range(8)}
        for i in range(8):
            graph.graph.nodes[f"n{i}"]["params"] = (f"w{i}",)
    return graph


def toy_partitioner(name: str, place):
    """A partitioner putting op i (of n) on GPU ``place(i, n, num_gpus)``, one stage per GPU used,
    that refuses plans over the usable memory as real ones do."""

    def partition(graph, profile, num_stages=None, *, num_microbatches, microbatch_size, memory=None, **_):
        memory = memory or MemoryOptions()
        order = graph.topological_order()
        node_stage = {n: place(i, len(order), profile.count) for i, n in enumerate(order)}
        stage_device = list(range(max(node_stage.values()) + 1))
        predicted = estimate(
            graph, node_stage, stage_device, profile, num_microbatches=num_microbatches, microbatch_size=microbatch_size
        )
        usable = profile.memory_bytes * (1 - memory.headroom)
        if any(g.memory_bytes > usable for g in predicted.gpus):
            raise PartitionError(f"{name}: a GPU needs more than {usable:.0f} bytes")
        key = PartitionKey.from_graph(
            graph,
            dtype="float32",
            schedule="gpipe",
            num_microbatches=num_microbatches,
            gpu_profile=profile.name,
            num_gpus=profile.count,
        )
        return Partition(
            node_stage=node_stage, stage_device=stage_device, partitioner=name, key=key, predicted=predicted
        )

    return partition


@pytest.fixture
def toys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the toys (and auto itself) are registered during the test."""
    monkeypatch.setattr(
        registry,
        "_PARTITIONERS",
        {
            "auto": partition_auto,
            "one-gpu": toy_partitioner("one-gpu", lambda i, n, gpus: 0),
            "even": toy_partitioner("even", lambda i, n, gpus: i * gpus // n),
        },
    )


@pytest.mark.usefixtures("toys")
def test_auto_keeps_the_fastest_feasible_plan_and_reports_every_partitioner() -> None:
    report: list[PartitionerResult] = []
    plan = partition_auto(heavy_chain(), UNIT, **ARGS, report=report)
    assert plan.partitioner == "even" and plan.stage_device == [0, 1, 2, 3]
    assert sorted(r.partitioner for r in report) == ["even", "one-gpu"]  # never itself
    by_name = {r.partitioner: r for r in report}
    assert all(r.feasible and r.error is None for r in report)
    assert by_name["even"].worst_over_ideal < by_name["one-gpu"].worst_over_ideal
    assert by_name["even"].throughput_samples_per_s > by_name["one-gpu"].throughput_samples_per_s
    assert by_name["even"].stages_per_gpu == [1, 1, 1, 1] and by_name["one-gpu"].stages_per_gpu == [1]
    assert set(by_name["even"].to_dict()) >= {
        "partitioner",
        "feasible",
        "throughput_samples_per_s",
        "worst_over_ideal",
        "max_memory_fraction",
        "num_stages",
        "stages_per_gpu",
        "time_s",
    }
    assert "partition" not in by_name["even"].to_dict()


@pytest.mark.usefixtures("toys")
def test_a_spent_time_budget_skips_the_rest_but_runs_the_first() -> None:
    results = compare_partitioners(heavy_chain(), UNIT, **ARGS, time_budget_s=0.0)
    assert [r.skipped for r in results] == [False, True]
    assert "time budget" in results[1].error and not results[1].feasible


@pytest.mark.usefixtures("toys")
def test_plan_over_memory_is_infeasible_and_the_error_says_what_would_fit() -> None:
    # 8 weights of 2000 bytes, ×4 with gradients and Adam state: 16 kB per GPU on 4 GPUs, over the
    # 9 kB usable (10 kB less 10 %); on 8 GPUs each holds 8 kB.
    with pytest.raises(PartitionError) as error:
        partition_auto(heavy_chain(param_bytes=2000), UNIT, **ARGS)
    message = str(error.value)
    assert "no partitioner found a plan that fits 4 × unit" in message
    assert "  - one-gpu: a GPU needs more than" in message and "  - even: a GPU" in message
    # The leanest contiguous split holds 2 weights a GPU, 16 kB with gradients and Adam state: / 0.9
    leanest = "It would fit on GPUs of at least 17885 bytes each (the leanest contiguous split needs 16096 bytes"
    assert leanest in message
    assert "It would fit on 8 × unit (`profile.with_count(8)`), the fewest that a contiguous split fits." in message
    assert "`memory=MemoryOptions(recompute=True)`" in message and "--" not in message  # the partition API's words


@pytest.mark.usefixtures("toys")
def test_a_plan_that_breaks_memory_without_raising_is_infeasible_too() -> None:
    registry._PARTITIONERS["sloppy"] = toy_partitioner("sloppy", lambda i, n, gpus: 0)
    big = heavy_chain(param_bytes=2000)
    results = compare_partitioners(big, UNIT.with_count(8), **ARGS, memory=MemoryOptions(headroom=0.0))
    by_name = {r.partitioner: r for r in results}
    assert by_name["even"].feasible
    assert not by_name["one-gpu"].feasible and by_name["one-gpu"].partition is None


def test_ties_go_to_the_plan_with_less_memory() -> None:
    def result(name: str, step: float, memory: float, feasible: bool = True) -> PartitionerResult:
        return PartitionerResult(
            partitioner=name, feasible=feasible, time_s=0.1, step_time_s=step, max_memory_fraction=memory
        )

    results = [result("a", 1.0, 0.9), result("b", 1.0, 0.5), result("c", 0.5, 0.1, feasible=False)]
    assert best_result(results).partitioner == "b"
    assert best_result([result("c", 0.5, 0.1, feasible=False)]) is None


def test_rank_by_simulated_keeps_the_plan_whose_simulated_step_is_shortest() -> None:
    # Four 1-FLOP ops (1 s forward, 1 s backward each), one micro-batch, 16-byte values over 8 B/s
    # (2 s a message). Split over two GPUs the slowest GPU computes 4 s and hides its 2 s messages
    # (analytical 4 s), but one micro-batch cannot overlap them: 2 + 2 + 2 (loss, then gradient
    # back: 2 + 2 + 2) = 12 s simulated. On one GPU: 8 s either way.
    graph = chain([1.0, 1.0, 1.0, 1.0])
    profile = dataclasses.replace(UNIT.with_count(2), link_bandwidth_bytes_per_s=8.0)
    args = {"num_microbatches": 1, "microbatch_size": 1, "optimizer": "sgd"}

    def planned(name: str, node_stage: dict[str, int], stage_device: list[int]) -> PartitionerResult:
        key = PartitionKey.from_graph(graph, dtype="float32", schedule="gpipe", num_microbatches=1, gpu_profile="unit",
                                      num_gpus=2)  # fmt: skip
        plan = Partition(node_stage=node_stage, stage_device=stage_device, partitioner=name, key=key,
                         predicted=estimate(graph, node_stage, stage_device, profile, **args))  # fmt: skip
        return result_of(name, plan, 0.0)

    split = planned("split", {"n0": 0, "n1": 0, "n2": 1, "n3": 1}, [0, 1])
    whole = planned("whole", dict.fromkeys(["n0", "n1", "n2", "n3"], 0), [0])
    assert (split.step_time_s, whole.step_time_s) == (4.0, 8.0)
    assert best_result([split, whole]).partitioner == "split"
    simulate_results([split, whole], profile)
    assert split.simulated_step_s == pytest.approx(12.0) and whole.simulated_step_s == pytest.approx(8.0)
    assert best_result([split, whole], "simulated").partitioner == "whole"
    with pytest.raises(PartitionError, match="unknown `rank_by` 'fastest'"):
        partition_auto(graph, profile, rank_by="fastest", **args)
