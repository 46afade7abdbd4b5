"""Roofline cost model: compute vs memory bound, backward factors, transfers, whole graphs."""

import math

import networkx as nx
import pytest

from hf_ftpipe.costmodel import (
    BUILTIN_PROFILES,
    GPUProfile,
    NodeCost,
    backward_factor,
    backward_time_s,
    comm_time_s,
    compute_time_s,
    edge_comm_s,
    node_costs,
)
from hf_ftpipe.errors import ProfileError
from hf_ftpipe.graph.cost_graph import CostGraph, ParamInfo

# Round numbers and no efficiency discount, so every expected time is mental arithmetic.
TOY = GPUProfile(
    name="toy",
    count=2,
    memory_bytes=1000,
    peak_flops={"float32": 100.0, "bfloat16": 400.0},
    memory_bandwidth_bytes_per_s=10.0,
    link_bandwidth_bytes_per_s=2.0,
    link_latency_s=0.5,
    compute_efficiency=1.0,
    memory_efficiency=1.0,
)


def test_compute_bound():
    # 1000 FLOP / 100 FLOP/s = 10 s beats 50 B / 10 B/s = 5 s
    assert compute_time_s(1000, 50, TOY) == 10.0


def test_memory_bound():
    # 100 FLOP / 100 = 1 s loses to 500 B / 10 B/s = 50 s
    assert compute_time_s(100, 500, TOY) == 50.0


def test_dtype_picks_its_peak():
    assert compute_time_s(1000, 0, TOY, "bfloat16") == 2.5
    assert compute_time_s(1000, 0, TOY, "torch.bfloat16") == 2.5
    assert compute_time_s(1000, 0, TOY, "float16") == 10.0  # no fp16 peak: fp32


def test_efficiencies_scale_the_builtin_roofline():
    a100 = BUILTIN_PROFILES["a100-80gb"]
    flops, num_bytes = 2 * 4096**3, 3 * 4096**2 * 2  # a bf16 4096^3 matmul: compute-bound
    expected = flops / (312e12 * a100.compute_efficiency)
    assert compute_time_s(flops, num_bytes, a100, "bfloat16") == pytest.approx(expected)
    # an elementwise add of 2^28 bf16 values: memory-bound
    num_bytes = 3 * 2**28 * 2
    expected = num_bytes / (2.039e12 * a100.memory_efficiency)
    assert compute_time_s(2**28, num_bytes, a100, "bfloat16") == pytest.approx(expected)


@pytest.mark.parametrize(
    "requires_grad, trainable, inputs_grad, factor",
    [
        (True, True, True, 2),  # linear inside the network: dx and dW
        (True, True, False, 1),  # first linear on data: dW only
        (True, False, True, 1),  # activation: dx only
        (False, True, True, 0),  # never reaches the loss: autograd skips it
        (False, False, False, 0),  # mask arithmetic on integers
    ],
)
def test_backward_factor(requires_grad, trainable, inputs_grad, factor):
    assert (
        backward_factor(
            requires_grad=requires_grad,
            reads_trainable_params=trainable,
            inputs_require_grad=inputs_grad,
        )
        == factor
    )
    assert (
        backward_time_s(
            1000,
            50,
            TOY,
            requires_grad=requires_grad,
            reads_trainable_params=trainable,
            inputs_require_grad=inputs_grad,
        )
        == factor * 10.0
    )


def test_backward_defaults_are_a_parameter_free_op():
    assert backward_time_s(1000, 50, TOY) == 10.0
    assert backward_time_s(1000, 50, TOY, reads_trainable_params=True) == 20.0


def test_comm_time():
    assert comm_time_s(0, TOY) == 0.0
    assert comm_time_s(8, TOY) == 0.5 + 4.0
    h100 = BUILTIN_PROFILES["h100"]
    assert comm_time_s(450e6, h100) == pytest.approx(h100.link_latency_s + 1e-3)


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_time_s(-1, 0, TOY),
        lambda: compute_time_s(0, math.nan, TOY),
        lambda: comm_time_s(-8, TOY),
    ],
)
def test_negative_amounts_are_rejected(call):
    with pytest.raises(ProfileError, match="must be >= 0"):
        call()


def _param(name: str, trainable: bool) -> ParamInfo:
    return ParamInfo(name=name, aliases=(name,), shape=(4, 4), dtype="torch.float32", bytes=64, requires_grad=trainable)


def _node(order, flops, bytes_accessed, requires_grad, params=(), dtype="torch.float32"):
    return dict(
        order=order,
        op="aten.x",
        flops=flops,
        bytes_accessed=bytes_accessed,
        output_bytes=bytes_accessed // 2,
        params=params,
        requires_grad=requires_grad,
        output_dtypes=(dtype,),
    )


@pytest.fixture
def graph() -> CostGraph:
    g = nx.DiGraph()
    g.add_node("embed", **_node(0, 0, 100, True, params=("wte",)))  # memory-bound: 10 s
    g.add_node("mask", **_node(1, 0, 20, False, dtype="torch.int64"))  # 2 s, no backward
    g.add_node("linear", **_node(2, 1000, 40, True, params=("fc.weight", "fc.bias")))  # 10 s
    g.add_node("gelu", **_node(3, 200, 4, True, dtype="torch.bfloat16"))  # bf16: 0.5 s
    g.add_node("frozen", **_node(4, 500, 10, True, params=("frozen.weight",)))  # 5 s
    g.add_edge("embed", "linear", bytes=8)
    g.add_edge("mask", "linear", bytes=0)
    g.add_edge("linear", "gelu", bytes=16)
    g.add_edge("gelu", "frozen", bytes=2)
    params = {
        "wte": _param("wte", True),
        "fc.weight": _param("fc.weight", True),
        "fc.bias": _param("fc.bias", True),
        "frozen.weight": _param("frozen.weight", False),
    }
    return CostGraph(graph=g, params=params, inputs={}, outputs=("frozen",), output_names=("logits",))


def test_node_costs(graph):
    costs = node_costs(graph, TOY)
    assert costs == {
        "embed": NodeCost(forward_s=10.0, backward_s=10.0),  # dW only: its input is data
        "mask": NodeCost(forward_s=2.0, backward_s=0.0),
        "linear": NodeCost(forward_s=10.0, backward_s=20.0),  # dx and dW
        "gelu": NodeCost(forward_s=0.5, backward_s=0.5),
        "frozen": NodeCost(forward_s=5.0, backward_s=5.0),  # frozen weight: dx only
    }
    assert costs["linear"].total_s == 30.0


def test_node_costs_dtype_override(graph):
    costs = node_costs(graph, TOY, dtype="bfloat16")
    assert costs["linear"].forward_s == 4.0  # 1000 / 400 = 2.5 s, now memory-bound: 40 / 10
    assert costs["frozen"].forward_s == 1.25  # 500 / 400 beats 10 B / 10 B/s
    assert costs["mask"].forward_s == 2.0  # no FLOPs: the dtype changes nothing


def test_edge_comm(graph):
    assert edge_comm_s(graph, TOY) == {
        ("embed", "linear"): 0.5 + 4.0,
        ("mask", "linear"): 0.0,
        ("linear", "gelu"): 0.5 + 8.0,
        ("gelu", "frozen"): 0.5 + 1.0,
    }


def test_missing_attribute_is_named(graph):
    del graph.graph.nodes["gelu"]["flops"]
    with pytest.raises(ProfileError, match="'gelu' has no 'flops' attribute"):
        node_costs(graph, TOY)


def test_unknown_parameter_is_named(graph):
    del graph.params["fc.bias"]
    with pytest.raises(ProfileError, match="'linear' reads parameter 'fc.bias'"):
        node_costs(graph, TOY)
