"""Mixed-Pipe: valid acyclic plans on random DAGs, refinement that never loses, the slide's example."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph import trace_model
from hf_ftpipe.partition import estimate, partition_seq_greedy, validate_partition
from hf_ftpipe.partition.estimate import MemoryOptions, usable_capacity
from hf_ftpipe.partition.mixed import partition_mixed
from hf_ftpipe.partition.mixed.coarsen import atoms_of
from hf_ftpipe.partition.mixed.objective import IncrementalCost
from hf_ftpipe.partition.mixed.refine import refine
from hf_ftpipe.partition.registry import get_partitioner
from hf_ftpipe.profile import get_profile, node_costs

from models import tiny_batch, tiny_model
from toy_graphs import UNIT, make_graph, param

FAST_LINKS = dataclasses.replace(UNIT, link_bandwidth_bytes_per_s=1e6, memory_bytes=10**9)


def encoder_decoder(encoder_flops: float = 15.0, decoder_flops: float = 5.0, num_decoder: int = 6):
    """The slide's example: 3 heavy encoder blocks in a chain, then a chain of lighter decoder
    blocks that each read the encoder's output (T5-like)."""
    nodes = {f"e{i}": encoder_flops for i in range(3)}
    nodes |= {f"d{i}": decoder_flops for i in range(num_decoder)}
    edges = [("e0", "e1"), ("e1", "e2"), ("e2", "d0")]
    edges += [(f"d{i}", f"d{i + 1}") for i in range(num_decoder - 1)]
    edges += [("e2", f"d{i}") for i in range(1, num_decoder)]
    return make_graph(nodes, edges)


def test_mixed_balances_the_encoder_decoder_example_where_contiguous_cannot() -> None:
    graph = encoder_decoder()
    profile = dataclasses.replace(FAST_LINKS, count=3)
    options = {"num_microbatches": 2, "microbatch_size": 1}
    mixed = partition_mixed(graph, profile, **options)
    seq = partition_seq_greedy(graph, profile, **options)
    validate_partition(mixed, graph, usable_capacity(profile))
    assert seq.predicted.imbalance >= 1.19  # best contiguous: e0 e1 | e2 d0 d1 | d2..d5 = 30 vs 25
    assert mixed.predicted.imbalance < seq.predicted.imbalance
    assert mixed.predicted.imbalance <= 1.1
    assert mixed.num_stages > mixed.num_devices  # some GPU runs non-adjacent stages


def test_mixed_is_registered() -> None:
    assert get_partitioner("mixed") is partition_mixed


@st.composite
def random_graphs(draw):
    n = draw(st.integers(3, 24))
    rng = random.Random(draw(st.integers(0, 2**31)))
    nodes = {}
    params = {}
    for i in range(n):
        attrs: dict = {"flops": float(rng.choice([0, 1, 2, 5, 10, 20])), "output_bytes": rng.choice([0, 4, 16, 64])}
        if rng.random() < 0.3:
            name = f"w{rng.randrange(4)}"  # some weights shared by several ops
            params[name] = param(name, (4, 4))
            attrs["params"] = (name,)
        nodes[f"n{i}"] = attrs
    edges = [(f"n{i}", f"n{j}") for j in range(1, n) for i in rng.sample(range(j), k=min(j, rng.choice([1, 1, 2, 3])))]
    num_gpus = draw(st.integers(1, min(4, n)))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "async", "2bw"]))
    return make_graph(nodes, edges, params=params), num_gpus, schedule, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(random_graphs())
def test_every_mixed_plan_is_valid_acyclic_topological_and_fits(case) -> None:
    graph, num_gpus, schedule, recompute = case
    profile = dataclasses.replace(UNIT, count=num_gpus, memory_bytes=10**9)
    memory = MemoryOptions(recompute=recompute)
    options = {"num_microbatches": 3, "microbatch_size": 1, "schedule": schedule, "memory": memory}
    num_atoms = len(atoms_of(graph).blocks())
    if num_gpus > 1 and num_atoms < num_gpus:  # too few indivisible groups to give every GPU one
        with pytest.raises(PartitionError, match=f"has {num_atoms} indivisible groups of ops, fewer than"):
            partition_mixed(graph, profile, **options)
        return
    plan = partition_mixed(graph, profile, **options)
    # structure, every GPU used, stage graph acyclic and numbered topologically, memory
    validate_partition(plan, graph, usable_capacity(profile, memory))
    assert plan.num_devices == num_gpus
    again = estimate(
        graph, plan.node_stage, plan.stage_device, profile,
        num_microbatches=3, microbatch_size=1, schedule=schedule, memory=memory,
    )  # fmt: skip
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s)


@settings(max_examples=40, deadline=None)
@given(random_graphs(), st.integers(0, 2**31))
def test_incremental_cost_matches_estimate_and_refinement_never_worsens(case, seed) -> None:
    graph, num_gpus, schedule, recompute = case
    profile = dataclasses.replace(UNIT, count=num_gpus, memory_bytes=10**9)
    memory = MemoryOptions(recompute=recompute)
    options = {"num_microbatches": 3, "schedule": schedule}
    q = atoms_of(graph)
    atoms = [list(q.members[b]) for b in q.blocks()]
    # a contiguous start, then random moves that keep the numbering topological
    num_stages = min(len(atoms), 2 * num_gpus)
    atom_stage = [i * num_stages // len(atoms) for i in range(len(atoms))]
    stage_device = [s % num_gpus for s in range(num_stages)]
    again = 1.0 if recompute else 0.0  # a recomputed forward counts again
    weight = {n: c.total_s + again * c.forward_s for n, c in node_costs(graph, profile).items()}
    state = IncrementalCost(
        graph, profile, atoms, atom_stage, stage_device, weight,
        optimizer="adamw", memory=memory, limit=[float(usable_capacity(profile, memory))] * num_gpus, **options,
    )  # fmt: skip
    rng = random.Random(seed)
    for _ in range(10):
        a = rng.randrange(len(atoms))
        lo, hi = state.stage_range(a)
        state.move(a, rng.randint(lo, hi))

    def predict():
        node_stage = {n: state.atom_stage[state.atom_of[n]] for n in graph.graph}
        return estimate(graph, node_stage, stage_device, profile, microbatch_size=1, memory=memory, **options)

    before = predict()
    for g, gpu in enumerate(before.gpus):
        assert state.costs()[g] == pytest.approx(gpu.cost_s, rel=1e-9, abs=1e-12)
        assert state.memory(g) == gpu.memory_bytes
    refine(state, deadline=float("inf"))
    after = predict()
    assert after.step_time_s <= before.step_time_s * (1 + 1e-9)
    assert max(g.memory_bytes for g in after.gpus) <= max(
        usable_capacity(profile, memory), max(g.memory_bytes for g in before.gpus)
    )


def test_no_plan_fits_names_the_memory_that_would() -> None:
    graph = make_graph(
        {"a": {"flops": 1.0, "params": ("w",)}, "b": {"flops": 1.0, "params": ("v",)}},
        [("a", "b")],
        params={"w": param("w", (100, 100)), "v": param("v", (100, 100))},
    )
    profile = dataclasses.replace(UNIT, count=2, memory_bytes=1000)
    with pytest.raises(PartitionError, match=r"GPUs with at least .* GiB"):
        partition_mixed(graph, profile, num_microbatches=1, microbatch_size=1)


def test_too_few_ops_for_the_gpus_is_an_error() -> None:
    graph = make_graph({"a": 1.0, "b": 1.0}, [("a", "b")])
    with pytest.raises(PartitionError, match="fewer than the 3 GPUs"):
        partition_mixed(graph, dataclasses.replace(FAST_LINKS, count=3), num_microbatches=1, microbatch_size=1)


def test_tiny_t5_plan_is_valid() -> None:
    batch = tiny_batch("t5", 2)
    graph = trace_model(tiny_model("t5"), batch)
    profile = get_profile("rtx2080ti", count=2)
    plan = partition_mixed(graph, profile, num_microbatches=2, microbatch_size=2, schedule="async")
    validate_partition(plan, graph, usable_capacity(profile))
    assert plan.partitioner == "mixed" and plan.num_devices == 2
    contiguous = get_partitioner("seq-dp")(graph, profile, num_microbatches=2, microbatch_size=2, schedule="async")
    assert plan.predicted.step_time_s <= contiguous.predicted.step_time_s * (1 + 1e-9)
