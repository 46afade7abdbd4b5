"""Re-anchoring: a plan made on one release's graph of a model serves another release's graph.

Toy graphs check each placement rule as literal data; a tiny GPT-2 traced twice, once with an op
added inside a layer (which renames the exporter's later nodes), checks what a transformers release
does, and that a model with a layer more is refused rather than re-anchored.
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
import transformers

from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph import capture_model, trace_model
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.hub import PartitionStore, resolve_partition
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition, PlanRequest, validate_partition
from hf_ftpipe.plan.anchors import GraphAnchors
from hf_ftpipe.plan.reanchor import REANCHOR_TOLERANCE, fit_to_graph, reanchor

from models import tiny_batch, tiny_model
from tiny_captures import tiny_graph
from toy_graphs import UNIT, make_graph


def _layered(extra: dict[str, dict] | None = None, after: str = "", *, rename: bool = True) -> CostGraph:
    """embed → layers.0 (2 ops) → layers.1 (2 ops) → head, in one chain; ``extra`` ops are inserted
    after ``after``. With ``rename``, nodes are numbered as an exporter names them (``op_<i>``), so
    an insertion renames every later op."""
    spec: list[tuple[str, dict]] = [
        ("embed", {"flops": 4.0, "scope": "embed"}),
        ("l0a", {"flops": 4.0, "scope": "layers.0"}),
        ("l0b", {"flops": 4.0, "scope": "layers.0"}),
        ("l1a", {"flops": 4.0, "scope": "layers.1"}),
        ("l1b", {"flops": 4.0, "scope": "layers.1"}),
        ("head", {"flops": 4.0, "scope": "head"}),
    ]
    if extra:
        at = [name for name, _ in spec].index(after) + 1
        spec[at:at] = list(extra.items())
    names = [f"op_{i}" if rename else name for i, (name, _) in enumerate(spec)]
    nodes = {name: attrs for name, (_, attrs) in zip(names, spec)}
    return make_graph(nodes, list(zip(names, names[1:])))


def _plan(graph: CostGraph, num_stages: int = 2) -> Partition:
    return partition_seq_greedy(graph, UNIT, num_stages, num_microbatches=2, microbatch_size=1)


def test_a_plan_on_its_own_graph_is_exact_and_unchanged():
    graph = _layered()
    plan = _plan(graph)
    assert plan.anchors is not None and plan.anchors.digest == graph.digest
    fitted, reanchored = fit_to_graph(plan, graph)
    assert fitted is plan and reanchored is None


def test_an_op_added_inside_a_module_goes_where_the_module_went_and_renamed_ops_keep_their_stage():
    before = _layered()
    plan = _plan(before)
    assert list(plan.node_stage.values()) == [0, 0, 0, 1, 1, 1]  # embed, layers.0 | layers.1, head
    after = _layered({"noop": {"flops": 0.0, "scope": "layers.1", "op": "aten.clone.default"}}, after="l1a")
    result = reanchor(plan, after, UNIT)
    assert result.partition.node_stage == {f"op_{i}": s for i, s in enumerate([0, 0, 0, 1, 1, 1, 1])}
    assert (result.matched, result.by_module, result.by_producer, result.moved, result.dropped) == (6, 1, 0, 0, 0)
    assert result.partition.anchors.digest == after.digest and result.partition.key == plan.key
    assert result.partition.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert "6 of 7 ops matched, 1 placed with their module (in layers.1)" in result.describe()


def test_an_op_in_a_module_cut_between_stages_follows_its_producer():
    before = _layered()
    plan = _plan(before, num_stages=3)  # 8 | 8 | 8: layers.0 and layers.1 are each cut
    assert list(plan.node_stage.values()) == [0, 0, 1, 1, 2, 2]
    after = _layered({"noop": {"flops": 0.0, "scope": "layers.1", "op": "aten.clone.default"}}, after="l1a")
    result = reanchor(plan, after, UNIT)
    assert list(result.partition.node_stage.values()) == [0, 0, 1, 1, 1, 2, 2]  # after l1a, on its stage
    assert (result.by_module, result.by_producer) == (0, 1)


def _graph(rows: list[tuple[str, float, str]], edges: list[tuple[str, str]] | None = None) -> CostGraph:
    """(name, FLOPs, scope) in program order; a chain unless ``edges`` are given."""
    names = [name for name, _, _ in rows]
    nodes = {name: {"flops": flops, "scope": scope} for name, flops, scope in rows}
    return make_graph(nodes, edges if edges is not None else list(zip(names, names[1:])))


def _hand_plan(graph: CostGraph, stages: list[int]) -> Partition:
    """A plan with the given stages (program order), one GPU per stage, priced and anchored."""
    request = PlanRequest(profile=UNIT, num_microbatches=2, microbatch_size=1)
    node_stage = dict(zip(graph.topological_order(), stages))
    stage_device = list(range(max(stages) + 1))
    return Partition(
        node_stage=node_stage,
        stage_device=stage_device,
        partitioner="hand",
        key=request.key_for(graph),
        predicted=request.estimate(graph, node_stage, stage_device),
        anchors=GraphAnchors.of(graph),
    )


def test_an_op_of_the_plan_that_a_release_dropped_leaves_the_rest_in_place():
    rows = [("embed", 4.0, "embed"), ("l0a", 4.0, "layers.0"), ("l0b", 0.0, "layers.0"), ("l1a", 4.0, "layers.1")]
    plan = _hand_plan(_graph(rows), [0, 0, 0, 1])
    result = reanchor(plan, _graph([rows[0], rows[1], rows[3]]), UNIT)  # l0b, which cost nothing, is gone
    assert result.partition.node_stage == {"embed": 0, "l0a": 0, "l1a": 1}
    assert (result.matched, result.dropped) == (3, 1) and "1 of the plan's gone" in result.describe()


def test_a_release_whose_ops_cost_otherwise_is_refused_by_the_cost_check():
    rows = [("embed", 4.0, "embed"), ("l0a", 4.0, "layers.0"), ("l1a", 4.0, "layers.1"), ("l1b", 4.0, "layers.1")]
    plan = _hand_plan(_graph(rows), [0, 0, 1, 1])
    heavier = _graph([*rows[:3], ("extra", 40.0, "layers.1"), rows[3]])
    with pytest.raises(PartitionError, match=r"predicts .* ms per micro-batch .* more than the ±2%"):
        reanchor(plan, heavier, UNIT)


def test_ops_with_no_producer_and_no_known_module_go_before_their_first_consumer():
    rows = [("embed", 4.0, "embed"), ("l0a", 4.0, "layers.0"), ("l1a", 4.0, "layers.1"), ("head", 4.0, "head")]
    plan = _hand_plan(_graph(rows), [0, 0, 1, 1])
    edges = [("embed", "l0a"), ("l0a", "l1a"), ("arange", "l1a"), ("l1a", "head")]
    after = _graph([*rows[:2], ("arange", 0.0, "rotary"), *rows[2:]], edges)
    result = reanchor(plan, after, UNIT)
    assert result.partition.node_stage["arange"] == 1  # with layers.1, its consumer
    assert (result.by_module, result.by_producer) == (0, 1) and "(in rotary)" in result.describe()


def test_a_matched_op_that_would_read_a_later_stage_moves_to_that_stage():
    # The plan computes a mask late, on stage 1; a release computes it first and reads it in layers.0 too.
    rows = [("embed", 4.0, "embed"), ("l0a", 4.0, "layers.0"), ("l0b", 0.0, "layers.0"), ("mask", 0.0, ""),
            ("l1a", 4.0, "layers.1"), ("head", 4.0, "head")]  # fmt: skip
    chain_edges = [("embed", "l0a"), ("l0a", "l0b"), ("l0b", "l1a"), ("l1a", "head")]
    plan = _hand_plan(_graph(rows, [*chain_edges, ("mask", "l1a")]), [0, 0, 0, 1, 1, 1])
    released = [rows[3], *rows[:3], *rows[4:]]
    result = reanchor(plan, _graph(released, [*chain_edges, ("mask", "l1a"), ("mask", "l0b")]), UNIT)
    assert result.partition.node_stage == {"mask": 1, "embed": 0, "l0a": 0, "l0b": 1, "l1a": 1, "head": 1}
    assert result.moved == 1 and "1 moved to a later stage" in result.describe()


def test_a_plan_whose_stage_would_be_empty_or_whose_graph_matches_too_little_is_refused():
    plan = _plan(_layered())
    tiny = make_graph({"op_0": {"flops": 4.0, "scope": "embed"}}, [])
    with pytest.raises(PartitionError, match=r"stages \[1\] would hold no op on this graph"):
        reanchor(plan, tiny, UNIT)
    other = make_graph({f"x{i}": {"flops": 4.0, "scope": f"other.{i}"} for i in range(6)}, [])
    with pytest.raises(PartitionError, match=r"only 0 of the graph's 6 ops match the plan's \(6 ops\)"):
        reanchor(plan, other, UNIT)


def test_a_plan_for_another_model_is_refused_by_fingerprint():
    plan = _plan(_layered())
    other = _layered({"noop": {"flops": 0.0, "scope": "layers.1"}}, after="l1a")
    other.fingerprint = "another-model"
    with pytest.raises(PartitionError, match="made for another model: fingerprint 'toy-fingerprint'"):
        reanchor(plan, other, UNIT)
    with pytest.raises(PartitionError, match=r"^plan\.json: made on another graph of this model and cannot be"):
        fit_to_graph(plan, other, UNIT, source="plan.json")


def test_the_step_time_tolerance_is_small():
    assert 0 < REANCHOR_TOLERANCE <= 0.05


# -- a tiny GPT-2, traced as two releases would -------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_releases() -> tuple[CostGraph, CostGraph]:
    """The same GPT-2 traced as released, and with a no-op added inside block 1's MLP (a release that
    adds zero to the MLP's input), which renames every later op of that kind (``add_9`` is another op)."""
    before = tiny_graph("gpt2")  # tiny_model("gpt2") at tiny_batch("gpt2", 2), shared (tiny_captures)
    model = tiny_model("gpt2")  # the same weights (the same seed), patched below
    batch = tiny_batch("gpt2", 2)
    mlp = model.transformer.h[1].mlp
    forward = mlp.forward
    mlp.forward = types.MethodType(lambda self, hidden: forward(hidden + 0.0), mlp)
    return before, trace_model(model, batch)


def test_gpt2_plan_re_anchors_onto_a_release_with_an_op_more_every_module_on_its_stage(gpt2_releases):
    before, after = gpt2_releases
    assert after.fingerprint == before.fingerprint and after.digest != before.digest
    renamed = [n for n in after.graph if n in before.graph and after.node(n)["scope"] != before.node(n)["scope"]]
    assert renamed, "the added op should shift the exporter's names"
    profile = get_profile("cpu", count=3)
    plan = partition_seq_greedy(before, profile, 3, num_microbatches=2, microbatch_size=2)
    result = reanchor(plan, after, profile)
    validate_partition(result.partition, after, memory_capacity_bytes=profile.memory_bytes)
    assert (result.matched, result.by_module + result.by_producer, result.moved) == (after.num_nodes - 1, 1, 0)
    module_stages: dict[str, set[int]] = {}
    for node, stage in plan.node_stage.items():
        module_stages.setdefault(before.node(node)["scope"], set()).add(stage)
    for node, stage in result.partition.node_stage.items():
        stages = module_stages.get(after.node(node)["scope"], set())
        if len(stages) == 1:  # a module the plan kept whole stays whole, on the same stage
            assert {stage} == stages, node
    assert result.new_scopes == ("transformer.h.1.mlp",)
    assert result.partition.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=REANCHOR_TOLERANCE)


def test_gpt2_with_a_layer_more_is_another_model_not_re_anchored(gpt2_releases):
    before, _ = gpt2_releases
    config = copy.deepcopy(tiny_model("gpt2").config)
    config.n_layer = 3
    deeper = trace_model(transformers.GPT2LMHeadModel(config), tiny_batch("gpt2", 2))
    assert deeper.fingerprint != before.fingerprint
    profile = get_profile("cpu", count=2)
    plan = partition_seq_greedy(before, profile, 2, num_microbatches=2, microbatch_size=2)
    with pytest.raises(PartitionError, match="made for another model"):
        reanchor(plan, deeper, profile)


def test_a_config_key_a_release_adds_at_its_default_keeps_the_fingerprint():
    model = tiny_model("gpt2")

    class ReleasedGPT2Config(transformers.GPT2Config):  # the next release's class: one more setting
        def __init__(self, fused_norm: bool = False, **kwargs):
            self.fused_norm = fused_norm
            super().__init__(**kwargs)

    newer = copy.deepcopy(model)
    newer.config = ReleasedGPT2Config(**model.config.to_dict())
    batch = tiny_batch("gpt2", 2)
    released = tiny_graph("gpt2").fingerprint  # tiny_model("gpt2") at this batch, shared (tiny_captures)

    def fingerprint(config_model) -> str:
        """Of a capture at fixed shapes (faster): the fingerprint holds the config and weights, not the
        graph's ops (tests/graph/test_measure.py checks that a fixed-shape export gives the same)."""
        return capture_model(config_model, batch, dynamic=False).cost_graph.fingerprint

    assert fingerprint(newer) == released
    newer.config.fused_norm = True  # set, it is structure
    assert fingerprint(newer) != released


def test_a_cached_plan_of_the_last_release_is_served_re_anchored_and_cached_again(gpt2_releases, caplog):
    before, after = gpt2_releases
    profile = get_profile("cpu", count=2)
    plan = partition_seq_greedy(before, profile, 2, num_microbatches=2, microbatch_size=2)
    plan.versions["transformers"] = "5.23.0"
    store = PartitionStore()
    store.save_cached(plan)
    never = lambda: pytest.fail("a re-anchored plan must not be recomputed")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="hf_ftpipe.hub"):
        resolved = resolve_partition(after, plan.key, never, profile=profile)
    assert resolved.source == "cache" and resolved.reanchored is not None
    assert set(resolved.partition.node_stage) == set(after.graph)
    line = next(r.getMessage() for r in caplog.records if "re-anchored" in r.getMessage())
    assert "made under transformers 5.23.0" in line and f"(transformers {transformers.__version__})" in line
    again = resolve_partition(after, plan.key, never, profile=profile)  # the cache now holds the exact plan
    assert again.source == "cache" and again.reanchored is None
    assert again.partition.node_stage == resolved.partition.node_stage
    assert torch.__version__  # the versions the plan records are the installed ones
    assert again.partition.versions["transformers"] == transformers.__version__
