"""Properties of every simulated timeline, on random placements, costs, links and schedules: no
action starts before what it depends on, no rank runs two actions at once, memory never goes
negative (and a flushing step gives back every activation)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.plan import Partition
from hf_ftpipe.schedules.actions import Action, dependencies
from hf_ftpipe.simulator import PipelineCosts, SimulationResult, StageEdge, pipeline_costs, simulate, simulate_costs
from tests.helpers.toy_graphs import UNIT, random_dag

EPSILON = 1e-9


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[PipelineCosts, str, int, int | None]:
    """A random pipeline: stages on ranks (every rank used, Mixed-Pipe placements included),
    chain edges with now and then a skip edge, random times, bytes, link and memory."""
    num_ranks = draw(st.integers(1, 3))
    num_stages = draw(st.integers(num_ranks, 5))
    stage_rank = list(range(num_ranks)) + [draw(st.integers(0, num_ranks - 1)) for _ in range(num_stages - num_ranks)]
    stage_rank = draw(st.permutations(stage_rank))
    pairs = {(s, s + 1) for s in range(num_stages - 1)}
    pairs |= {
        p
        for p in draw(st.sets(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=3))
        if p[0] + 1 < p[1] < num_stages
    }
    edges = [StageEdge(s, t, draw(st.integers(0, 50)), draw(st.sampled_from([0, 8, 40]))) for s, t in sorted(pairs)]
    times = st.floats(0.0, 5.0, allow_nan=False)
    costs = PipelineCosts(
        stage_rank=list(stage_rank),
        forward_s=[draw(times) for _ in stage_rank],
        backward_s=[draw(times) for _ in stage_rank],
        update_s=[draw(st.floats(0.0, 1.0)) for _ in stage_rank],
        edges=edges,
        link_latency_s=draw(st.floats(0.0, 2.0)),
        link_bandwidth_bytes_per_s=draw(st.sampled_from([1.0, 10.0, float("inf")])),
        static_bytes=[draw(st.integers(0, 100)) for _ in range(num_ranks)],
        activation_bytes=[draw(st.integers(0, 30)) for _ in stage_rank],
        backward_bytes=[draw(st.integers(0, 30)) for _ in stage_rank],
    )
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "async", "2bw"]))
    slices = draw(st.sampled_from([None, None, 2])) if schedule in ("gpipe", "1f1b") else None
    return costs, schedule, draw(st.integers(1, 5)), slices


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_simulated_timelines_keep_order_exclusivity_and_memory(case: tuple) -> None:
    costs, schedule, num_microbatches, num_slices = case
    result = simulate_costs(
        costs, schedule, num_microbatches, num_slices=num_slices, steps=3 if schedule in ("async", "2bw") else 1
    )
    check_timeline(result, costs, schedule, num_slices)


def check_timeline(result: SimulationResult, costs: PipelineCosts, schedule: str, num_slices: int | None) -> None:
    ends = {(e.stage, e.kind, e.microbatch, e.slice): e for e in result.events}
    assert len(ends) == len(result.events), "an action ran twice"
    producers: list[list[int]] = [[] for _ in costs.stage_rank]
    consumers: list[list[int]] = [[] for _ in costs.stage_rank]
    for edge in costs.edges:
        producers[edge.target].append(edge.source)
        # A value without a gradient sends none back: its producer's backward waits for nothing
        # on another rank (the executor's rule); on one rank the program order keeps it anyway.
        if edge.grad_bytes > 0 or costs.stage_rank[edge.source] == costs.stage_rank[edge.target]:
            consumers[edge.source].append(edge.target)

    for event in result.events:  # everything it depends on ended before it started
        action = Action(event.stage, event.kind, event.microbatch, event.slice)  # type: ignore[arg-type]
        for need in dependencies(action, producers, consumers, num_slices):
            done = ends[(need.stage_index, need.computation, need.microbatch_index, need.slice_index)]
            assert done.end_s <= event.start_s + EPSILON, f"{event.label} starts before {need} ends"

    for message in result.messages:  # a message arrives after it was sent, and its reader waits for it
        assert message.arrive_s >= message.send_s + costs.link_latency_s * (message.bytes > 0) - EPSILON
        if message.value == "loss":
            continue
        source, target = (int(x) for x in message.value[1:].split("to"))
        reader = (
            source if message.backward else target,
            "B" if message.backward else "F",
            message.microbatch,
            message.slice,
        )
        if reader in ends:  # a streaming step's last messages are read in a step not simulated
            assert ends[reader].start_s >= message.arrive_s - EPSILON

    for rank in range(result.num_ranks):  # one action at a time
        events = sorted(result.events_of(rank), key=lambda e: (e.start_s, e.end_s))
        for before, after in zip(events, events[1:]):
            assert before.end_s <= after.start_s + EPSILON, f"rank {rank} runs {before.label} and {after.label} at once"
        points = result.memory[rank]
        assert all(b >= 0 for _, b in points), f"rank {rank}'s memory goes negative: {points}"
        assert [t for t, _ in points] == sorted(t for t, _ in points)
        if schedule in ("gpipe", "1f1b"):  # a flush gives every activation back
            assert points[-1][1] == costs.static_bytes[rank]

    assert -EPSILON <= result.bubble_fraction <= 1 + EPSILON
    assert all(-EPSILON <= idle for idle in result.idle_s)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_ops=st.integers(4, 14),
    stage_device=st.sampled_from([[0, 1], [0, 1, 2], [0, 1, 1, 0], [1, 0, 1]]),
    schedule=st.sampled_from(["gpipe", "1f1b", "async", "2bw"]),
    num_microbatches=st.integers(1, 4),
)
def test_plans_on_random_graphs_simulate_within_the_same_bounds(
    seed: int, num_ops: int, stage_device: list[int], schedule: str, num_microbatches: int
) -> None:
    # A random DAG cut into contiguous stages (acyclic), priced by the roofline of a profile with
    # a 4 B/s link: skip edges, values without gradients and shared weights all occur.
    graph = random_dag(seed, num_ops)
    order = graph.topological_order()
    node_stage = {name: i * len(stage_device) // len(order) for i, name in enumerate(order)}
    plan = Partition(node_stage=node_stage, stage_device=stage_device, partitioner="test", key=None)
    profile = dataclasses.replace(UNIT, link_bandwidth_bytes_per_s=4.0, link_latency_s=0.5)
    costs = pipeline_costs(plan, graph, profile, schedule=schedule, num_microbatches=num_microbatches)
    result = simulate(plan, schedule, graph=graph, profile=profile, num_microbatches=num_microbatches)
    check_timeline(result, costs, schedule, None)
    assert result.step_time_s == simulate_costs(costs, schedule, num_microbatches).step_time_s
