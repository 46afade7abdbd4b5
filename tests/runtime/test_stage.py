"""`hf_ftpipe.runtime.stage.plan_stages`: a loss computed from the model's outputs gets them on the loss
stage, wherever the plan computes them (one process; the trained comparison with `Trainer` is
test_any_batch.py's ``gpt2-smoothing`` and ``gpt2-loss-func``)."""

from __future__ import annotations

import pytest

from hf_ftpipe.graph import CostGraph
from hf_ftpipe.runtime.stage import loss_reads_of, plan_stages

from placements import logits_apart_placement
from tiny_captures import tiny_graph


@pytest.fixture(scope="module")
def gpt2_graph() -> CostGraph:
    return tiny_graph("gpt2", batch_size=4)


def test_the_logits_are_sent_to_the_loss_stage_that_reads_only_a_view_of_them(gpt2_graph: CostGraph) -> None:
    outputs = dict(zip(gpt2_graph.output_names, gpt2_graph.outputs, strict=False))
    logits, loss = outputs["logits"], outputs["loss"]
    node_stage = logits_apart_placement(gpt2_graph, [0, 1, 0])
    assert node_stage[logits] == 1 and node_stage[loss] == 2

    own = plan_stages(gpt2_graph, node_stage)  # the model's own loss reads a view of the logits only
    assert logits not in own[2].received and own[1].consumers[logits] == []
    assert loss_reads_of(gpt2_graph, own) == []

    routed = plan_stages(gpt2_graph, node_stage, loss_reads=["logits"])
    assert routed[2].received == [*own[2].received, logits]
    assert routed[1].sent == own[1].sent and routed[1].consumers[logits] == [2]
    assert routed[1].model_outputs == {"logits": logits} and routed[2].model_outputs == {"loss": loss}
    assert [spec.received for spec in routed[:2]] == [spec.received for spec in own[:2]]
    assert loss_reads_of(gpt2_graph, routed) == ["logits"]


def test_an_output_the_loss_stage_reads_anyway_is_received_once(gpt2_graph: CostGraph) -> None:
    outputs = dict(zip(gpt2_graph.output_names, gpt2_graph.outputs, strict=False))
    order = gpt2_graph.topological_order()
    cut = order.index(outputs["logits"]) + 1  # the loss's ops, the first reading the logits, on stage 1
    node_stage = {name: int(i >= cut) for i, name in enumerate(order)}
    own = plan_stages(gpt2_graph, node_stage)
    routed = plan_stages(gpt2_graph, node_stage, loss_reads=["logits", "logits"])
    assert own[1].received.count(outputs["logits"]) == 1
    assert [(s.received, s.sent, s.consumers) for s in routed] == [(s.received, s.sent, s.consumers) for s in own]
