"""Full-size models from the paper, built from their shipped public configs on the meta device, trace.

The shapes are the shipped plans' (T5-3B BoolQ, GPT2-XL WikiText-2, BERT-large SQuAD): the traces are
the session's planning graphs, shared with tests/hub and tests/cli, so each model is traced once.
"""

import pytest

from planning_graphs import planning_graph


@pytest.mark.parametrize(
    ("name", "shape", "params_b"),
    [
        ("t5-3b", (4, 512, 4), 2.85),
        ("gpt2-xl", (1, 1024, None), 1.56),
        ("bert-large", (24, 384, None), 0.335),
    ],
)
def test_full_size_model_traces_on_meta(name: str, shape: tuple, params_b: float) -> None:
    graph = planning_graph(name, *shape)
    trainable = sum(p.numel for p in graph.params.values() if p.requires_grad and not p.is_buffer)
    assert trainable / 1e9 == pytest.approx(params_b, rel=0.02), name
    assert graph.num_nodes > 500
    assert graph.total_flops > 1e12  # a full-size forward is teraFLOPs
    assert graph.outputs[0] in graph.graph and graph.output_names[0] == "loss"
