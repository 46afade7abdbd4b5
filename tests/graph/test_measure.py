"""The CostGraph of a captured model (tiny T5): shapes, bytes, FLOPs, what backward keeps, scopes,
the same on the meta device, fingerprints, and `measure_at` another shape. That the graph computes
what the model computes is tests/graph/test_trace.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import networkx as nx
import pytest
import torch
import transformers

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import CostGraph, TracedModel, capture_model, trace_model
from hf_ftpipe.graph.trace import measure_at

from models import tiny_batch, tiny_model
from tiny_captures import tiny_capture, tiny_graph, tiny_t5_with_dropout

DOCUMENTED_ATTRIBUTES = {
    "order": int,
    "op": str,
    "scope": str,
    "scope_types": tuple,
    "output_shapes": tuple,
    "output_dtypes": tuple,
    "output_bytes": int,
    "params": tuple,
    "batch_inputs": tuple,
    "flops": float,
    "bytes_accessed": int,
    "saved_bytes": int,
    "requires_grad": bool,
}


# ---------------------------------------------------------------- the CostGraph of tiny T5


@pytest.fixture(scope="module")
def t5_traced() -> TracedModel:
    """The tiny T5's capture (shared, `tiny_captures`), its graph measured at the sample's 2 rows of 8 tokens."""
    _, traced = tiny_capture("t5")
    return dataclasses.replace(traced, cost_graph=tiny_graph("t5"))


def test_saved_bytes_count_what_backward_keeps(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    saved = {n: graph.node(n)["saved_bytes"] for n in graph.topological_order()}
    # A linear layer keeps its input for the weight gradient: at least one activation's worth
    # is kept somewhere before each linear (the input is saved by the first op that needs it).
    assert sum(saved.values()) > 0
    assert all(value >= 0 for value in saved.values())
    # Integer bookkeeping (positions, masks built from ids) keeps nothing for backward.
    for name in saved:
        if graph.node(name)["output_dtypes"] == ("int64",):
            assert saved[name] == 0, name
    # Weights are not activations: no single op keeps more than its inputs and outputs, but for a
    # fused attention kernel's own log-sum-exp (a float per query row and head) and its mask as a
    # float bias (at most one per query row and key).
    attention = [n for n in saved if graph.node(n)["op"].startswith("aten.scaled_dot_product_attention")]
    assert attention
    for name, value in saved.items():
        bound = graph.node(name)["bytes_accessed"]
        if name in attention:
            (*rows, _), keys = graph.node(name)["output_shapes"][0], _key_length(graph, name)
            bound += math.prod(rows) * 4 * (1 + keys)
        assert value <= bound, name


def _key_length(graph, attention: str) -> int:
    """The key length of an attention call: the longest second-to-last dimension of its inputs."""
    return max(graph.node(u)["output_shapes"][0][-2] for u in graph.graph.predecessors(attention))


def test_tied_weight_is_one_parameter(t5_traced: TracedModel) -> None:
    params = t5_traced.cost_graph.params
    assert "shared.weight" in params and "lm_head.weight" not in params
    assert params["shared.weight"].aliases[0] == "shared.weight"
    assert "lm_head.weight" in params["shared.weight"].aliases
    assert params["shared.weight"].bytes == 96 * 32 * 4
    readers = [n for n, a in t5_traced.cost_graph.graph.nodes(data=True) if "shared.weight" in a["params"]]
    # The encoder's embedding, the lm_head, and the decoder's embedding, which reads the labels
    # shifted in place by `_shift_right` and so lives in that fused in-place region. Its
    # `shifted[..., 0] = decoder_start_token_id` exports as a `copy_` of an expanded scalar under
    # torch 2.13 and as a `fill_` under torch 2.15.
    ops = {t5_traced.cost_graph.node(n)["op"] for n in readers}
    region = ops - {"aten.embedding.default", "aten.linear.default"}
    assert ops - region == {"aten.embedding.default", "aten.linear.default"}
    assert region in ({"inplace(copy_, masked_fill_)"}, {"inplace(copy_, fill_, masked_fill_)"})


def test_in_place_updates_are_fused_with_their_readers(t5_traced: TracedModel) -> None:
    graph_module = t5_traced.graph_module
    writers = [
        n.name
        for n in graph_module.graph.nodes
        if n.op == "call_function"
        and any(a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments)
    ]
    assert writers == [], "no in-place op may be cut away from the tensor it updates"
    fused = [n for n in t5_traced.cost_graph.topological_order() if "inplace" in t5_traced.cost_graph.node(n)["op"]]
    assert fused, "T5's _shift_right writes in place: it must appear as a fused region"


def test_every_node_has_the_documented_attributes(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    for name, attrs in graph.graph.nodes(data=True):
        for key, kind in DOCUMENTED_ATTRIBUTES.items():
            assert isinstance(attrs[key], kind), f"{name}.{key} = {attrs.get(key)!r}"
        assert len(attrs["output_shapes"]) == len(attrs["output_dtypes"])
        assert set(attrs["params"]) <= set(graph.params)
        assert set(attrs["batch_inputs"]) <= set(graph.inputs)
        assert attrs["bytes_accessed"] >= attrs["output_bytes"]


def test_linear_flops_are_2mnk(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    assert graph.total_flops > 0
    matmul_ops = ("aten.linear.default", "aten.addmm.default")
    linears = [n for n in graph.topological_order() if graph.node(n)["op"] in matmul_ops]
    for name in linears:
        attrs = graph.node(name)
        (activation,) = [p for p in graph.graph.predecessors(name)]
        (input_shape,) = graph.node(activation)["output_shapes"]
        (weight,) = attrs["params"]
        n, k = graph.params[weight].shape
        m = 1
        for size in input_shape[:-1]:
            m *= size
        assert input_shape[-1] == k
        assert attrs["flops"] == 2 * m * n * k, name

    # By hand, batch 2, source 8, target 4, d_model 32 = heads 2 * d_kv 16, d_ff 64, vocab 96.
    enc_rows, dec_rows, d, ff, vocab = 2 * 8, 2 * 4, 32, 64, 96
    encoder_layer = 4 * 2 * enc_rows * d * d + 2 * 2 * enc_rows * d * ff
    decoder_layer = (
        4 * 2 * dec_rows * d * d  # self-attention q, k, v, o
        + 2 * 2 * dec_rows * d * d  # cross-attention q, o on the target
        + 2 * 2 * enc_rows * d * d  # cross-attention k, v on the encoder output
        + 2 * 2 * dec_rows * d * ff
    )
    lm_head = 2 * dec_rows * d * vocab
    assert len(linears) == 2 * 6 + 2 * 10 + 1
    assert sum(graph.node(n)["flops"] for n in linears) == 2 * encoder_layer + 2 * decoder_layer + lm_head
    assert graph.total_flops >= 2 * encoder_layer + 2 * decoder_layer + lm_head


def test_graph_is_a_dag_in_execution_order(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    assert nx.is_directed_acyclic_graph(graph.graph)
    position = {name: index for index, name in enumerate(graph.topological_order())}
    assert len(position) == graph.num_nodes
    for u, v, attrs in graph.graph.edges(data=True):
        assert position[u] < position[v]
        assert attrs["bytes"] == graph.node(u)["output_bytes"], (u, v)
    for name in graph.topological_order():
        attrs = graph.node(name)
        expected_bytes = sum(
            _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
            for shape, dtype in zip(attrs["output_shapes"], attrs["output_dtypes"], strict=True)
        )
        assert attrs["output_bytes"] == expected_bytes, name


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def test_requires_grad_follows_dtype_and_parameters(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    integer = [n for n in graph.topological_order() if graph.node(n)["output_dtypes"] in (("int64",), ("bool",))]
    assert len(integer) > 10
    assert not any(graph.node(n)["requires_grad"] for n in integer)
    assert graph.output_names[0] == "loss"
    assert graph.node(graph.outputs[0])["requires_grad"] is True
    assert graph.node(graph.outputs[0])["output_shapes"] == ((),)
    assert all(
        graph.node(n)["requires_grad"]
        for n in graph.topological_order()
        if graph.node(n)["params"] and graph.node(n)["output_dtypes"] == ("float32",)
    )


def test_scopes_name_modules_and_block_types(t5_traced: TracedModel) -> None:
    graph = t5_traced.cost_graph
    block0 = [n for n in graph.topological_order() if graph.node(n)["scope"].startswith("encoder.block.0.")]
    assert block0
    for name in block0:
        assert graph.node(name)["scope_types"][:3] == ("T5ForConditionalGeneration", "T5Stack", "T5Block")
    q = [n for n in block0 if graph.node(n)["params"] == ("encoder.block.0.layer.0.SelfAttention.q.weight",)]
    assert len(q) == 1 and graph.node(q[0])["scope"] == "encoder.block.0.layer.0.SelfAttention.q"
    assert graph.node(graph.outputs[0])["scope"] == ""


# ---------------------------------------------------------------- meta device and fingerprints


def _t5_config(**overrides: object) -> transformers.T5Config:
    config = copy.deepcopy(tiny_model("t5").config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _meta_batch(kind: str) -> dict[str, torch.Tensor]:
    return {name: tensor.to("meta") for name, tensor in tiny_batch(kind, 2).items()}


@functools.cache
def _meta_t5(*, dynamic: bool = True, **overrides: object) -> CostGraph:
    """The tiny T5 built on the meta device and traced, once per configuration (tests only read it);
    ``dynamic=False`` exports it at fixed shapes, a fraction of the symbolic export's time."""
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(_t5_config(**overrides))
    return capture_model(model, _meta_batch("t5"), dynamic=dynamic).cost_graph


def test_meta_model_measures_like_the_cpu_model(t5_traced: TracedModel) -> None:
    cpu = t5_traced.cost_graph
    meta = _meta_t5()
    assert meta.total_flops == cpu.total_flops
    assert {name: p.bytes for name, p in meta.params.items() if not p.is_buffer} == {
        name: p.bytes for name, p in cpu.params.items() if not p.is_buffer
    }
    assert _linear_flops(meta) == _linear_flops(cpu)


def _linear_flops(graph: CostGraph) -> list[float]:
    return [graph.node(n)["flops"] for n in graph.topological_order() if graph.node(n)["op"] == "aten.linear.default"]


def test_meta_and_cpu_captures_are_the_same_graph(t5_traced: TracedModel) -> None:
    cpu = t5_traced.cost_graph
    meta = _meta_t5()
    assert meta.num_nodes == cpu.num_nodes
    assert meta.topological_order() == cpu.topological_order()
    assert meta.fingerprint == cpu.fingerprint


def test_fingerprint_is_stable_and_tracks_structure_only(t5_traced: TracedModel) -> None:
    fingerprint = t5_traced.cost_graph.fingerprint
    assert len(fingerprint) == 16
    meta = _meta_t5().fingerprint
    assert meta == fingerprint  # stable: another trace of the same model (on the meta device) gives it
    # The fingerprint holds the model's config and weights, not the graph's ops: one exported at fixed
    # shapes is the same, so the variants below are traced so (faster).
    assert _meta_t5(dynamic=False).fingerprint == meta
    assert _meta_t5(dynamic=False, dropout_rate=0.3).fingerprint == meta
    assert _meta_t5(dynamic=False, num_layers=3, num_decoder_layers=3).fingerprint != meta
    assert _meta_t5(dynamic=False, d_ff=128).fingerprint != meta


def test_fingerprint_of_a_cpu_model_ignores_dropout_rate(t5_traced: TracedModel) -> None:
    _, dropout = tiny_t5_with_dropout()  # exported at fixed shapes: faster
    assert dropout.cost_graph.fingerprint == t5_traced.cost_graph.fingerprint


# ---------------------------------------------------------------- another shape


def test_a_capture_measured_at_another_shape_is_the_graph_traced_there(t5_traced: TracedModel) -> None:
    """`measure_at`: one export serves every shape (planning a model's tasks exports it once)."""
    model = tiny_model("t5")
    batch = {name: value[:, :3] if name == "labels" else value for name, value in tiny_batch("t5", 4).items()}
    remeasured, traced = measure_at(model, t5_traced, batch), trace_model(model, batch)
    assert remeasured.topological_order() == traced.topological_order()
    assert dict(remeasured.graph.nodes(data=True)) == dict(traced.graph.nodes(data=True))
    assert list(remeasured.graph.edges(data=True)) == list(traced.graph.edges(data=True))
    assert remeasured.inputs == traced.inputs and remeasured.total_flops != t5_traced.cost_graph.total_flops
    with pytest.raises(PipelineError, match="do not fit the traced model"):
        measure_at(model, t5_traced, {**batch, "attention_mask": batch["attention_mask"][:, :2]})
