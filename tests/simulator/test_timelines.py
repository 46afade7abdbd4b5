"""Simulated timelines of small pipelines, worked out by hand and asserted literally.

Every case: a forward takes 1 s, a backward 2 s, a weight update nothing, links are free unless a
test says otherwise. ``0F0@0-1`` is stage 0's forward of micro-batch 0 from t = 0 to t = 1 s.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.simulator import PipelineCosts, SimulationResult, StageEdge, simulate_costs


def toy(stage_rank: list[int], forward_s: float = 1.0, backward_s: float = 2.0, **link: float) -> PipelineCosts:
    """A chain of stages on ``stage_rank``, each passing 8 bytes (and their gradient) to the next."""
    edges = [StageEdge(s, s + 1, 8, 8) for s in range(len(stage_rank) - 1)]
    n = len(stage_rank)
    return PipelineCosts(
        stage_rank=stage_rank, forward_s=[forward_s] * n, backward_s=[backward_s] * n, edges=edges, **link
    )


def timeline(result: SimulationResult, step: int | None = None) -> dict[int, str]:
    """Each rank's actions as ``label@start-end``, of one step or all."""
    return {
        rank: " ".join(
            f"{e.label}@{e.start_s:g}-{e.end_s:g}" for e in result.events_of(rank) if step is None or e.step == step
        )
        for rank in range(result.num_ranks)
    }


def test_gpipe_two_ranks_four_microbatches() -> None:
    # Rank 1 starts each forward as rank 0's arrives; its backwards start after its last forward;
    # rank 0's backward m waits for rank 1's backward m: (M + P - 1)(f + b) = 5 × 3 = 15 s.
    result = simulate_costs(toy([0, 1]), "gpipe", 4)
    assert timeline(result) == {
        0: "0F0@0-1 0F1@1-2 0F2@2-3 0F3@3-4 0B0@7-9 0B1@9-11 0B2@11-13 0B3@13-15",
        1: "1F0@1-2 1F1@2-3 1F2@3-4 1F3@4-5 1B0@5-7 1B1@7-9 1B2@9-11 1B3@11-13",
    }
    assert result.step_time_s == 15
    assert result.busy_s == [12, 12]
    assert result.bubble_fraction == pytest.approx(1 - 24 / 30)
    assert result.analytical_step_s is None  # no plan, no prediction


def test_1f1b_two_ranks_four_microbatches() -> None:
    # Rank 0 holds two micro-batches (its depth), then alternates; rank 1 runs each backward at once.
    result = simulate_costs(toy([0, 1]), "1f1b", 4)
    assert timeline(result) == {
        0: "0F0@0-1 0F1@1-2 0B0@4-6 0F2@6-7 0B1@7-9 0F3@9-10 0B2@10-12 0B3@13-15",
        1: "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 1F2@7-8 1B2@8-10 1F3@10-11 1B3@11-13",
    }
    assert result.step_time_s == 15


def test_async_streams_without_a_flush() -> None:
    # Each backward is followed by its stage's update (0 s); step 1 starts where step 0 ended on
    # each rank, with rank 0's backward of micro-batch 3 carried over: the steady step is M(f + b).
    result = simulate_costs(toy([0, 1]), "async", 4, steps=2)
    assert timeline(result, step=0) == {
        0: "0F0@0-1 0F1@1-2 0B0@4-6 0U0@6-6 0F2@6-7 0B1@7-9 0U1@9-9 0F3@9-10 0B2@10-12 0U2@12-12",
        1: "1F0@1-2 1B0@2-4 1U0@4-4 1F1@4-5 1B1@5-7 1U1@7-7 1F2@7-8 1B2@8-10 1U2@10-10 1F3@10-11 1B3@11-13 1U3@13-13",
    }
    assert timeline(result, step=1) == {
        0: "0F4@12-13 0B3@13-15 0U3@15-15 0F5@15-16 0B4@16-18 0U4@18-18 0F6@18-19 0B5@19-21 0U5@21-21 0F7@21-22 "
        "0B6@22-24 0U6@24-24",
        1: "1F4@13-14 1B4@14-16 1U4@16-16 1F5@16-17 1B5@17-19 1U5@19-19 1F6@19-20 1B6@20-22 1U6@22-22 1F7@22-23 "
        "1B7@23-25 1U7@25-25",
    }
    assert result.step_ends_s == [13, 25]
    assert result.step_time_s == 12 and result.bubble_fraction == 0


def test_2bw_updates_once_per_minibatch() -> None:
    # The order of async, one update per stage after the mini-batch's last backward on that stage.
    result = simulate_costs(toy([0, 1]), "2bw", 4, steps=2)
    assert timeline(result, step=1) == {
        0: "0F4@12-13 0B3@13-15 0U3@15-15 0F5@15-16 0B4@16-18 0F6@18-19 0B5@19-21 0F7@21-22 0B6@22-24",
        1: "1F4@13-14 1B4@14-16 1F5@16-17 1B5@17-19 1F6@19-20 1B6@20-22 1F7@22-23 1B7@23-25 1U7@25-25",
    }
    assert result.step_time_s == 12


def test_mixed_pipe_placement_0110_gpipe() -> None:
    # Stages 0 and 3 on rank 0, 1 and 2 on rank 1: rank 0 runs its stages' forwards in stage order;
    # rank 1's consecutive stages 1 and 2 take each micro-batch through both (2F m right after
    # 1F m, 1B m right after 2B m), so stage 3 starts after stage 2's first forward, and so on back.
    result = simulate_costs(toy([0, 1, 1, 0]), "gpipe", 4)
    assert timeline(result) == {
        0: "0F0@0-1 0F1@1-2 0F2@2-3 0F3@3-4 3F0@4-5 3F1@5-6 3F2@7-8 3F3@9-10 3B0@10-12 3B1@12-14 3B2@14-16 "
        "3B3@16-18 0B0@18-20 0B1@20-22 0B2@24-26 0B3@28-30",
        1: "1F0@1-2 2F0@2-3 1F1@3-4 2F1@4-5 1F2@5-6 2F2@6-7 1F3@7-8 2F3@8-9 2B0@12-14 1B0@14-16 2B1@16-18 "
        "1B1@18-20 2B2@20-22 1B2@22-24 2B3@24-26 1B3@26-28",
    }
    assert result.step_time_s == 30


def test_mixed_pipe_placement_0110_1f1b() -> None:
    # Each rank runs its deepest ready stage first, a backward before a forward, stage s holding at
    # most 4 - s micro-batches (`in_flight`); every start below is the later of the rank's previous
    # end and the end of what the action depends on.
    result = simulate_costs(toy([0, 1, 1, 0]), "1f1b", 4)
    assert timeline(result) == {
        0: "0F0@0-1 0F1@1-2 0F2@2-3 3F0@3-4 3B0@4-6 3F1@6-7 3B1@7-9 3F2@9-10 3B2@10-12 0F3@12-13 0B0@13-15 "
        "0B1@17-19 0B2@19-21 3F3@21-22 3B3@22-24 0B3@28-30",
        1: "1F0@1-2 2F0@2-3 1F1@3-4 2F1@4-5 1F2@5-6 2B0@6-8 2F2@8-9 2B1@9-11 1B0@11-13 2B2@13-15 1B1@15-17 "
        "1B2@17-19 1F3@19-20 2F3@20-21 2B3@24-26 1B3@26-28",
    }


def split_in_two() -> PipelineCosts:
    """`toy([0, 1])` with stage 0 split in two halves on GPU 0: the same work, one stage more."""
    edges = [StageEdge(0, 1, 8, 8), StageEdge(1, 2, 8, 8)]
    return PipelineCosts(stage_rank=[0, 0, 1], forward_s=[0.5, 0.5, 1], backward_s=[1, 1, 2], edges=edges)


def test_gpipe_takes_each_micro_batch_through_a_split_stage_at_once() -> None:
    # GPU 0 runs 0F m then 1F m (0.5 s each), so 1F m ends at m + 1 and GPU 1 runs 2F m at m + 1;
    # its backwards 2B m at 5 + 2m; GPU 0 then 1B m and 0B m, 1 s each: 0B3 ends at 15, as
    # `toy([0, 1])` does (test_gpipe_two_ranks_four_microbatches). The lower bound: GPU 1 waits
    # 1 s for its first input, works 12 s, and GPU 0 needs 2 s after GPU 1's last backward.
    result = simulate_costs(split_in_two(), "gpipe", 4)
    assert timeline(result) == {
        0: "0F0@0-0.5 1F0@0.5-1 0F1@1-1.5 1F1@1.5-2 0F2@2-2.5 1F2@2.5-3 0F3@3-3.5 1F3@3.5-4 "
        "1B0@7-8 0B0@8-9 1B1@9-10 0B1@10-11 1B2@11-12 0B2@12-13 1B3@13-14 0B3@14-15",
        1: "2F0@1-2 2F1@2-3 2F2@3-4 2F3@4-5 2B0@5-7 2B1@7-9 2B2@9-11 2B3@11-13",
    }
    assert result.step_time_s == 15


@pytest.mark.parametrize(("schedule", "step_s"), [("gpipe", 27), ("1f1b", 27), ("async", 24), ("2bw", 24)])
def test_a_stage_split_in_two_on_one_gpu_is_no_slower(schedule: str, step_s: float) -> None:
    # 8 micro-batches. gpipe by hand as above: 1 + 8 × 3 + 2 = 27 s. The orders price a GPU's
    # stages as sharing its time, so the split orders as the unsplit pipeline does.
    split = simulate_costs(split_in_two(), schedule, 8)
    whole = simulate_costs(toy([0, 1]), schedule, 8)
    assert split.step_time_s == whole.step_time_s == step_s


@settings(max_examples=25, deadline=None)
@given(
    num_stages=st.integers(1, 5),
    num_microbatches=st.integers(1, 8),
    forward_s=st.integers(1, 5),
    backward_s=st.integers(1, 9),
)
def test_gpipe_with_equal_stages_and_free_links_takes_m_plus_p_minus_1_times_f_plus_b(
    num_stages: int, num_microbatches: int, forward_s: int, backward_s: int
) -> None:
    # The last stage's forwards end at (M + P - 1) f; the backwards then pass back through P - 1
    # stages after its M: (M + P - 1)(f + b), exactly (integer seconds).
    costs = toy(list(range(num_stages)), float(forward_s), float(backward_s))
    result = simulate_costs(costs, "gpipe", num_microbatches)
    assert result.step_time_s == (num_microbatches + num_stages - 1) * (forward_s + backward_s)


@pytest.mark.parametrize("latency_s", [0.25, 3.0])
def test_link_latency_shows_up_twice_in_a_two_rank_gpipe_step(latency_s: float) -> None:
    # The activations reach rank 1 L late, the gradients reach rank 0 L late; nothing else waits
    # on the link (the loss reaches rank 0 long before its last backward): (M + 1)(f + b) + 2L.
    result = simulate_costs(toy([0, 1], link_latency_s=latency_s), "gpipe", 4)
    assert result.step_time_s == pytest.approx(15 + 2 * latency_s)
    first = result.messages[0]
    assert (first.value, first.send_s, first.arrive_s) == ("h0to1", 1.0, 1.0 + latency_s)


def test_bandwidth_queues_messages_on_one_link() -> None:
    # 8 bytes at 4 B/s hold the link 2 s: rank 0's forwards end every 1 s, so the activations
    # leave at 1, 3, 5, 7 and arrive 2 s later; rank 1's forwards follow them.
    result = simulate_costs(toy([0, 1], link_bandwidth_bytes_per_s=4.0), "gpipe", 4)
    forwards = [m for m in result.messages if m.value == "h0to1" and not m.backward]
    assert [(m.send_s, m.arrive_s) for m in forwards] == [(1, 3), (2, 5), (3, 7), (4, 9)]
    assert timeline(result)[1].startswith("1F0@3-4 1F1@5-6 1F2@7-8 1F3@9-10 1B0@10-12")


def test_token_slices_take_an_equal_share_of_their_stage() -> None:
    # One sequence in two slices, each 0.5 s forward and 1 s backward: the slices' forwards go in
    # order, their backwards last slice first, each waiting for the same slice downstream.
    result = simulate_costs(toy([0, 1]), "gpipe", 1, num_slices=2)
    assert timeline(result) == {
        0: "0F0.0@0-0.5 0F0.1@0.5-1 0B0.1@2.5-3.5 0B0.0@3.5-4.5",
        1: "1F0.0@0.5-1 1F0.1@1-1.5 1B0.1@1.5-2.5 1B0.0@2.5-3.5",
    }
    assert result.stages == [
        {"stage": 0, "rank": 0, "forward_s": 1.0, "backward_s": 2.0},
        {"stage": 1, "rank": 1, "forward_s": 1.0, "backward_s": 2.0},
    ]
