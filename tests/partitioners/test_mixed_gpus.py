"""GPUs of different kinds in one plan: each stage priced on its own GPU, balanced by each GPU's speed
and kept within each GPU's memory; checked against brute force over every split of a small chain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_ftpipe.costmodel import Link, Node, Topology, estimate
from hf_ftpipe.costmodel.options import MemoryOptions
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import partition_auto, partition_mixed, partition_seq_dp, partition_seq_greedy
from hf_ftpipe.partitioners.layouts import compare_layouts, position_profile
from hf_ftpipe.plan.validate import validate_partition
from hf_ftpipe.simulator import simulate

from toy_graphs import UNIT, chain, param

# UNIT's GPU (1 FLOP/s) and one twice as fast; a link so fast that only compute counts.
SLOW = replace(UNIT, name="slow", count=1, link_bandwidth_bytes_per_s=1e15)
FAST = replace(SLOW, name="fast", peak_flops={"float32": 2.0})
OPTIONS = {"num_microbatches": 1, "microbatch_size": 1}


def ops_per_gpu(plan) -> list[int]:
    return [sum(1 for s in plan.node_stage.values() if plan.stage_device[s] == g) for g in range(plan.num_devices)]


def brute_force(graph, gpus) -> float:
    """The smallest predicted step over every contiguous split of ``graph``'s chain onto ``gpus`` in order."""
    names = list(graph.graph.nodes)
    best = float("inf")

    def splits(start: int, left: int):
        if left == 1:
            yield [len(names)]
            return
        for end in range(start + 1, len(names) - left + 2):
            for rest in splits(end, left - 1):
                yield [end, *rest]

    for ends in splits(0, len(gpus)):
        node_stage = {n: next(s for s, end in enumerate(ends) if i < end) for i, n in enumerate(names)}
        predicted = estimate(
            graph, node_stage, list(range(len(gpus))), SLOW.with_count(len(gpus)), gpus=gpus, **OPTIONS
        )
        best = min(best, predicted.step_time_s)
    return best


def test_a_gpu_twice_as_fast_gets_twice_the_layers_worked_out_by_hand() -> None:
    # Six ops of 10 FLOPs without weights: 10 s forward + 10 s backward each on the slow GPU, half
    # that on the fast one. k ops on the fast GPU: max(10 k, 20 (6 − k)) is least at k = 4 (40 s).
    graph = chain([10.0] * 6)
    for gpus, expected in (([FAST, SLOW], [4, 2]), ([SLOW, FAST], [2, 4])):
        profile = SLOW.with_count(2)
        for partitioner in (partition_seq_dp, partition_seq_greedy, partition_auto):
            plan = partitioner(graph, profile, gpu_profiles=gpus, **OPTIONS)
            assert ops_per_gpu(plan) == expected, partitioner.__name__
            assert plan.predicted.step_time_s == pytest.approx(40.0)
        assert brute_force(graph, gpus) == pytest.approx(40.0)
    # One kind of GPU: the same model splits 3 + 3 (60 s on two slow GPUs).
    assert ops_per_gpu(partition_seq_dp(graph, SLOW.with_count(2), **OPTIONS)) == [3, 3]


@pytest.mark.parametrize("flops", [[30, 10, 10, 40, 20, 10, 50], [5, 60, 5, 5, 20, 30, 10, 10]])
def test_seq_dp_and_auto_match_brute_force_over_every_split(flops: list[int]) -> None:
    graph = chain([float(f) for f in flops])
    medium = replace(SLOW, name="medium", peak_flops={"float32": 1.5})
    for gpus in ([FAST, SLOW], [SLOW, FAST], [SLOW, FAST, medium], [FAST, medium, SLOW]):
        optimum = brute_force(graph, gpus)
        profile = SLOW.with_count(len(gpus))
        assert partition_seq_dp(graph, profile, gpu_profiles=gpus, **OPTIONS).predicted.step_time_s == pytest.approx(
            optimum
        )
        assert partition_auto(graph, profile, gpu_profiles=gpus, **OPTIONS).predicted.step_time_s == pytest.approx(
            optimum
        )


def test_each_gpu_keeps_within_its_own_memory() -> None:
    # Each op holds a 100-byte weight. The fast GPU would take 4 ops, but give it memory for 3 only:
    # the plan keeps it within its own memory and gives the slow GPU (more memory) the rest.
    graph = chain([10.0] * 6, params={f"w{i}": param(f"w{i}", (25,)) for i in range(6)})
    for i, node in enumerate(graph.graph.nodes):
        graph.graph.nodes[node]["params"] = (f"w{i}",)
    headroom = MemoryOptions().headroom

    def need(fast_ops: int) -> int:  # the fast GPU's predicted bytes with its first ``fast_ops`` ops
        node_stage = {n: int(i >= fast_ops) for i, n in enumerate(graph.graph.nodes)}
        predicted = estimate(graph, node_stage, [0, 1], SLOW.with_count(2), gpus=[FAST, SLOW], **OPTIONS)
        return predicted.gpus[0].memory_bytes

    assert need(3) < need(4)
    small_fast = replace(FAST, memory_bytes=int((need(3) + need(4)) / 2 / (1 - headroom)))
    gpus = [small_fast, SLOW]
    for partitioner in (partition_seq_dp, partition_auto):
        plan = partitioner(graph, SLOW.with_count(2), gpu_profiles=gpus, **OPTIONS)
        assert ops_per_gpu(plan) == [3, 3], partitioner.__name__
        assert [g.capacity_bytes for g in plan.predicted.gpus] == [small_fast.memory_bytes, SLOW.memory_bytes]
        validate_partition(
            plan, graph, memory_capacity_bytes=[gpu.memory_bytes for gpu in gpus], memory=MemoryOptions()
        )
    # seq-greedy balances speed alone: its 4 + 2 split does not fit, and it says which GPU is over.
    with pytest.raises(PartitionError, match="GPU 0 .* of its .* usable"):
        partition_seq_greedy(graph, SLOW.with_count(2), gpu_profiles=gpus, **OPTIONS)


def test_what_plans_for_one_kind_of_gpu_refuses_mixed_ones_and_says_what_to_use() -> None:
    graph = chain([10.0] * 6)
    with pytest.raises(PartitionError, match=r"mixed partitioner balances stages for one kind of GPU.*use seq-dp"):
        partition_mixed(graph, SLOW.with_count(2), gpu_profiles=[FAST, SLOW], **OPTIONS)
    with pytest.raises(PartitionError, match="use placement='chain' with GPUs of several kinds"):
        partition_seq_dp(graph, SLOW.with_count(2), gpu_profiles=[FAST, SLOW], placement="v", **OPTIONS)
    with pytest.raises(PartitionError, match="`gpu_profiles` lists 2 GPUs, profile 'slow' has count 3"):
        partition_seq_dp(graph, SLOW.with_count(3), gpu_profiles=[FAST, SLOW], **OPTIONS)


def test_a_mixed_topology_plans_each_pipeline_for_its_own_gpus() -> None:
    # Ranks 0-1 fast, 2-3 slow, in one box. 4x1: one pipeline over all four, the fast GPUs take more.
    # 2x2: position g runs on a fast GPU in replica 0 and a slow one in replica 1, so it is planned
    # for the weaker of the two (every replica runs the same plan): two slow GPUs, 3 + 3.
    link = Link(name="fast-link", bandwidth_bytes_per_s=1e15, latency_s=0.0)
    box = Topology(name="box", nodes=(Node(gpus=(FAST, FAST, SLOW, SLOW), link=link),), inter_node=link)
    graph = chain([10.0] * 6)
    results = {r.layout: r for r in compare_layouts(graph, box, **(OPTIONS | {"num_microbatches": 4}))}
    assert ops_per_gpu(results["4x1"].partition) == [2, 2, 1, 1]
    assert ops_per_gpu(results["2x2"].partition) == [3, 3]
    assert position_profile([FAST, SLOW]).effective_flops_per_s() == 1.0
    assert position_profile([FAST, FAST]) == FAST
    assert all(r.feasible for r in results.values())


def test_the_simulator_times_each_stage_on_its_own_gpu() -> None:
    # The 4 + 2 plan of the first test, one micro-batch under gpipe: the fast GPU forwards its 4 ops
    # in 20 s, the slow one its 2 in 20 s, then backwards of 20 s each: an 80 s step, from the plan's
    # recorded prediction or from the graph with each GPU's profile. Timed as two slow GPUs: 120 s.
    graph = chain([10.0] * 6)
    profile = SLOW.with_count(2)
    plan = partition_seq_dp(graph, profile, gpu_profiles=[FAST, SLOW], **OPTIONS)
    assert simulate(plan, profile=profile).step_time_s == pytest.approx(80.0)
    assert simulate(plan, graph=graph, profile=profile, gpu_profiles=[FAST, SLOW]).step_time_s == pytest.approx(80.0)
    assert simulate(plan, graph=graph, profile=profile).step_time_s == pytest.approx(120.0)
