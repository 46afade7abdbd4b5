"""Pipeline × data parallel layouts on paper: each P × D priced by hand on a toy model and topology."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_ftpipe.costmodel.topology import Link, Topology
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners.layouts import best_layout, compare_layouts

from toy_graphs import UNIT, chain, param

FAST = Link(name="fast", bandwidth_bytes_per_s=1e12, latency_s=0.0)


def four_ops():
    """n0 → n1 → n2 → n3, 10 FLOPs each (10 s forward on UNIT), each with its own 100-byte weight."""
    graph = chain([10, 10, 10, 10], params={f"w{i}": param(f"w{i}", (25,)) for i in range(4)})
    for i, node in enumerate(graph.graph.nodes):
        graph.graph.nodes[node]["params"] = (f"w{i}",)
    return graph


def two_nodes_of_two(network_bytes_per_s: float, memory_bytes: int = UNIT.memory_bytes) -> Topology:
    network = Link(name="network", bandwidth_bytes_per_s=network_bytes_per_s, latency_s=0.0)
    gpu = replace(UNIT, memory_bytes=memory_bytes)
    return Topology.uniform("toy", gpu, nodes=2, gpus_per_node=2, intra_node=FAST, inter_node=network)


def by_layout(results):
    return {r.layout: r for r in results}


def test_every_layout_is_priced_with_its_all_reduce_worked_out_by_hand() -> None:
    # Forward 10 s per op; backward 20 s per op with a weight, 10 s for the first (no input gradient).
    # A slow network (1 B/s) between the two nodes, 4 micro-batches of 1 sample, gpipe.
    results = by_layout(compare_layouts(four_ops(), two_nodes_of_two(1.0), num_microbatches=4, microbatch_size=1))
    assert list(results) == ["1x4", "2x2", "4x1"]
    # 1x4: each replica runs 1 micro-batch through the whole model (40 + 70 s), then all 400 bytes of
    # weights go round a ring of 4 ranks over 2 nodes: 2·3/4 × 400 B at 1 B/s = 600 s, all exposed.
    dp = results["1x4"]
    assert dp.pipelines == [[0], [1], [2], [3]]
    assert dp.pipeline_step_s == pytest.approx(110.0)
    assert dp.allreduce_s == [pytest.approx(600.0)]
    assert dp.samples_per_s == pytest.approx(4 / 710.0)
    # 2x2: pipelines [0, 1] and [2, 3] stay in their nodes. GPipe on 2 micro-batches: stage 0
    # forwards 0-20, 20-40; stage 1 forwards 20-40, 40-60, backwards (40 s) 60-100, 100-140;
    # stage 0 backwards (30 s) 100-130, 140-170. Each GPU all-reduces 200 bytes with its one
    # replica across the network (2·1/2 × 200 = 200 s) after its last backward: GPU 0 at 170 + 200.
    hybrid = results["2x2"]
    assert hybrid.pipelines == [[0, 1], [2, 3]] and not hybrid.crosses_nodes
    assert hybrid.pipeline_step_s == pytest.approx(170.0)
    assert hybrid.allreduce_s == [pytest.approx(200.0), pytest.approx(200.0)]
    assert hybrid.exposed_allreduce_s == pytest.approx(200.0)
    assert hybrid.samples_per_s == pytest.approx(4 / 370.0)
    # 4x1: one pipeline across both nodes, no all-reduce; its boundaries priced at the network.
    deep = results["4x1"]
    assert deep.crosses_nodes and deep.allreduce_s == [0.0] * 4
    assert best_layout(results.values()).layout == "4x1"
    assert deep.samples_per_s > hybrid.samples_per_s > dp.samples_per_s


def test_a_fast_network_makes_plain_data_parallelism_the_pick() -> None:
    results = compare_layouts(four_ops(), two_nodes_of_two(1e12), num_microbatches=4, microbatch_size=1)
    best = best_layout(results)
    assert best.layout == "1x4"
    assert best.samples_per_s == pytest.approx(4 / 110.0, rel=1e-6)


def test_a_layout_that_does_not_fit_says_so_and_the_rest_are_still_priced() -> None:
    # The whole model needs 1648 bytes on one GPU; 1000 bytes less 10% headroom is 900.
    results = by_layout(
        compare_layouts(four_ops(), two_nodes_of_two(1e12, memory_bytes=1000), num_microbatches=4, microbatch_size=1)
    )
    assert not results["1x4"].feasible
    assert "no plan of 1 GPUs fits" in results["1x4"].error and "900 bytes usable" in results["1x4"].error
    assert results["2x2"].feasible and results["4x1"].feasible
    assert best_layout(results.values()).layout == "2x2"


def test_layouts_that_cannot_run_are_refused_with_the_reason() -> None:
    results = by_layout(
        compare_layouts(four_ops(), two_nodes_of_two(1e12), num_microbatches=2, microbatch_size=1, schedule="async")
    )
    assert results["4x1"].feasible
    assert "async updates inside the pipeline" in results["2x2"].error
    results = by_layout(compare_layouts(four_ops(), two_nodes_of_two(1e12), num_microbatches=2, microbatch_size=1))
    assert results["1x4"].error == "2 micro-batches cannot be shared by 4 replicas: use a multiple of 4"
    with pytest.raises(PartitionError, match="layout 2x3 has 6 GPUs, topology 'toy' has 4"):
        compare_layouts(four_ops(), two_nodes_of_two(1.0), layouts=[(2, 3)], num_microbatches=4, microbatch_size=1)
