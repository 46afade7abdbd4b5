"""`simulate` on plans: from a plan file alone, from its graph, and with per-node costs (measured
ones plug in here), against values worked out by hand and the plan's own prediction."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import hf_ftpipe
from hf_ftpipe.costmodel.estimate import estimate
from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.plan import Partition, PartitionKey
from hf_ftpipe.simulator import PipelineCosts, StageEdge
from tests.helpers.toy_graphs import UNIT, chain, param

SHIPPED = Path(__file__).resolve().parents[2] / "partitions" / "t5-3b" / "rtx2080ti-x8-wic.json"
FAST_LINK = dataclasses.replace(UNIT, link_bandwidth_bytes_per_s=1e12)
"""1 FLOP/s: an op of f FLOPs takes f s forward and as long backward; messages nearly free."""


def toy_plan(schedule: str = "gpipe") -> tuple[Partition, object]:
    """Four 1-FLOP ops, two per stage on GPUs 0 and 1: each stage 2 s forward, 2 s backward."""
    graph = chain([1.0, 1.0, 1.0, 1.0])
    node_stage = {"n0": 0, "n1": 0, "n2": 1, "n3": 1}
    predicted = estimate(
        graph, node_stage, [0, 1], FAST_LINK, num_microbatches=4, microbatch_size=2, schedule=schedule, optimizer="sgd"
    )
    key = PartitionKey.from_graph(
        graph, dtype="float32", schedule=schedule, num_microbatches=4, gpu_profile="unit", num_gpus=2
    )
    return Partition(
        node_stage=node_stage, stage_device=[0, 1], partitioner="test", key=key, predicted=predicted
    ), graph


def test_a_plan_with_its_graph_simulates_its_roofline_times() -> None:
    plan, graph = toy_plan()
    result = hf_ftpipe.simulate(plan, graph=graph, profile=FAST_LINK)
    assert result.step_time_s == pytest.approx((4 + 2 - 1) * (2 + 2))  # (M + P - 1)(f + b)
    assert result.analytical_step_s == pytest.approx(4 * 4)  # M × the bottleneck, no fill or drain
    assert result.throughput_samples_per_s == pytest.approx(4 * 2 / 20)
    # The plan file alone gives the same timeline: its prediction recorded these times.
    alone = hf_ftpipe.simulate(plan, profile=FAST_LINK)
    assert [e.label for e in alone.events] == [e.label for e in result.events]
    assert [e.start_s for e in alone.events] == pytest.approx([e.start_s for e in result.events])


def test_per_node_costs_replace_the_roofline() -> None:
    # Measured costs that make n3 take 3 s forward: stage 1 runs 4 s forward. Worked out by hand:
    # rank 1's forwards at 2, 6, 10, 14 (each waits for the one before), backwards 18-26, rank 0's
    # backward m right after rank 1's: the last ends at 28.
    plan, graph = toy_plan()
    costs = dict(node_costs(graph, FAST_LINK))
    costs["n3"] = NodeCost(forward_s=3.0, backward_s=1.0)
    for with_graph in (graph, None):
        result = hf_ftpipe.simulate(plan, costs=costs, graph=with_graph, profile=FAST_LINK)
        rank1 = [(e.label, round(e.start_s, 6)) for e in result.events_of(1)]
        assert rank1[:4] == [("1F0", 2), ("1F1", 6), ("1F2", 10), ("1F3", 14)]
        assert result.step_time_s == pytest.approx(28)
        assert result.notes[0].startswith("times: the per-node costs given")
    with pytest.raises(PartitionError, match="no entry for 1 ops"):
        hf_ftpipe.simulate(plan, costs={k: v for k, v in costs.items() if k != "n2"}, profile=FAST_LINK)


def test_memory_follows_the_activations_held() -> None:
    # SGD, no parameters: nothing static; each stage keeps what its ops save (`memory_rules`) per
    # micro-batch from the start of its forward to the end of its backward.
    plan, graph = toy_plan()
    result = hf_ftpipe.simulate(plan, graph=graph, profile=FAST_LINK)
    rank0 = result.memory[0]
    held = rank0[1][1]
    assert held > 0 and [b for _, b in rank0[:5]] == [0, held, 2 * held, 3 * held, 4 * held]
    assert rank0[-1][1] == 0  # every activation given back at the flush
    # GPipe holds all four; the first backward adds its working memory on top: the peak.
    assert result.peak_memory_bytes[0] == rank0[5][1] > 4 * held


def test_a_shipped_plan_simulates_from_its_file_alone() -> None:
    plan = Partition.from_json(SHIPPED)  # T5-3B, WiC, 8 × RTX 2080 Ti, async, 8 micro-batches
    result = hf_ftpipe.simulate(plan)
    assert result.schedule == "async" and result.num_ranks == 8 and result.num_steps == 5
    # The steady step can be no shorter than the busiest GPU's work, M × its compute.
    busiest = max(g.compute_s for g in plan.predicted.gpus)
    assert result.step_time_s >= 8 * busiest - 1e-9
    assert result.analytical_step_s == pytest.approx(8 * plan.predicted.step_time_s)
    assert 0 < result.bubble_fraction < 0.5
    # Under the planned schedule, memory peaks at what the plan predicts per GPU.
    predicted = [g.memory_bytes for g in plan.predicted.gpus]
    assert result.peak_memory_bytes == pytest.approx(predicted, rel=1e-6)
    data = json.loads(result.to_json())
    assert data["step_time_s"] == result.step_time_s and len(data["events"]) == len(result.events)
    assert data["events"][0].keys() >= {"rank", "kind", "stage", "microbatch", "start_s", "end_s"}
    # gpipe on the same plan holds every micro-batch: more memory, and a fill and drain per step.
    gpipe = hf_ftpipe.simulate(plan, "gpipe")
    assert gpipe.step_time_s > result.step_time_s
    assert all(g >= a for g, a in zip(gpipe.peak_memory_bytes, result.peak_memory_bytes, strict=True))


def test_bad_requests_say_what_to_do() -> None:
    plan, _ = toy_plan()
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        hf_ftpipe.simulate(plan, "zb", profile=FAST_LINK)
    with pytest.raises(PartitionError, match="does not take token slices"):
        hf_ftpipe.simulate(plan, "async", profile=FAST_LINK, num_slices=2)
    with pytest.raises(PartitionError, match="pass `profile=`"):
        hf_ftpipe.simulate(plan)  # "unit" is no built-in profile
    with pytest.raises(PartitionError, match="carries no prediction"):
        hf_ftpipe.simulate(dataclasses.replace(plan, predicted=None), profile=FAST_LINK)
    with pytest.raises(PartitionError, match="`backward_s` has 1 entries for 2 stages"):
        PipelineCosts(stage_rank=[0, 1], forward_s=[1.0, 1.0], backward_s=[1.0], edges=[])
    with pytest.raises(PartitionError, match="stage edge 1->0 must go forward"):
        PipelineCosts(stage_rank=[0, 1], forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], edges=[StageEdge(1, 0, 8, 8)])


def test_a_split_backward_gives_w_half_the_backward_of_the_products_it_defers() -> None:
    # n1 is a linear layer and n3 a layer norm, each with a trainable weight, so the roofline gives
    # their backward 2 s (input and weight gradient, 1 FLOP each) and the others 1 s: each stage's
    # backward is 3 s. The runtime defers only a product's weight gradient to W: stage 0's W is half
    # of n1's backward, 1 s, and B the other 2 s; the layer norm's weight trains in B, so stage 1's
    # B is all 3 s and its W takes no time.
    graph = chain(
        [
            1.0,
            {"flops": 1.0, "params": ("w1",), "op": "aten.linear.default"},
            1.0,
            {"flops": 1.0, "params": ("w3",), "op": "aten.native_layer_norm.default"},
        ],
        params={"w1": param("w1", (2, 2)), "w3": param("w3", (2,))},
    )
    plan, _ = toy_plan("zb-h1")
    result = hf_ftpipe.simulate(plan, graph=graph, profile=FAST_LINK, schedule="zb-h1")
    took = {e.label: e.end_s - e.start_s for e in result.events}
    assert took["0B0"] == pytest.approx(2) and took["0W0"] == pytest.approx(1)
    assert took["1B3"] == pytest.approx(3) and took.get("1W3", 0.0) == pytest.approx(0)
    assert result.memory[0][-1][1] == result.memory[0][0][1]  # W gave back what B kept
