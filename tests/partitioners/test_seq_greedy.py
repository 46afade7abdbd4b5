"""Seq-greedy: contiguous, balanced, topologically numbered stages, on chains and random DAGs."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.costmodel import MemoryOptions
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import get_partitioner, greedy_cuts, partition_seq_greedy
from hf_ftpipe.plan import validate_partition

from toy_graphs import UNIT, chain, make_graph


def _stages(partition) -> list[list[str]]:
    return [partition.nodes_of(s) for s in range(partition.num_stages)]


def _loads(partition, graph) -> list[float]:
    return [sum(graph.node(n)["flops"] for n in nodes) for nodes in _stages(partition)]


def test_uniform_chain_splits_evenly():
    graph = chain([1] * 8)
    plan = partition_seq_greedy(graph, UNIT, num_microbatches=4, microbatch_size=2)
    assert _stages(plan) == [["n0", "n1"], ["n2", "n3"], ["n4", "n5"], ["n6", "n7"]]
    assert plan.stage_device == [0, 1, 2, 3] and plan.partitioner == "seq-greedy"
    # 4 s compute; 16 B out and 16 B of gradients in at 1 B/s exceed it by 12 s each: 28 s vs 4 s
    assert plan.predicted.imbalance == pytest.approx(28 / 4)


def test_uneven_chain_cuts_nearer_side():
    graph = chain([3, 1, 4, 1, 5, 9, 2, 6])  # total 31; targets 15.5
    plan = partition_seq_greedy(graph, UNIT, 2, num_microbatches=1, microbatch_size=1)
    assert _loads(plan, graph) == [14, 17]  # prefix 14 is nearer 15.5 than 19


def test_one_huge_op_still_leaves_no_stage_empty():
    graph = chain([1, 100, 1, 1])
    plan = partition_seq_greedy(graph, UNIT, 3, num_microbatches=1, microbatch_size=1)
    assert _stages(plan) == [["n0"], ["n1"], ["n2", "n3"]]


def test_small_dag_is_topological():
    #   a → b → d → e
    #    ↘ c ↗
    graph = make_graph(
        {"a": 2.0, "b": 2.0, "c": 2.0, "d": 2.0, "e": 2.0},
        [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e")],
    )
    plan = partition_seq_greedy(graph, UNIT, 2, num_microbatches=2, microbatch_size=1)
    validate_partition(plan, graph)
    assert all(plan.node_stage[u] <= plan.node_stage[v] for u, v in graph.graph.edges)


def test_side_effect_op_stays_with_its_producer():
    # "check" asserts on a's output; it runs last but must not open or pad a stage
    graph = make_graph(
        {
            "a": 1.0,
            "b": 1.0,
            "c": 1.0,
            "d": 1.0,
            "check": {"flops": 0.0, "output_bytes": 0, "op": "aten._assert_tensor_metadata.default"},
        },
        [("a", "b"), ("b", "c"), ("c", "d"), ("a", "check")],
        outputs=("d",),
    )
    plan = partition_seq_greedy(graph, UNIT, 4, num_microbatches=1, microbatch_size=1)
    assert plan.node_stage["check"] == plan.node_stage["a"] == 0
    assert [len(nodes) for nodes in _stages(plan)] == [2, 1, 1, 1]
    validate_partition(plan, graph)


def test_too_few_ops():
    with pytest.raises(PartitionError, match="model has 2 ops, fewer than 3 stages"):
        partition_seq_greedy(chain([1, 1]), UNIT, 3, num_microbatches=1, microbatch_size=1)


def test_more_stages_than_gpus():
    with pytest.raises(PartitionError, match=r"\(5\) is more than the 4 GPUs"):
        partition_seq_greedy(chain([1] * 8), UNIT, 5, num_microbatches=1, microbatch_size=1)


def test_key_from_arguments_and_given_key_must_agree():
    graph = chain([1, 1])
    args = {"microbatch_size": 1, "schedule": "1f1b"}
    key = partition_seq_greedy(graph, UNIT, 2, num_microbatches=3, **args).key
    assert (key.model_fingerprint, key.model_class) == ("toy-fingerprint", "ToyModel")
    assert key.input_shapes == {"input_ids": [2, 8]}
    assert (key.dtype, key.schedule, key.num_microbatches) == ("float32", "1f1b", 3)
    assert (key.gpu_profile, key.num_gpus) == ("unit", 4)
    assert partition_seq_greedy(graph, UNIT, 2, num_microbatches=3, **args, key=key).key is key
    with pytest.raises(PartitionError, match=r"num_microbatches=3 \(argument: 4\)"):
        partition_seq_greedy(graph, UNIT, 2, num_microbatches=4, **args, key=key)


def test_zero_cost_graph_balances_op_counts():
    plan = partition_seq_greedy(chain([0] * 6), UNIT, 3, num_microbatches=1, microbatch_size=1)
    assert [len(nodes) for nodes in _stages(plan)] == [2, 2, 2]


@given(weights=st.lists(st.floats(0, 100), min_size=1, max_size=40), num_stages=st.integers(1, 8))
def test_greedy_cuts_are_increasing_and_nonempty(weights, num_stages):
    num_stages = min(num_stages, len(weights))
    cuts = greedy_cuts(weights, num_stages)
    bounds = [0, *cuts, len(weights)]
    assert len(cuts) == num_stages - 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 30))
    flops = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    pairs = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda e: e[0] < e[1])
    edges = draw(st.sets(pairs, max_size=3 * n))
    names = [f"op{i}" for i in range(n)]
    graph = make_graph(dict(zip(names, flops)), [(names[i], names[j]) for i, j in edges])
    return graph, draw(st.integers(1, min(n, UNIT.count)))


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_random_dags_always_validate_and_balance(case):
    graph, num_stages = case
    plan = partition_seq_greedy(graph, UNIT, num_stages, num_microbatches=2, microbatch_size=1)
    validate_partition(plan, graph)
    assert nx.is_directed_acyclic_graph(graph.graph)
    order = graph.topological_order()
    stage_along_order = [plan.node_stage[n] for n in order]
    assert stage_along_order == sorted(stage_along_order)  # contiguous
    flops = [graph.node(n)["flops"] for n in order]
    if sum(flops) > 0:
        assert max(_loads(plan, graph)) <= sum(flops) / num_stages + max(flops) + 1e-9


def test_registered_as_seq_greedy():
    assert get_partitioner("seq-greedy") is partition_seq_greedy


def test_plan_over_usable_memory_raises():
    # 16 B per op and micro-batch and the stage's 16 B output; GPipe holds both micro-batches:
    # (32 + 16) × 2 B a stage, and 2 × 16 B of backward working tensors
    graph = chain([1] * 4)
    small = UNIT.with_count(2)
    sizes = {"num_microbatches": 2, "microbatch_size": 1}
    plan = partition_seq_greedy(graph, small, **sizes, memory=MemoryOptions(headroom=0.987))
    assert plan.predicted.max_memory_fraction == 128 / 10_000
    with pytest.raises(PartitionError) as info:
        partition_seq_greedy(graph, small, **sizes, memory=MemoryOptions(headroom=0.995))
    assert "seq-greedy: its plan does not fit in GPU memory: GPU 0 128 bytes, GPU 1 128 bytes" in str(info.value)
    assert "more than the 50 bytes usable per GPU (10000 bytes less 99.5% headroom)" in str(info.value)


def test_recompute_weighs_forward_twice():
    # n0: 3 s forward + 3 s backward, then 1 + 1 each; recomputation adds each forward to the
    # backward. Both cut after n0 (6 | 8 and 9 | 12).
    graph = chain([3, 1, 1, 1, 1])
    sizes = {"num_microbatches": 1, "microbatch_size": 1}
    plain = partition_seq_greedy(graph, UNIT, 2, **sizes)
    again = partition_seq_greedy(graph, UNIT, 2, **sizes, memory=MemoryOptions(recompute=True))
    assert [s.backward_s for s in plain.predicted.stages] == [3.0, 4.0]
    assert [s.backward_s for s in again.predicted.stages] == [6.0, 8.0]
