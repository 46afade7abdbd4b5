"""The measured cost table: JSON round trip, every defect a clear error, a foreign table refused, and
the plans made from it (a slow block moves the partition boundary)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from cost_tables import roofline_table, tiny_gpt2_traced

from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.costmodel.measured import CostTable, cache_path
from hf_ftpipe.errors import CostTableError, PartitionError
from hf_ftpipe.partitioners.registry import run_partitioner
from hf_ftpipe.plan.request import PlanRequest

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


def _edit(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def _block(text: str, **fields: object) -> str:
    return _edit(text, lambda d: d["blocks"][1].update(fields))
