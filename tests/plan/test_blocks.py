"""The blocks a model is profiled in, and the layer-aligned stages TeraPipe's slice timing uses."""

from __future__ import annotations

from cost_tables import tiny_gpt2_traced

from hf_ftpipe.plan.blocks import blocks_of, layer_stages, signature_of


def test_layer_stages_give_equal_middle_stages() -> None:
    graph = tiny_gpt2_traced(4).cost_graph
    blocks = {b.name: b for b in blocks_of(graph)}
    node_stage = layer_stages(graph, 4)
    assert node_stage is not None and set(node_stage) == set(graph.graph)
    stage_of = {name: {node_stage[n] for n in b.nodes} for name, b in blocks.items()}
    assert stage_of == {
        "transformer": {0},
        "transformer.h.0": {0},
        "transformer.h.1": {1},
        "transformer.h.2": {2},
        "transformer.h.3": {3},
        "transformer.ln_f": {3},
    }
    order = graph.topological_order()
    signatures = [signature_of(graph, [n for n in order if node_stage[n] == s]) for s in range(4)]
    assert signatures[1] == signatures[2] != signatures[0] != signatures[3]
    assert layer_stages(graph, 5) is None  # fewer layers than stages
