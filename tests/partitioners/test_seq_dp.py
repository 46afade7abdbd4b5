"""Seq-dp: the exact contiguous optimum under memory, checked against brute force."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.costmodel import MemoryOptions, estimate, gpu_cost_s, usable_capacity
from hf_ftpipe.costmodel.op_time import comm_time_s, node_costs
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import get_partitioner, partition_seq_dp, partition_seq_greedy
from hf_ftpipe.partitioners.contiguous import CutOrder
from hf_ftpipe.partitioners.seq_dp import contiguous_fit
from hf_ftpipe.plan import validate_partition

from toy_graphs import UNIT, chain, make_graph, param, random_dags


def _objective(graph, node_stage, profile, *, memory, **sizes) -> tuple[float, int]:
    """(bottleneck, largest stage memory) of a contiguous plan under seq-dp's objective: FTPipe's
    cost of each stage, a value that leaves a stage sent once; memory from ``estimate``."""
    num_stages = max(node_stage.values()) + 1
    costs = node_costs(graph, profile)
    plan = estimate(graph, node_stage, list(range(num_stages)), profile, **sizes, memory=memory)
    again = 1.0 if memory.recompute else 0.0
    worst = 0.0
    for s in range(num_stages):
        nodes = [n for n, t in node_stage.items() if t == s]
        compute = math.fsum(costs[n].total_s + again * costs[n].forward_s for n in nodes)
        leaving = [u for u in nodes if any(node_stage[v] != s for v in graph.graph.successors(u))]
        out = sum(graph.node(u)["output_bytes"] for u in leaving)
        grads = sum(graph.node(u)["output_bytes"] for u in leaving if graph.node(u)["requires_grad"])
        worst = max(worst, gpu_cost_s(compute, comm_time_s(out, profile), comm_time_s(grads, profile)))
    return worst, max(stage.memory_bytes for stage in plan.stages)


def _brute_force(graph, num_stages, profile, *, memory, **sizes) -> tuple[float, int]:
    """(best bottleneck among plans that fit, or inf; smallest largest-stage memory of any plan)."""
    cut_order = CutOrder.of(graph)
    best, least = math.inf, math.inf
    for cuts in itertools.combinations(range(1, len(cut_order.cuttable)), num_stages - 1):
        node_stage = cut_order.node_stage([0, *cuts, len(cut_order.cuttable)])
        bottleneck, need = _objective(graph, node_stage, profile, memory=memory, **sizes)
        least = min(least, need)
        if need <= usable_capacity(profile, memory):
            best = min(best, bottleneck)
    return best, least


def test_chain_optimum_by_hand():
    # Each op: 2 FLOP → 2 s forward + 2 s backward. n2 sends 100 B (100 s each way at 1 B/s).
    graph = make_graph(
        {f"n{i}": {"flops": 2.0, "output_bytes": 100 if i == 2 else 1} for i in range(6)},
        [(f"n{i}", f"n{i + 1}") for i in range(5)],
    )
    sizes = {"num_microbatches": 1, "microbatch_size": 1}
    greedy = partition_seq_greedy(graph, UNIT, 2, **sizes)
    assert greedy.nodes_of(0) == ["n0", "n1", "n2"]  # 12 s + (100 − 12) s twice: 188 s
    assert greedy.predicted.step_time_s == 188.0
    plan = partition_seq_dp(graph, UNIT, 2, **sizes)
    assert plan.nodes_of(0) == ["n0", "n1"]  # 8 s | 16 s: cuts on either side of n2 tie at 16 s
    assert plan.predicted.step_time_s == 16.0 and plan.partitioner == "seq-dp"
    validate_partition(plan, graph)


def test_memory_limit_moves_the_cut():
    # w (AdamW: 400 B weights + 400 grad + 800 state) on n0; 16 B saved per op. 1F1B keeps the
    # gradient for the step; stage 0 of 2 holds 2 of the 4 micro-batches, each its saved bytes
    # and its 16 B output, and its backward works with 2 × 16 B.
    graph = chain([8, 1, 1, 1, 1, 1], params={"w": param("w", (10, 10))})
    graph.graph.nodes["n0"]["params"] = ("w",)
    sizes = {"num_microbatches": 4, "microbatch_size": 1, "schedule": "1f1b"}
    free = partition_seq_dp(graph, UNIT, 2, **sizes)
    assert free.nodes_of(0) == ["n0"]  # 16 s | 10 s
    alone = 1600 + (16 + 16) * 2 + 32
    tight = replace(UNIT, memory_bytes=alone)  # n0 alone fits, n0 + n1 ((32 + 16) × 2 + 32) does not
    assert partition_seq_dp(graph, tight, 2, **sizes, memory=MemoryOptions(headroom=0)).nodes_of(0) == ["n0"]
    # n0 alone needs 1696 B as the first of 2 stages, and 1664 B as the last stage of any pipeline
    # (1 micro-batch in flight): no number of GPUs helps
    with pytest.raises(PartitionError) as info:
        partition_seq_dp(graph, replace(UNIT, memory_bytes=1600), 2, **sizes, memory=MemoryOptions(headroom=0))
    message = str(info.value)
    assert "no contiguous split into 2 stages fits the 1600 bytes usable per GPU" in message
    assert f"the best split needs {alone} bytes on its fullest GPU" in message
    assert f"It would fit on GPUs of at least {alone} bytes each" in message
    last = 1600 + (16 + 16) + 32
    assert (
        f"No number of unit fits: `n0` alone needs {last} bytes on a GPU of its own with 1 micro-batch in "
        "flight (the fewest it can hold)"
    ) in message


def test_infeasible_names_the_gpu_count_that_fits():
    # A stage of n ops holds 16 n B saved, its 16 B output and 2 × 16 B of backward working tensors.
    graph = chain([1] * 8)
    sizes = {"num_microbatches": 1, "microbatch_size": 1}
    small = replace(UNIT, count=2, memory_bytes=80)  # 2 ops per GPU at most
    exact = MemoryOptions(headroom=0)
    with pytest.raises(PartitionError) as info:
        partition_seq_dp(graph, small, 2, **sizes, memory=exact)
    assert "needs 112 bytes" in str(info.value) and "It would fit on 4 × unit" in str(info.value)
    partition_seq_dp(graph, small.with_count(4), **sizes, memory=exact)  # the count named fits, one fewer does not
    with pytest.raises(PartitionError):
        partition_seq_dp(graph, small.with_count(3), **sizes, memory=exact)
    with pytest.raises(PartitionError, match=r"GPUs of at least 140 bytes each \(.*plus 20% headroom\)"):
        partition_seq_dp(graph, small, 2, **sizes, memory=MemoryOptions(headroom=0.2))


def test_getitems_stay_with_their_producer():
    graph = make_graph(
        {
            "a": 4.0,
            "split": {"flops": 1.0, "output_shapes": ((2,), (2,))},
            "part0": {"op": "getitem", "output_bytes": 1},
            "part1": {"op": "getitem", "output_bytes": 1},
            "b": 4.0,
        },
        [("a", "split"), ("split", "part0"), ("split", "part1"), ("part0", "b"), ("part1", "b")],
    )
    plan = partition_seq_dp(graph, UNIT, 3, num_microbatches=1, microbatch_size=1)
    assert plan.node_stage["part0"] == plan.node_stage["part1"] == plan.node_stage["split"] == 1
    validate_partition(plan, graph)


def test_coarsened_long_chain_is_valid_and_near_exact():
    graph = chain([float((i * 7919) % 97 + 1) for i in range(1200)])
    profile = replace(UNIT, count=8, memory_bytes=10**9)
    sizes = {"num_microbatches": 4, "microbatch_size": 1}
    coarse = partition_seq_dp(graph, profile, **sizes, max_blocks=128)
    validate_partition(coarse, graph)
    exact = partition_seq_dp(graph, profile, **sizes, max_blocks=1200).predicted.step_time_s
    assert exact <= coarse.predicted.step_time_s <= exact * 1.005
    assert exact <= partition_seq_greedy(graph, profile, **sizes).predicted.step_time_s


def test_registered_and_checks_max_blocks():
    assert get_partitioner("seq-dp") is partition_seq_dp
    with pytest.raises(PartitionError, match="`max_blocks` must be a positive integer, got 0"):
        partition_seq_dp(chain([1, 1]), UNIT, 2, num_microbatches=1, microbatch_size=1, max_blocks=0)


@settings(max_examples=150, deadline=None)
@given(
    graph=random_dags(max_nodes=9),
    num_stages=st.integers(2, 3),
    schedule=st.sampled_from(["gpipe", "1f1b", "async", "2bw"]),
    optimizer=st.sampled_from(["sgd", "adamw", "adafactor"]),
    recompute=st.booleans(),
    accumulation=st.integers(1, 3),
    capacity=st.integers(100, 3000),
)
def test_equals_brute_force(graph, num_stages, schedule, optimizer, recompute, accumulation, capacity):
    profile = replace(UNIT, memory_bytes=capacity)
    memory = MemoryOptions(headroom=0, recompute=recompute, gradient_accumulation_steps=accumulation)
    sizes = {"num_microbatches": 3, "microbatch_size": 1}
    args = {"schedule": schedule, "optimizer": optimizer}
    best, least = _brute_force(graph, num_stages, profile, memory=memory, **sizes, **args)
    if math.isinf(best):
        with pytest.raises(PartitionError, match=f"the best split needs {least} bytes on its fullest GPU"):
            partition_seq_dp(graph, profile, num_stages, **sizes, **args, memory=memory)
        return
    plan = partition_seq_dp(graph, profile, num_stages, **sizes, **args, memory=memory)
    validate_partition(plan, graph, memory_capacity_bytes=capacity)
    assert _objective(graph, plan.node_stage, profile, memory=memory, **sizes, **args)[0] == best


CONTIGUOUS = ["seq-greedy", "uniform", "params", "seq-dp"]


@settings(max_examples=60, deadline=None)
@given(
    graph=random_dags(max_nodes=9),
    schedule=st.sampled_from(["gpipe", "1f1b", "async", "2bw", "zb-h1"]),
    recompute=st.booleans(),
    capacity=st.integers(100, 3000),
)
def test_contiguous_fit_names_the_fewest_gpus_seq_dp_fits(graph, schedule, recompute, capacity):
    # Not assumed monotone: under 1F1B a longer pipeline holds more micro-batches on its first stages.
    profile = replace(UNIT, count=2, memory_bytes=capacity)
    sizes = {"num_microbatches": 3, "microbatch_size": 1, "schedule": schedule}
    memory = MemoryOptions(headroom=0, recompute=recompute)

    def fits(count: int) -> bool:
        try:
            partition_seq_dp(graph, profile.with_count(count), **sizes, memory=memory)
        except PartitionError:
            return False
        return True

    counts = range(1, len(CutOrder.of(graph).cuttable) + 1)
    fit = contiguous_fit(graph, profile, **sizes, memory=memory)
    assert fit.num_gpus == next((n for n in counts if fits(n)), None)
    assert fit.fits_count == fits(2)
    if fit.num_gpus is None:
        assert fit.piece and fit.piece_bytes > capacity


@settings(max_examples=60, deadline=None)
@given(
    graph=random_dags(max_nodes=14, max_stages=4),
    num_stages=st.integers(1, 4),
    schedule=st.sampled_from(["gpipe", "1f1b", "async", "2bw"]),
    recompute=st.booleans(),
    capacity=st.integers(200, 5000),
)
def test_every_contiguous_plan_is_valid_and_fits(graph, num_stages, schedule, recompute, capacity):
    profile = replace(UNIT, memory_bytes=capacity)
    memory = MemoryOptions(headroom=0.1, recompute=recompute)
    sizes = {"num_microbatches": 3, "microbatch_size": 1, "schedule": schedule, "memory": memory}
    try:
        best = partition_seq_dp(graph, profile, num_stages, **sizes)
    except PartitionError:
        best = None  # no contiguous plan fits: neither may any other
    for name in CONTIGUOUS:
        try:
            plan = get_partitioner(name)(graph, profile, num_stages, **sizes)
        except PartitionError:
            assert name != "seq-dp" or best is None
            continue
        assert best is not None, f"{name} fits where seq-dp found nothing"
        validate_partition(plan, graph, memory_capacity_bytes=capacity, memory=memory)
        order = [plan.node_stage[n] for n in graph.topological_order()]
        assert plan.stage_device == list(range(num_stages)) and set(order) == set(range(num_stages))
        cut_order = CutOrder.of(graph)
        along = [plan.node_stage[n] for n in cut_order.cuttable]
        assert along == sorted(along)  # contiguous along the execution order


@settings(max_examples=60, deadline=None)
@given(flops=st.lists(st.integers(0, 100), min_size=4, max_size=20), num_stages=st.integers(2, 4))
def test_on_chains_seq_dp_is_never_slower(flops, num_stages):
    # On a chain every value goes to the next stage only: the DP's objective is estimate's.
    graph = chain(flops)
    profile = replace(UNIT, memory_bytes=10**6)
    sizes = {"num_microbatches": 2, "microbatch_size": 1}
    best = partition_seq_dp(graph, profile, num_stages, **sizes).predicted.step_time_s
    for name in CONTIGUOUS:
        assert best <= get_partitioner(name)(graph, profile, num_stages, **sizes).predicted.step_time_s


def test_a_v_placement_is_asked_for_and_balances_its_2p_stages():
    # 8 ops of 2 FLOP (2 s forward, 2 s backward each) on the 4 GPUs of UNIT: a V has 8 stages,
    # one op each, stage s on GPU min(s, 7 − s).
    graph = chain([2.0] * 8)
    sizes = {"num_microbatches": 4, "microbatch_size": 1, "schedule": "zbv"}
    plan = partition_seq_dp(graph, UNIT, placement="v", **sizes)
    assert plan.stage_device == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [len(plan.nodes_of(s)) for s in range(8)] == [1] * 8
    validate_partition(plan, graph)
    with pytest.raises(PartitionError, match=r"a V placement has 2 stages per GPU: num_stages must be 8 .* got 4"):
        partition_seq_dp(graph, UNIT, 4, placement="v", **sizes)
    with pytest.raises(PartitionError, match=r"mixed partitioner chooses its own placement .* placement='v'"):
        get_partitioner("mixed")(graph, UNIT, placement="v", **sizes)
    with pytest.raises(PartitionError, match=r"unknown `placement` 'u'; choose one of \['chain', 'v'\]"):
        partition_seq_dp(graph, UNIT, placement="u", **sizes)
