"""Seq-dp's chain prices a stage at its busiest moment of the schedule's order (`stage_moments`), so a
V plan it says fits fits by the estimate's walk; checked over every split of small graphs."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from hf_ftpipe.costmodel import MemoryOptions
from hf_ftpipe.costmodel.memory_estimate import StageMemory, estimate_memory, nodes_by_stage
from hf_ftpipe.errors import PlanDoesNotFitError
from hf_ftpipe.partitioners import partition_seq_dp
from hf_ftpipe.partitioners.chain import Chain
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner
from hf_ftpipe.partitioners.split_fit import contiguous_fit
from hf_ftpipe.plan.request import PlanRequest

from toy_graphs import UNIT, make_graph, param

RECOMPUTE = MemoryOptions(recompute=True, headroom=0.0)
SIZES = {"num_microbatches": 4, "microbatch_size": 1, "optimizer": "sgd"}
WALK = {"num_microbatches": 4, "optimizer": "sgd", "memory": RECOMPUTE}
"""`estimate_memory`'s arguments for `SIZES`."""


def _linears(widths: list[int]):
    """A chain of products, each with its own trainable matrix (its weight gradient waits for
    ``W``), output i of ``widths[i]`` bytes: under recomputation a stage keeps its input and output
    per micro-batch in flight, but W's inputs, each product's input and output, until its ``W``."""
    names = [f"n{i}" for i in range(len(widths))]
    nodes = {
        n: {"op": "aten.linear.default", "flops": 2.0, "output_bytes": w, "params": (f"w{i}",)}
        for i, (n, w) in enumerate(zip(names, widths))
    }
    params = {f"w{i}": param(f"w{i}", (2, 2)) for i in range(len(widths))}
    return make_graph(nodes, list(zip(names, names[1:])), params=params)


def _splits(graph, num_stages: int, schedule: str, placement: str):
    """Every contiguous split: (bounds, per-GPU estimate, per-stage chain figures, per-stage rules)."""
    request = PlanRequest(profile=UNIT.with_count(2), schedule=schedule, placement=placement, memory=RECOMPUTE, **SIZES)
    planner = ContiguousPlanner.of("seq-dp", graph, request)
    chain = Chain(planner, max_blocks=64)
    num_ops = chain.num_blocks
    stage_device = request.stage_devices(num_stages)
    for cuts in itertools.combinations(range(1, num_ops), num_stages - 1):
        bounds = [0, *cuts, num_ops]
        node_stage = planner.cut_order.node_stage(bounds)
        walked = estimate_memory(graph, node_stage, stage_device, schedule=schedule, **WALK)
        chained = [float(chain.memory(s, num_stages, bounds[s + 1])[bounds[s]]) for s in range(num_stages)]
        stages = StageMemory(graph, node_stage, nodes_by_stage(graph, node_stage, stage_device), stage_device,
                             SIZES["num_microbatches"], "sgd", schedule, RECOMPUTE)  # fmt: skip
        yield bounds, walked, chained, [stages.of_stage(s) for s in range(num_stages)], stage_device


@pytest.mark.parametrize(("schedule", "placement", "num_stages"), [("zbv", "v", 4), ("zb-h1", "chain", 2)])
@pytest.mark.parametrize("widths", [[16] * 8, [16, 64, 16, 64, 16, 64, 16, 16], [64, 16, 16, 64, 64, 16, 64, 16]])
def test_the_chain_bounds_every_gpu_of_every_split_by_the_walk(widths, schedule, placement, num_stages):
    # A GPU's stages, each at its own busiest moment, hold at least what the GPU holds at its own:
    # a split whose stages fit their shares of a GPU fits it. One stage per GPU: the walk itself.
    for bounds, walked, chained, _, stage_device in _splits(_linears(widths), num_stages, schedule, placement):
        for g, need in enumerate(walked):
            mine = sum(c for c, d in zip(chained, stage_device) if d == g)
            assert mine >= need, (bounds, g, mine, need)
            if placement == "chain":
                assert mine == need, (bounds, g, mine, need)


def test_a_v_split_the_per_stage_rules_accepted_the_walk_rejects_and_seq_dp_plans_one_that_fits():
    graph = _linears([16, 64, 16, 64, 16, 64, 16, 16])
    splits = list(_splits(graph, 4, "zbv", "v"))
    # The per-stage rules (`StageMemory.of_stage`) price a micro-batch awaiting W at the stage's
    # inputs and outputs only (all it keeps in flight under recomputation), where W reads each
    # product's input and output: with two stages per GPU at half a GPU each, they accept splits
    # whose GPUs hold more than a GPU by the walk.
    optimistic = [split for split in splits if max(split[1]) > 2 * max(split[3])]
    assert optimistic
    bounds, walked, chained, rules, _ = min(optimistic, key=lambda split: max(split[3]))
    capacity = 2 * max(rules)
    assert max(chained) > capacity // 2, (bounds, walked, chained, rules)  # the chain rejects it
    # seq-dp, given that capacity, plans a split whose stages fit half of it each by the walk,
    # and so that fits by the estimate; or none fits that way and it says so.
    profile = replace(UNIT.with_count(2), memory_bytes=capacity)
    accepted = [split for split in splits if max(split[2]) <= capacity // 2]
    if not accepted:
        with pytest.raises(PlanDoesNotFitError):
            partition_seq_dp(graph, profile, placement="v", schedule="zbv", memory=RECOMPUTE, **SIZES)
        return
    plan = partition_seq_dp(graph, profile, placement="v", schedule="zbv", memory=RECOMPUTE, **SIZES)
    assert max(g.memory_bytes for g in plan.predicted.gpus) <= capacity
    assert any(plan.node_stage == _node_stage(graph, split[0]) for split in accepted)


def test_seq_dp_s_v_plan_under_recomputation_fits_the_capacity_it_was_given():
    # The capacity of the leanest split by the chain's walked figures: seq-dp must find a plan, and
    # that plan's estimate (the walk) fits; a byte less and nothing fits.
    graph = _linears([64, 16, 16, 64, 64, 16, 64, 16])
    leanest = min(max(chained) for _, _, chained, _, _ in _splits(graph, 4, "zbv", "v"))
    profile = replace(UNIT.with_count(2), memory_bytes=int(2 * leanest))
    plan = partition_seq_dp(graph, profile, placement="v", schedule="zbv", memory=RECOMPUTE, **SIZES)
    walked = estimate_memory(graph, plan.node_stage, plan.stage_device, schedule="zbv", **WALK)
    assert [g.memory_bytes for g in plan.predicted.gpus] == walked
    assert max(walked) <= profile.memory_bytes
    with pytest.raises(PlanDoesNotFitError):
        partition_seq_dp(graph, replace(profile, memory_bytes=int(2 * leanest) - 2),
                         placement="v", schedule="zbv", memory=RECOMPUTE, **SIZES)  # fmt: skip


def _node_stage(graph, bounds: list[int]) -> dict[str, int]:
    from hf_ftpipe.partitioners.contiguous import CutOrder

    return CutOrder.of(graph).node_stage(bounds)


@pytest.mark.parametrize("widths", [[16, 64, 16, 64, 16, 64, 16, 16], [64, 16, 16, 64, 64, 16, 64, 16]])
def test_the_fewest_gpus_named_for_zb_h1_are_the_fewest_seq_dp_fits(widths):
    # zb-h1 keeps W's inputs beside what is in flight, which the per-stage rules leave out: the GPU
    # count the advice names must be the count seq-dp plans on, at every capacity.
    graph = _linears(widths)
    counts = range(1, len(widths) + 1)
    named = set()
    for capacity in range(100, 1200, 20):
        profile = replace(UNIT.with_count(2), memory_bytes=capacity)
        fitting = [n for n in counts if _seq_dp_fits(graph, profile.with_count(n), "zb-h1")]
        fewest = contiguous_fit(graph, profile, schedule="zb-h1", memory=RECOMPUTE, **SIZES).num_gpus
        assert fewest == (fitting[0] if fitting else None), capacity
        named.add(fewest)
    assert len(named - {None}) >= 3  # several counts named, each the first that fits


def _seq_dp_fits(graph, profile, schedule: str) -> bool:
    try:
        partition_seq_dp(graph, profile, schedule=schedule, memory=RECOMPUTE, **SIZES)
    except PlanDoesNotFitError:
        return False
    return True
