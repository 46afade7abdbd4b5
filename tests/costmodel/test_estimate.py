"""estimate: FTPipe's cost of a GPU (CCO) on hand-computed examples, the choices and options it
checks, and the capacity it plans against. The memory of a GPU is tests/costmodel/test_memory_estimate.py."""

from __future__ import annotations

import pytest

from hf_ftpipe.costmodel import MemoryOptions, estimate, gpu_cost_s, usable_capacity
from hf_ftpipe.errors import PartitionError

from toy_graphs import UNIT, chain, make_graph


def test_cco_two_gpus_hand_computed():
    # a (10 FLOP) → b (5) → c (5); UNIT: 1 FLOP/s, parameter-free ops cost as much backward,
    # 1 B/s links without latency. Stage 0 = {a} on GPU 0, stage 1 = {b, c} on GPU 1.
    graph = make_graph({"a": {"flops": 10.0, "output_bytes": 30}, "b": 5.0, "c": 5.0}, [("a", "b"), ("b", "c")])
    plan = estimate(graph, {"a": 0, "b": 1, "c": 1}, [0, 1], UNIT, num_microbatches=4, microbatch_size=8)
    gpu0, gpu1 = plan.gpus
    assert (gpu0.compute_s, gpu1.compute_s) == (20.0, 20.0)  # 10 + 10 backward; 2 × (5 + 5)
    # GPU 0 sends 30 B forward (30 s) and receives their 30 B of gradients back (30 s):
    # each is 10 s longer than the 20 s of compute it hides behind.
    assert (gpu0.comm_fwd_out_s, gpu0.comm_bwd_in_s) == (30.0, 30.0)
    assert gpu0.cost_s == 20.0 + 10.0 + 10.0
    assert gpu1.cost_s == 20.0  # receiving forward and sending backward are the sender's cost
    assert plan.stages[1].comm_fwd_in_s == 30.0 and plan.stages[1].comm_bwd_out_s == 30.0
    assert plan.step_time_s == 40.0
    assert plan.ideal_step_time_s == 40.0 / UNIT.count  # 4 GPUs in the profile
    assert plan.throughput_samples_per_s == 8 / 40.0


def test_cco_hides_communication_shorter_than_compute():
    graph = make_graph({"a": {"flops": 10.0, "output_bytes": 15}, "b": 10.0}, [("a", "b")])
    plan = estimate(graph, {"a": 0, "b": 1}, [0, 1], UNIT, num_microbatches=1, microbatch_size=1)
    assert [g.cost_s for g in plan.gpus] == [20.0, 20.0]
    assert gpu_cost_s(20.0, 15.0, 25.0) == 25.0


def test_gradients_only_for_outputs_that_require_grad():
    mask = {"flops": 1.0, "requires_grad": False, "output_bytes": 50}
    graph = make_graph({"mask": mask, "b": 1.0}, [("mask", "b")])
    plan = estimate(graph, {"mask": 0, "b": 1}, [0, 1], UNIT, num_microbatches=1, microbatch_size=1)
    assert plan.gpus[0].comm_fwd_out_s == 50.0 and plan.gpus[0].comm_bwd_in_s == 0.0


def test_output_sent_once_per_destination_stage_and_not_within_a_gpu():
    # a feeds b and c (both stage 1, GPU 1) and d (stage 2, back on GPU 0)
    graph = make_graph({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, [("a", "b"), ("a", "c"), ("a", "d"), ("c", "d")])
    node_stage = {"a": 0, "b": 1, "c": 1, "d": 2}
    plan = estimate(graph, node_stage, [0, 1, 0], UNIT, num_microbatches=1, microbatch_size=1)
    assert [s.fwd_out_bytes for s in plan.stages] == [16, 16, 0]  # a → stage 1 once; c → 2
    assert [s.fwd_in_bytes for s in plan.stages] == [0, 16, 16]  # a → d stays on GPU 0
    assert [g.comm_fwd_out_s for g in plan.gpus] == [16.0, 16.0]


def test_stage_edges_are_the_stage_graph_with_bytes_same_gpu_included():
    # a (stage 0) feeds b and c (stage 1) once and d (stage 2) directly; c feeds d. Stages 0 and
    # 2 share GPU 0: their edge carries no traffic but is still part of the stage graph.
    graph = make_graph(
        {"a": 1.0, "b": 1.0, "c": {"flops": 1.0, "output_bytes": 40}, "d": 1.0},
        [("a", "b"), ("a", "c"), ("a", "d"), ("c", "d")],
    )
    plan = estimate(graph, {"a": 0, "b": 1, "c": 1, "d": 2}, [0, 1, 0], UNIT, num_microbatches=1, microbatch_size=1)
    assert plan.stage_edges == [[0, 1, 16], [0, 2, 16], [1, 2, 40]]


def test_unknown_choices_list_the_valid_ones():
    graph, sizes = chain([1]), {"num_microbatches": 1, "microbatch_size": 1}
    with pytest.raises(PartitionError, match=r"unknown `optimizer` 'lamb'; use one of \['sgd'"):
        estimate(graph, {"n0": 0}, [0], UNIT, **sizes, optimizer="lamb")
    with pytest.raises(PartitionError, match="unknown `schedule` 'zb'"):
        estimate(graph, {"n0": 0}, [0], UNIT, **sizes, schedule="zb")
    with pytest.raises(PartitionError, match="in no stage"):
        estimate(chain([1, 1]), {"n0": 0}, [0], UNIT, **sizes)
    with pytest.raises(PartitionError, match="`num_microbatches` must be a positive integer"):
        estimate(graph, {"n0": 0}, [0], UNIT, num_microbatches=0, microbatch_size=1)


def test_headroom_capacity_and_memory_fraction():
    graph = chain([1, 1])
    plan = estimate(graph, {"n0": 0, "n1": 1}, [0, 1], UNIT, num_microbatches=10, microbatch_size=1)
    assert [g.capacity_bytes for g in plan.gpus] == [10_000, 10_000]  # raw
    assert plan.max_memory_fraction == ((16 + 16) * 10 + 32) / 10_000
    assert plan.worst_over_ideal == plan.imbalance
    assert usable_capacity(UNIT) == 9_000  # 10% headroom by default
    assert usable_capacity(UNIT, MemoryOptions(headroom=0.25)) == 7_500
    assert usable_capacity(UNIT, MemoryOptions(headroom=0)) == 10_000


def test_memory_options_are_checked():
    with pytest.raises(PartitionError, match=r"`headroom` .* in \[0, 1\), got 1.5"):
        MemoryOptions(headroom=1.5)
    with pytest.raises(PartitionError, match="`gradient_accumulation_steps` must be a positive integer"):
        MemoryOptions(gradient_accumulation_steps=0)
