"""In-place updates stay whole: every way to cut a mutating model into stages computes the model."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from hf_ftpipe.graph import capture_model
from hf_ftpipe.graph.trace import TracedModel
from hf_ftpipe.runtime.stage import build_stage_module, plan_stages


class ShiftRight(nn.Module):
    """The pattern of T5's and BART's `_shift_right`: a fresh tensor written through a slice, then masked."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted.masked_fill_(shifted == 3, 5)
        hidden = self.embedding(shifted) + self.embedding(ids)
        return self.head(hidden).sum()


def _chained(traced: TracedModel, ids: torch.Tensor, node_stage: dict[str, int]) -> torch.Tensor:
    values: dict[str, torch.Tensor] = {}
    for spec in plan_stages(traced.cost_graph, node_stage):
        stage = build_stage_module(
            traced.graph_module, spec, traced.canonical_names, traced.tensors, torch.device("cpu")
        )
        bound = traced.shapes.bind({"ids": tuple(ids.shape)})
        sizes = [traced.shapes.size_of(node, bound) for node in spec.size_inputs]
        outputs = stage(*[ids for _ in spec.batch_inputs], *sizes, *[values[v] for v in spec.received])
        # A transfer is a snapshot: an in-place update on the sender's side later must not reach it.
        values.update((name, value.clone()) for name, value in zip(spec.sent, outputs))
    return values[traced.cost_graph.outputs[0]]


def test_every_three_stage_cut_of_an_in_place_update_computes_the_model() -> None:
    torch.manual_seed(0)
    model = ShiftRight()
    ids = torch.tensor([[1, 3, 2, 3, 7], [3, 3, 4, 0, 6]])
    with torch.no_grad():
        expected = model(ids)
        traced = capture_model(model, {"ids": ids})
        order = traced.cost_graph.topological_order()
        for first, second in itertools.combinations(range(1, len(order)), 2):
            node_stage = {name: (i >= first) + (i >= second) for i, name in enumerate(order)}
            got = _chained(traced, ids, node_stage)
            torch.testing.assert_close(got, expected, msg=f"cuts before {order[first]!r} and {order[second]!r}")


def test_the_update_is_one_node_with_its_readers() -> None:
    traced = capture_model(ShiftRight(), {"ids": torch.zeros(2, 5, dtype=torch.long)})
    ops = [traced.cost_graph.node(n)["op"] for n in traced.cost_graph.topological_order()]
    assert sum(op.startswith("inplace(") for op in ops) == 1
    assert not any(op.endswith(("copy_.default", "masked_fill_.Scalar")) for op in ops)
