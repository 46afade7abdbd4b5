"""Baselines: DeepSpeed's 'uniform' (equal blocks) and 'parameters' (equal parameter bytes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_ftpipe.costmodel import MemoryOptions
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import find_blocks, get_partitioner, partition_params, partition_uniform
from hf_ftpipe.plan import validate_partition

from tiny_captures import tiny_graph
from toy_graphs import UNIT, chain, make_graph, param

SIZES = {"num_microbatches": 2, "microbatch_size": 1}


def _stages(partition) -> list[list[str]]:
    return [partition.nodes_of(s) for s in range(partition.num_stages)]


def _layered(num_blocks: int):
    """emb → h.0.a → h.0.b → ... → h.{n-1}.b → norm → head, GPT-2-like scopes."""
    nodes: dict[str, dict] = {"emb": {"flops": 1.0, "scope": "wte", "scope_types": ("Model", "Embedding")}}
    for i in range(num_blocks):
        for part in "ab":
            scope = f"transformer.h.{i}.attn" if part == "a" else f"transformer.h.{i}"
            types = ("Model", "GPT2Model", "GPT2Block", "GPT2Attention")[: 4 if part == "a" else 3]
            nodes[f"h{i}{part}"] = {"flops": 1.0, "scope": scope, "scope_types": types}
    nodes["norm"] = {"flops": 1.0, "scope": "transformer.ln_f", "scope_types": ("Model", "GPT2Model", "LayerNorm")}
    nodes["head"] = {"flops": 1.0, "scope": "lm_head", "scope_types": ("Model", "Linear")}
    names = list(nodes)
    return make_graph(nodes, list(zip(names, names[1:])))


def test_find_blocks_by_scope_and_class():
    blocks = find_blocks(_layered(3))
    assert blocks == {f"h{i}{p}": f"transformer.h.{i}" for i in range(3) for p in "ab"}


@pytest.mark.parametrize(
    ("kind", "containers"),
    [("t5", {"encoder.block", "decoder.block"}), ("gpt2", {"transformer.h"}), ("bert", {"bert.encoder.layer"})],
)
def test_find_blocks_on_real_models(kind, containers):
    graph = tiny_graph(kind)  # tiny_model(kind) at tiny_batch(kind, 2), shared (tiny_captures)
    blocks = set(find_blocks(graph).values())
    assert {b.rsplit(".", 1)[0] for b in blocks} == containers
    assert len(blocks) == 2 * len(containers)  # tiny models have 2 layers per stack


def test_a_lone_indexed_module_is_not_a_block():
    graph = make_graph(
        {
            "a": {"flops": 1.0, "scope": "heads.0", "scope_types": ("M", "Linear")},
            "b": {"flops": 1.0, "scope": "heads.1", "scope_types": ("M", "Conv")},
        },
        [("a", "b")],
    )
    assert find_blocks(graph) == {}


def test_uniform_equal_blocks_with_embeddings_first_and_head_last():
    graph = _layered(4)
    plan = partition_uniform(graph, UNIT, 2, **SIZES)
    assert _stages(plan) == [["emb", "h0a", "h0b", "h1a", "h1b"], ["h2a", "h2b", "h3a", "h3b", "norm", "head"]]
    assert plan.partitioner == "uniform" and plan.predicted is not None
    validate_partition(plan, graph)
    three = partition_uniform(graph, UNIT, 3, **SIZES)  # 4 blocks on 3 stages: 1, 1, 2
    assert [len(nodes) for nodes in _stages(three)] == [3, 2, 6]


def test_uniform_without_blocks_balances_op_counts():
    plan = partition_uniform(chain([100, 1, 1, 1, 1, 1]), UNIT, 3, **SIZES)
    assert [len(nodes) for nodes in _stages(plan)] == [2, 2, 2]


def test_uniform_with_fewer_blocks_than_stages_balances_op_counts():
    plan = partition_uniform(_layered(2), UNIT, 3, **SIZES)  # 7 ops
    assert [len(nodes) for nodes in _stages(plan)] == [2, 3, 2]


def test_params_balances_trainable_bytes_and_counts_a_tied_weight_once():
    params = {
        "emb": param("emb", (10, 10)),  # 400 B
        "w1": param("w1", (10, 10)),
        "w2": param("w2", (10, 10)),
        "frozen": param("frozen", (100, 100), trainable=False),
    }
    graph = make_graph(
        {
            "e": {"flops": 1.0, "params": ("emb",)},
            "a": {"flops": 1.0, "params": ("w1", "frozen")},
            "b": {"flops": 1.0, "params": ("w2",)},
            "c": 1.0,
            "head": {"flops": 1.0, "params": ("emb",)},  # tied: already counted at e
        },
        [("e", "a"), ("a", "b"), ("b", "c"), ("c", "head")],
        params=params,
    )
    plan = partition_params(graph, replace(UNIT, memory_bytes=10**6), 3, **SIZES)
    assert _stages(plan) == [["e"], ["a"], ["b", "c", "head"]]
    assert plan.partitioner == "params"


def test_params_without_trainable_parameters_balances_op_counts():
    plan = partition_params(chain([1] * 4), UNIT, 2, **SIZES)
    assert [len(nodes) for nodes in _stages(plan)] == [2, 2]


def test_baselines_raise_when_the_plan_does_not_fit():
    small = UNIT.with_count(2)
    # 16 B per op and micro-batch, 2 ops and 2 micro-batches a stage: 64 B saved, 32 B of the
    # stage's output kept, 32 B of backward working tensors: 128 B
    graph = chain([1] * 4)
    partition_uniform(graph, small, **SIZES, memory=MemoryOptions(headroom=0.987))  # 130 B usable
    with pytest.raises(PartitionError, match=r"uniform: its plan does not fit in GPU memory: GPU 0"):
        partition_uniform(graph, small, **SIZES, memory=MemoryOptions(headroom=0.995))
    with pytest.raises(PartitionError, match="params: its plan does not fit"):
        partition_params(graph, small, **SIZES, memory=MemoryOptions(headroom=0.995))


def test_registered_by_name():
    assert get_partitioner("uniform") is partition_uniform and get_partitioner("params") is partition_params
    with pytest.raises(PartitionError, match="unknown partitioner 'even'; choose one of"):
        get_partitioner("even")
