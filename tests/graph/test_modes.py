"""ModeAwareOp and make_mode_aware: dropout and SDPA dropout switch off in eval mode only."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from hf_ftpipe.graph.modes import ModeAwareOp, make_mode_aware

aten = torch.ops.aten


def _record(*args: object, **kwargs: object) -> tuple[tuple, dict]:
    return args, kwargs


def test_positional_argument_is_replaced_in_eval_only() -> None:
    op = ModeAwareOp(_record, 2, "train", False)
    assert op.training
    assert op("x", 0.5, True) == (("x", 0.5, True), {})
    op.eval()
    assert op("x", 0.5, True) == (("x", 0.5, False), {})
    assert op("x", 0.5, True, "tail") == (("x", 0.5, False, "tail"), {})
    op.train()
    assert op("x", 0.5, True) == (("x", 0.5, True), {})


def test_keyword_argument_is_replaced_in_eval_only() -> None:
    op = ModeAwareOp(_record, 4, "dropout_p", 0.0)
    assert op("q", "k", "v", dropout_p=0.2, is_causal=True) == (("q", "k", "v"), {"dropout_p": 0.2, "is_causal": True})
    op.eval()
    assert op("q", "k", "v", dropout_p=0.2, is_causal=True) == (("q", "k", "v"), {"dropout_p": 0.0, "is_causal": True})
    assert "dropout_p=0.0" in repr(op)


def test_dropout_is_identity_in_eval() -> None:
    x = torch.randn(4, 8)
    op = ModeAwareOp(aten.dropout.default, 2, "train", False)
    assert torch.equal(op(x, 1.0, True), torch.zeros_like(x))
    op.eval()
    assert torch.equal(op(x, 1.0, True), x)


def test_sdpa_dropout_is_zero_in_eval() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    expected = aten.scaled_dot_product_attention.default(q, k, v)
    op = ModeAwareOp(aten.scaled_dot_product_attention.default, 4, "dropout_p", 0.0)
    torch.manual_seed(1)
    train = op(q, k, v, None, 0.5)
    assert not torch.allclose(train, expected)
    op.eval()
    torch.testing.assert_close(op(q, k, v, None, 0.5), expected, atol=0, rtol=0)
    torch.testing.assert_close(op(q, k, v, dropout_p=0.5), expected, atol=0, rtol=0)


def _dropout_graph() -> fx.GraphModule:
    """x -> dropout(x, 1.0, train=True) -> relu; baked in training mode, as torch.export leaves it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    dropped = graph.call_function(aten.dropout.default, (x, 1.0, True))
    graph.output(graph.call_function(aten.relu.default, (dropped,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_make_mode_aware_rewrites_in_place_and_keeps_names() -> None:
    module = _dropout_graph()
    names = [node.name for node in module.graph.nodes]
    assert make_mode_aware(module) == 1
    assert [node.name for node in module.graph.nodes] == names
    (dropout,) = [node for node in module.graph.nodes if node.op == "call_module"]
    assert isinstance(module.get_submodule(dropout.target), ModeAwareOp)
    assert [node.target for node in module.graph.nodes if node.op == "call_function"] == [aten.relu.default]

    x = torch.rand(3, 5) + 0.1
    assert torch.equal(module(x), torch.zeros_like(x))
    module.eval()
    assert torch.equal(module(x), x)
    module.train()
    assert torch.equal(module(x), torch.zeros_like(x))


@pytest.mark.parametrize("target", [aten.relu.default, operator.getitem])
def test_make_mode_aware_leaves_other_ops_alone(target: object) -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, (x,) if target is aten.relu.default else (x, 0)))
    module = fx.GraphModule(torch.nn.Module(), graph)
    code = module.code
    assert make_mode_aware(module) == 0
    assert module.code == code
    assert not any(isinstance(m, ModeAwareOp) for m in module.modules())
