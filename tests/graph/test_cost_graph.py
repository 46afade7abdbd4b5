"""CostGraph queries on a hand-built graph: parameter bytes, cut bytes, execution order."""

from __future__ import annotations

import networkx as nx
import pytest

from hf_ftpipe.graph.cost_graph import CostGraph, InputInfo, ParamInfo

#   embed ──► attn ──► head          embed and head read the tied "shared.weight";
#     │                  ▲           attn reads "attn.weight" and the buffer "attn.mask".
#     └──────────────────┘           "aside" stands alone.
NODES = {  # name: (order, output_bytes, params, flops)
    "head": (3, 40, ("shared.weight",), 30.0),
    "embed": (0, 100, ("shared.weight",), 0.0),
    "aside": (1, 8, (), 1.0),
    "attn": (2, 60, ("attn.mask", "attn.weight"), 20.0),
}
EDGES = [("embed", "attn"), ("attn", "head"), ("embed", "head")]
PARAMS = {
    "shared.weight": ParamInfo("shared.weight", ("shared.weight", "lm_head.weight"), (10, 5), "float32", 200, True),
    "attn.weight": ParamInfo("attn.weight", ("attn.weight",), (5, 5), "float32", 100, True),
    "attn.mask": ParamInfo("attn.mask", ("attn.mask",), (4, 4), "bool", 16, False, is_buffer=True),
}


@pytest.fixture
def graph() -> CostGraph:
    digraph = nx.DiGraph()
    for name, (order, output_bytes, params, flops) in NODES.items():  # insertion order is not execution order
        digraph.add_node(
            name,
            order=order,
            op="aten.mm.default",
            scope="",
            scope_types=(),
            output_shapes=((output_bytes // 4,),),
            output_dtypes=("float32",),
            output_bytes=output_bytes,
            params=params,
            batch_inputs=(),
            flops=flops,
            bytes_accessed=output_bytes,
            requires_grad=True,
        )
    for u, v in EDGES:
        digraph.add_edge(u, v, bytes=NODES[u][1])
    return CostGraph(
        graph=digraph,
        params=PARAMS,
        inputs={"input_ids": InputInfo("input_ids", (2, 8), "int64")},
        outputs=("head",),
        output_names=("loss",),
        model_class="Toy",
    )


def test_topological_order_follows_execution_order(graph: CostGraph) -> None:
    assert graph.topological_order() == ["embed", "aside", "attn", "head"]
    assert graph.num_nodes == 4
    assert graph.total_flops == 51.0
    assert graph.node("attn")["output_bytes"] == 60


def test_params_of_uses_canonical_names(graph: CostGraph) -> None:
    assert graph.params_of([]) == set()
    assert graph.params_of(["aside"]) == set()
    assert graph.params_of(["embed", "head"]) == {"shared.weight"}
    assert graph.params_of(["attn", "head"]) == {"shared.weight", "attn.weight", "attn.mask"}


def test_param_bytes_counts_a_tied_weight_once(graph: CostGraph) -> None:
    assert graph.param_bytes() == 200 + 100 + 16
    assert graph.param_bytes(trainable_only=True) == 300
    assert graph.param_bytes(["embed"]) == 200
    assert graph.param_bytes(["embed", "head"]) == 200
    assert graph.param_bytes(["attn"]) == 116
    assert graph.param_bytes(["attn"], trainable_only=True) == 100
    assert graph.param_bytes(["aside"]) == 0
    assert graph.param_bytes(iter(["embed", "attn", "head"])) == 316  # any iterable, read once


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (["embed"], (0, 100)),  # embed feeds attn and head: its output leaves once
        (["attn"], (100, 60)),
        (["head"], (100 + 60, 0)),  # two producers enter
        (["attn", "head"], (100, 0)),  # embed enters once though two nodes read it
        (["embed", "attn"], (0, 100 + 60)),
        (["embed", "attn", "head"], (0, 0)),
        (["aside"], (0, 0)),
        ([], (0, 0)),
    ],
)
def test_cut_bytes(graph: CostGraph, nodes: list[str], expected: tuple[int, int]) -> None:
    assert graph.cut_bytes(nodes) == expected
