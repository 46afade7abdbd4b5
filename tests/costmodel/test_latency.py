"""`SliceLatency`: the least-squares fit, the JSON file and its checks, and the cost-model form."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import networkx as nx
import pytest

from hf_ftpipe.costmodel import get_profile, node_costs
from hf_ftpipe.costmodel.latency import LatencyKey, LatencySample, SliceLatency
from hf_ftpipe.costmodel.roofline_latency import RooflineSliceTime
from hf_ftpipe.errors import LatencyFormatError
from hf_ftpipe.graph.cost_graph import CostGraph, InputInfo, ParamInfo

KEY = LatencyKey(
    model_fingerprint="abc123",
    model_class="GPT2LMHeadModel",
    seq_len=64,
    num_stages=4,
    device="a100-80gb",
    dtype="float32",
)
TRUE = {"fixed_s": 1e-3, "token_s": 2e-5, "context_s": 1e-7, "token_context_s": 3e-8, "token_squared_s": 4e-8}


def grid(coefficients: dict[str, float]) -> list[LatencySample]:
    model = SliceLatency(key=KEY, **coefficients)
    return [LatencySample(s, c, b, model.time_s(s, c, b)) for b in (1, 2) for s in (8, 16, 32, 64) for c in (0, 16, 48)]


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    fitted = SliceLatency.fit(grid(TRUE), KEY)
    for name, value in TRUE.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name
    assert fitted(32, 16, 2) == pytest.approx(SliceLatency(key=KEY, **TRUE)(32, 16, 2))
    assert fitted.fit_error < 1e-9 and fitted.source == "measured"


def test_fit_sets_a_coefficient_the_noise_makes_negative_to_zero() -> None:
    rng = random.Random(0)
    flat = {**TRUE, "context_s": 0.0, "token_context_s": 0.0}
    noisy = [replace(x, time_s=x.time_s * (1 + rng.uniform(-0.01, 0.01))) for x in grid(flat)]
    fitted = SliceLatency.fit(noisy, KEY)
    assert min(getattr(fitted, name) for name in TRUE) >= 0
    assert 0 < fitted.fit_error < 0.02  # the noise, no more
    assert fitted.token_s == pytest.approx(TRUE["token_s"], rel=0.1)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(ValueError, match="at least 5 samples"):
        SliceLatency.fit(grid(TRUE)[:3], KEY)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "latency.json"
    model = SliceLatency(key=KEY, source="measured", **TRUE)
    model.save(path)
    assert SliceLatency.load(path, expected_key=KEY) == model
    assert json.loads(path.read_text())["format"] == "hf_ftpipe.slice_latency"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "hf_ftpipe.partition"}, "not a latency file: field 'format' is 'hf_ftpipe.partition'"),
        ({"format_version": 9}, "field 'format_version' is 9; this hf_ftpipe reads version 1 only"),
        ({"token_s": -1.0}, "field 'token_s' must be a finite number ≥ 0, got -1.0"),
        ({"token_s": "fast"}, "field 'token_s' should be float, got string"),
        ({"speed": 1.0}, "unknown fields ['speed']"),
        ({"key": {**KEY.__dict__, "seq_len": 0}}, "'key.seq_len' and 'key.num_stages' must be ≥ 1"),
    ],
)
def test_load_names_the_file_and_the_field(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "latency.json"
    data = {**SliceLatency(key=KEY, **TRUE).to_dict(), **change}
    path.write_text(json.dumps(data))
    with pytest.raises(LatencyFormatError) as error:
        SliceLatency.load(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)
    assert "fit the latency model again" in str(error.value)


@pytest.mark.parametrize("number", ["NaN", "1e999"])
def test_load_refuses_nan_and_infinity(tmp_path: Path, number: str) -> None:
    path = tmp_path / "latency.json"
    text = json.dumps(SliceLatency(key=KEY, **TRUE).to_dict()).replace("2e-05", number)
    path.write_text(text)
    with pytest.raises(LatencyFormatError, match=str(path)):
        SliceLatency.load(path)


def test_load_refuses_a_file_fitted_for_another_setup(tmp_path: Path) -> None:
    path = tmp_path / "latency.json"
    SliceLatency(key=KEY, **TRUE).save(path)
    other = replace(KEY, num_stages=8, device="rtx2080ti")
    with pytest.raises(LatencyFormatError) as error:
        SliceLatency.load(path, expected_key=other)
    text = str(error.value)
    assert "key.num_stages is 4, expected 8" in text and "key.device is 'a100-80gb', expected 'rtx2080ti'" in text


def toy_causal_lm(seq_len: int = 64, hidden: int = 32) -> CostGraph:
    """A layer as a cost graph: a projection (per token) and attention scores (per token pair)."""
    g = nx.DiGraph()
    weight = ParamInfo(
        name="w", aliases=("w",), shape=(hidden, hidden), dtype="float32", bytes=4 * hidden * hidden, requires_grad=True
    )
    common = {"scope": "h.0", "scope_types": (), "batch_inputs": (), "saved_bytes": 0, "requires_grad": True}
    g.add_node(
        "proj",
        op="aten.linear.default",
        params=("w",),
        flops=2.0 * seq_len * hidden * hidden,
        bytes_accessed=4 * (2 * seq_len * hidden + hidden * hidden),
        output_shapes=((1, seq_len, hidden),),
        output_dtypes=("float32",),
        output_bytes=4 * seq_len * hidden,
        order=0,
        **common,
    )
    g.add_node(
        "scores",
        op="aten.matmul.default",
        params=(),
        flops=2.0 * seq_len * seq_len * hidden,
        bytes_accessed=4 * (2 * seq_len * hidden + seq_len * seq_len),
        output_shapes=((1, 1, seq_len, seq_len),),
        output_dtypes=("float32",),
        output_bytes=4 * seq_len * seq_len,
        order=1,
        **common,
    )
    g.add_edge("proj", "scores", bytes=4 * seq_len * hidden)
    return CostGraph(
        graph=g,
        params={"w": weight},
        inputs={"input_ids": InputInfo(name="input_ids", shape=(1, seq_len), dtype="int64")},
        outputs=("scores",),
        output_names=("logits",),
        model_class="Toy",
        fingerprint="toy",
    )


def test_from_cost_model_has_per_token_and_attention_terms() -> None:
    profile = get_profile("a100-80gb", count=2)
    exact = RooflineSliceTime.from_graph(toy_causal_lm(), profile, num_stages=2, boundary_bytes_per_token=128)
    latency = SliceLatency.from_cost_model(exact)
    assert latency.source == "cost-model" and latency.key.seq_len == 64 and latency.key.num_stages == 2
    assert latency.fixed_s >= 2 * profile.link_latency_s * 0.99  # a send each way per slice
    assert latency.token_context_s > 0 and latency.token_squared_s > 0  # attention over context and itself
    assert latency(32, 32) > latency(32, 0) > latency(16, 0) > 0
    assert latency(16, 0, batch_size=2) > latency(16, 0)


def test_the_roofline_sum_of_the_whole_sequence_is_the_cost_model_of_the_graph() -> None:
    graph, profile = toy_causal_lm(), get_profile("a100-80gb", count=1)
    exact = RooflineSliceTime.from_graph(graph, profile, num_stages=1, boundary_bytes_per_token=128)
    whole = sum(cost.total_s for cost in node_costs(graph, profile).values())
    assert exact(64, 0) == pytest.approx(whole, rel=1e-12)
    assert exact(32, 32) + exact(32, 0) < whole  # slicing skips the masked half of the scores
    assert SliceLatency.from_cost_model(exact).fit_error < 0.5
