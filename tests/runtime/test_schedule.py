"""Schedules are data: the per-rank action lists, asserted literally."""

import pytest

from hf_ftpipe.runtime.schedule import Action, ScheduleGPipe, format_actions


def test_gpipe_two_ranks_three_microbatches() -> None:
    schedule = ScheduleGPipe([0, 1], num_microbatches=3)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 0F2 0B0 0B1 0B2"
    assert format_actions(schedule.actions_of(1)) == "1F0 1F1 1F2 1B0 1B1 1B2"


def test_gpipe_mixed_placement_rank_holds_non_adjacent_stages() -> None:
    schedule = ScheduleGPipe([0, 1, 1, 0], num_microbatches=2)
    assert format_actions(schedule.actions_of(0)) == "0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1"
    assert format_actions(schedule.actions_of(1)) == "1F0 1F1 2F0 2F1 2B0 2B1 1B0 1B1"
    assert str(schedule) == "rank 0: 0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1\nrank 1: 1F0 1F1 2F0 2F1 2B0 2B1 1B0 1B1"


def test_every_action_once_and_each_forward_before_its_backward() -> None:
    schedule = ScheduleGPipe([0, 1, 0, 2], num_microbatches=4)
    order = schedule.global_order()
    assert len(order) == len(set(order)) == 4 * 4 * 2
    for action in order:
        if action.computation == "B":
            assert order.index(Action(action.stage_index, "F", action.microbatch_index)) < order.index(action)
            if action.stage_index + 1 < 4:  # the gradient comes from the next stage's backward
                assert order.index(Action(action.stage_index + 1, "B", action.microbatch_index)) < order.index(action)


@pytest.mark.parametrize("text", ["0F0", "12B3", "3F10"])
def test_action_round_trips_through_text(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_bad_action_text_and_microbatch_count_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot parse action 'F0'"):
        Action.parse("F0")
    with pytest.raises(ValueError, match="num_microbatches must be at least 1, got 0"):
        ScheduleGPipe([0, 1], num_microbatches=0)
