"""Schedules are data: the per-rank action lists, asserted literally, and checked without processes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.costmodel import in_flight
from hf_ftpipe.schedules.orders import (
    Action,
    Schedule1F1B,
    ScheduleGPipe,
    StreamingSchedule,
    chain_edges,
    check_order,
    format_actions,
    make_schedule,
)


def test_gpipe_two_ranks_three_microbatches() -> None:
    schedule = ScheduleGPipe([0, 1], num_microbatches=3)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 0F2 0B0 0B1 0B2"
    assert format_actions(schedule.actions_of(1)) == "1F0 1F1 1F2 1B0 1B1 1B2"


def test_gpipe_mixed_placement_rank_holds_non_adjacent_stages() -> None:
    # Rank 1's stages 1 and 2 are consecutive: each micro-batch goes through both at once.
    schedule = ScheduleGPipe([0, 1, 1, 0], num_microbatches=2)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1"
    assert format_actions(schedule.actions_of(1)) == "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"
    assert str(schedule) == "rank 0: 0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1\nrank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"


def test_gpipe_takes_a_micro_batch_through_a_split_stage_at_once() -> None:
    # Stages 0 and 1 on rank 0 are one stage split in two: stage 1 forwards micro-batch m right
    # after stage 0, so rank 1 can start it; backwards likewise, last stage of the run first.
    schedule = ScheduleGPipe([0, 0, 1], num_microbatches=2)
    assert str(schedule) == "rank 0: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\nrank 1: 2F0 2F1 2B0 2B1"
    # A stage that feeds another stage too is no split: stage-major as before.
    skip = ScheduleGPipe([0, 0, 1], num_microbatches=2, edges=[(0, 1), (0, 2), (1, 2)])
    assert str(skip) == "rank 0: 0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1\nrank 1: 2F0 2F1 2B0 2B1"


def test_every_action_once_and_each_forward_before_its_backward() -> None:
    schedule = ScheduleGPipe([0, 1, 0, 2], num_microbatches=4)
    order = schedule.global_order()
    assert len(order) == len(set(order)) == 4 * 4 * 2
    for action in order:
        if action.computation == "B":
            assert order.index(Action(action.stage_index, "F", action.microbatch_index)) < order.index(action)
            if action.stage_index + 1 < 4:  # the gradient comes from the next stage's backward
                assert order.index(Action(action.stage_index + 1, "B", action.microbatch_index)) < order.index(action)


def test_1f1b_two_ranks_is_the_textbook_order() -> None:
    schedule = Schedule1F1B([0, 1], num_microbatches=4)
    assert str(schedule) == "rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"


def test_1f1b_four_ranks_warms_up_by_depth() -> None:
    schedule = Schedule1F1B([0, 1, 2, 3], num_microbatches=6)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert format_actions(schedule.actions_of(3)) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_1f1b_split_stage_keeps_the_next_rank_in_textbook_order() -> None:
    # Stage 0 of [0, 1] split in two on rank 0: rank 0's two stages share its time (forward 1/2,
    # backward 2/2 in the ordering's units, rank 1's 2 and 4), so rank 1 alternates as with
    # [0, 1] and rank 0 runs each micro-batch through both halves; stage 0 holds at most 3
    # micro-batches and stage 1 at most 2 (`in_flight`).
    schedule = Schedule1F1B([0, 0, 1], num_microbatches=4)
    assert format_actions(schedule.actions_of(0)) == "0F0 1F0 0F1 1F1 0F2 1B0 1F2 0B0 0F3 1B1 1F3 0B1 1B2 0B2 1B3 0B3"
    assert format_actions(schedule.actions_of(1)) == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"


def test_1f1b_stage_that_holds_every_microbatch_runs_its_forwards_first() -> None:
    # Rank 1's four stages are quick (a quarter of the rank each): 0B0 is ready before 0F4 would
    # start, but stage 0 may hold all 5 micro-batches, and the memory rules count no gradients
    # beside its activations (`gradients_persist`), so its forwards go first, as under GPipe.
    schedule = Schedule1F1B([0, 1, 1, 1, 1], num_microbatches=5)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 0F2 0F3 0F4 0B0 0B1 0B2 0B3 0B4"


def test_async_streams_into_the_next_step_and_drains() -> None:
    schedule = StreamingSchedule("async", [0, 1], num_microbatches=4)
    first, second, rest = schedule.next_step(), schedule.next_step(), schedule.drain()
    assert format_actions(first) == (
        "0F0 0F1 1F0 1B0 1U0 0B0 0U0 1F1 1B1 1U1 0F2 0B1 0U1 1F2 1B2 1U2 0F3 0B2 0U2 1F3 1B3 1U3"
    )
    # 0B3 waits for the next step: no flush, so the step after starts with it
    assert format_actions(second) == (
        "0F4 0B3 0U3 1F4 1B4 1U4 0F5 0B4 0U4 1F5 1B5 1U5 0F6 0B5 0U5 1F6 1B6 1U6 0F7 0B6 0U6 1F7 1B7 1U7"
    )
    assert format_actions(rest) == "0B7 0U7"
    assert not schedule.in_flight and schedule.given == 0


def test_2bw_updates_once_per_stage_after_each_minibatch() -> None:
    schedule = StreamingSchedule("2bw", [0, 1], num_microbatches=2)
    steps = [schedule.next_step(), schedule.next_step(), schedule.drain()]
    assert [format_actions(step) for step in steps] == [
        "0F0 0F1 1F0 1B0 0B0 1F1 1B1 1U1",
        "0F2 0B1 0U1 1F2 1B2 0F3 0B2 1F3 1B3 1U3",
        "0B3 0U3",
    ]


def test_async_with_accumulation_updates_every_g_backwards_and_once_more_at_the_end() -> None:
    schedule = StreamingSchedule("async", [0, 1], num_microbatches=2, gradient_accumulation_steps=3)
    steps = [schedule.next_step(), schedule.next_step(), schedule.drain()]
    updates = [str(a) for step in steps for a in step if a.computation == "U"]
    assert updates == ["1U2", "0U2", "0U3", "1U3"]  # after 3 backwards, then the leftover one at drain


@settings(max_examples=60, deadline=None)
@given(
    stage_rank=st.lists(st.integers(0, 3), min_size=1, max_size=7),
    num_microbatches=st.integers(1, 6),
    name=st.sampled_from(["gpipe", "1f1b", "async", "2bw"]),
    steps=st.integers(1, 3),
)
def test_every_schedule_is_a_valid_order_within_its_in_flight_limits(
    stage_rank: list[int], num_microbatches: int, name: str, steps: int
) -> None:
    ranks = sorted(set(stage_rank))
    stage_rank = [ranks.index(r) for r in stage_rank]
    edges = chain_edges(len(stage_rank)) + [(0, s) for s in range(2, len(stage_rank))]  # skip connections too
    schedule = make_schedule(name, stage_rank, num_microbatches, edges)
    if isinstance(schedule, StreamingSchedule):
        order = [a for _ in range(steps) for a in schedule.next_step()] + schedule.drain()
        total = steps * num_microbatches
    else:
        order, total = schedule.global_order(), num_microbatches
    check_order(order, stage_rank, edges, range(total))
    held = [0] * len(stage_rank)
    for action in order:
        if action.computation == "F":
            held[action.stage_index] += 1
            limit = (
                num_microbatches
                if name == "gpipe"
                else in_flight(name, action.stage_index, stage_rank, num_microbatches)
            )
            assert held[action.stage_index] <= limit, f"{action} exceeds {limit} in flight"
        elif action.computation == "B":
            held[action.stage_index] -= 1


def test_check_order_names_what_is_out_of_order() -> None:
    with pytest.raises(ValueError, match="1B0 comes before 1F0"):
        check_order([Action.parse(a) for a in "0F0 1B0 1F0 0B0".split()], [0, 1], chain_edges(2), range(1))
    with pytest.raises(ValueError, match="misses 1 actions"):
        check_order([Action.parse(a) for a in "0F0 1F0 1B0".split()], [0, 1], chain_edges(2), range(1))


def test_unknown_schedule_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'; choose one of \['gpipe', '1f1b'"):
        make_schedule("pipedream", [0, 1], 2)


@pytest.mark.parametrize("text", ["0F0", "12B3", "3F10", "2U7"])
def test_action_round_trips_through_text(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_bad_action_text_and_microbatch_count_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot parse action 'F0'"):
        Action.parse("F0")
    with pytest.raises(ValueError, match="num_microbatches must be at least 1, got 0"):
        ScheduleGPipe([0, 1], num_microbatches=0)
