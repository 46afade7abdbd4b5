"""The measured cost table: JSON round trip, every defect a clear error, a foreign table refused, the
plans made from it (a slow block moves the partition boundary), and a timed ``W`` pricing the split backward."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from cost_tables import roofline_table, tiny_gpt2_traced

from hf_ftpipe.costmodel import get_profile, node_costs
from hf_ftpipe.costmodel.measured import CostTable, cache_path
from hf_ftpipe.costmodel.memory_rules import defers_weight_gradient
from hf_ftpipe.errors import CostTableError, PartitionError
from hf_ftpipe.partitioners.registry import run_partitioner
from hf_ftpipe.plan.blocks import blocks_of
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanRequest
from hf_ftpipe.runtime.block_timing import BlockTimings, TimedBlock
from hf_ftpipe.simulator import pipeline_costs

# Links so fast that the tiny model's plan is cut by compute alone, as a large model's is.
PROFILE = replace(get_profile("a100-80gb", count=2), link_latency_s=0.0, link_bandwidth_bytes_per_s=1e18)


@pytest.fixture(scope="module")
def graph():
    return tiny_gpt2_traced(4).cost_graph


def test_round_trip_and_cache_path(graph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = roofline_table(graph, PROFILE, slower={"transformer.h.1": 3.0})
    path = tmp_path / "measured.json"
    table.save(path)
    assert CostTable.load(path, expected_key=table.key) == table
    costs = table.node_costs(graph)
    assert set(costs) == set(graph.graph)
    slow = next(b for b in table.blocks if b.name == "transformer.h.1")
    assert sum(costs[n].forward_s for n in slow.nodes) == pytest.approx(slow.forward_s)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cache_path(table.key).parent == tmp_path / "home" / "hf_ftpipe" / "costs"
    assert cache_path(table.key).name.startswith("GPT2LMHeadModel-")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text[: len(text) // 2], "ends early (truncated file?)"),
        (lambda text: "[1, 2]", "not a cost table: expected a JSON object, got array"),
        (lambda text: text.replace("hf_ftpipe.cost_table", "hf_ftpipe.plan"), "field 'format' is 'hf_ftpipe.plan'"),
        (lambda text: _edit(text, lambda d: d.pop("repeats")), "missing field 'repeats'"),
        (lambda text: _edit(text, lambda d: d["key"].update(dtype=16)), "field 'key.dtype' should be str, got int 16"),
        (lambda text: _block(text, forward_s=-1.0), "'blocks[1].forward_s' must be a finite number ≥ 0, got -1.0"),
        (lambda text: _block(text, backward_s="x"), "field 'blocks[1].backward_s' should be float, got string 'x'"),
    ],
)  # fmt: skip
def test_corrupt_table_is_a_clear_error(graph, tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "measured.json"
    roofline_table(graph, PROFILE).save(path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(CostTableError) as error:
        CostTable.load(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_table_of_another_model_or_shape_is_refused(graph, tmp_path: Path) -> None:
    table = roofline_table(graph, PROFILE)
    foreign = replace(table, key=replace(table.key, model_fingerprint="0123456789abcdef"))
    with pytest.raises(CostTableError) as error:
        foreign.node_costs(graph)
    text = str(error.value)
    assert f"key.model_fingerprint is '0123456789abcdef', expected {graph.fingerprint!r}" in text
    assert "hf-ftpipe profile MODEL" in text
    path = tmp_path / "measured.json"
    replace(table, key=replace(table.key, input_shapes={"input_ids": [4, 8], "labels": [4, 8]})).save(path)
    with pytest.raises(CostTableError, match=r"key.input_shapes is .*\[4, 8\].*expected .*\[2, 8\]"):
        CostTable.load(path, expected_key=table.key)
    with pytest.raises(PartitionError, match="measured in float32, but the plan is asked for dtype 'bfloat16'"):
        PlanRequest(profile=PROFILE, num_microbatches=4, microbatch_size=2, dtype="bfloat16", cost_table=table)


def _stage0_blocks(plan, table: CostTable) -> int:
    return sum(1 for b in table.blocks if all(plan.node_stage[n] == 0 for n in b.nodes))


def test_a_slow_block_moves_the_partition_boundary(graph) -> None:
    def plan(table):
        request = PlanRequest(profile=PROFILE, num_microbatches=4, microbatch_size=2, cost_table=table)
        return run_partitioner("seq-dp", graph, request)

    roofline = plan(None)
    same = roofline_table(graph, PROFILE)
    assert plan(same).node_stage == roofline.node_stage  # the table is priced as the roofline it copies
    slow = roofline_table(graph, PROFILE, slower={"transformer.h.0": 6.0})
    measured = plan(slow)
    assert measured.node_stage != roofline.node_stage
    # stage 0 holds the slow layer: it gives up blocks to stage 1
    assert 1 <= _stage0_blocks(measured, slow) < _stage0_blocks(roofline, slow)
    assert measured.predicted.stages[0].forward_s == pytest.approx(
        sum(c.forward_s for n, c in slow.node_costs().items() if measured.node_stage[n] == 0)
    )


def test_a_timed_weight_gradient_sets_the_products_share_of_the_backward(graph) -> None:
    # Every block: forward 1 s, backward 2 s; W (the products' dW, a split backward's) timed at 0.7 s in
    # each layer, 0.3 s after them (lm_head), none in the embeddings (no product). A product's backward
    # is two equal matrix products (dx, dW), so a layer's 4 Conv1D products share 2 × 0.7 = 1.4 s of its
    # 2 s and its other ops (layer norms, attention, GELU) 0.6 s, each group by the roofline's
    # proportions; the simulator's W (half the products') is the W timed.
    weight_s = {"transformer": 0.0, "transformer.ln_f": 0.3}
    timings = BlockTimings(
        blocks=[TimedBlock(b.name, b.nodes, 1.0, 2.0, "", weight_s.get(b.name, 0.7)) for b in blocks_of(graph)],
        dtype="float32",
        device="cpu",
        warmup=0,
        repeats=1,
    )
    table = CostTable.from_timings(graph, timings, PROFILE)
    costs = table.node_costs(graph)
    roofline = node_costs(graph, PROFILE, "float32")
    layer = next(b for b in blocks_of(graph) if b.name == "transformer.h.0").nodes
    products = [n for n in layer if defers_weight_gradient(graph, n)]
    others = [n for n in layer if n not in products]
    assert [str(graph.node(n)["op"]) for n in products] == ["aten.addmm.default"] * 4
    assert math.fsum(costs[n].backward_s for n in products) == pytest.approx(1.4)
    assert math.fsum(costs[n].backward_s for n in others) == pytest.approx(0.6)
    first, last = products[0], products[-1]  # c_attn (d → 3d) and the MLP's c_proj (4d → d)
    assert costs[first].backward_s / costs[last].backward_s == pytest.approx(
        roofline[first].backward_s / roofline[last].backward_s
    )
    assert math.fsum(costs[n].forward_s for n in layer) == pytest.approx(1.0)  # the forward as before
    plan = Partition(node_stage=dict.fromkeys(graph.graph, 0), stage_device=[0], partitioner="test", key=None)
    pipeline = pipeline_costs(plan, graph, PROFILE, costs=costs, schedule="zb-h1", num_microbatches=2)
    assert pipeline.weight_s == pytest.approx([4 * 0.7 + 0.3])
    assert pipeline.backward_s == pytest.approx([6 * 2.0])
    # No W timed (no product there, or timings of a profiler before the split backward): the roofline's shares.
    embeddings = next(b for b in blocks_of(graph) if b.name == "transformer").nodes
    total = math.fsum(roofline[n].backward_s for n in embeddings)
    assert [costs[n].backward_s for n in embeddings] == pytest.approx(
        [2.0 * roofline[n].backward_s / total for n in embeddings]
    )


def _edit(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def _block(text: str, **fields: object) -> str:
    return _edit(text, lambda d: d["blocks"][1].update(fields))
