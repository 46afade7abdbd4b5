"""Token slices (TeraPipe): sliced actions, the sliced gpipe and 1f1b orders, their checks and their
in-flight bound, asserted literally, without processes."""

import pytest

from hf_ftpipe.schedules import Action, chain_edges, check_order, format_actions, in_flight, make_schedule
from hf_ftpipe.schedules._simulation import Simulation


def orders(name: str, num_microbatches: int, num_slices: int) -> list[str]:
    schedule = make_schedule(name, [0, 1], num_microbatches, num_slices=num_slices)
    check_order(schedule.global_order(), [0, 1], schedule.edges, range(num_microbatches), num_slices)
    return str(schedule).splitlines()


@pytest.mark.parametrize("text", ["1F0.2", "0B3.0", "12F10.11"])
def test_a_sliced_action_round_trips_through_text(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_an_unsliced_action_prints_as_before() -> None:
    assert str(Action(1, "F", 0)) == "1F0" and Action.parse("0U3") == Action(0, "U", 3, None)
    assert Action.parse("1F0.2") == Action(1, "F", 0, 2)
    with pytest.raises(ValueError, match=r"cannot parse action '1F0\.'"):
        Action.parse("1F0.")


def test_sliced_gpipe_runs_the_units_in_order_and_the_backwards_in_exact_reverse() -> None:
    assert orders("gpipe", 1, 3) == [
        "rank 0: 0F0.0 0F0.1 0F0.2 0B0.2 0B0.1 0B0.0",
        "rank 1: 1F0.0 1F0.1 1F0.2 1B0.2 1B0.1 1B0.0",
    ]
    assert orders("gpipe", 2, 2) == [
        "rank 0: 0F0.0 0F0.1 0F1.0 0F1.1 0B1.1 0B1.0 0B0.1 0B0.0",
        "rank 1: 1F0.0 1F0.1 1F1.0 1F1.1 1B1.1 1B1.0 1B0.1 1B0.0",
    ]


def test_sliced_1f1b_warms_up_then_alternates_taking_a_sequences_slices_last_first() -> None:
    # One sequence: nothing to overlap, the same as GPipe.
    assert orders("1f1b", 1, 3) == [
        "rank 0: 0F0.0 0F0.1 0F0.2 0B0.2 0B0.1 0B0.0",
        "rank 1: 1F0.0 1F0.1 1F0.2 1B0.2 1B0.1 1B0.0",
    ]
    # Rank 0 warms up with P - rank + k - 2 = 2 forwards, rank 1 with 1; then one forward, one backward.
    assert orders("1f1b", 2, 2) == [
        "rank 0: 0F0.0 0F0.1 0F1.0 0B0.1 0F1.1 0B0.0 0B1.1 0B1.0",
        "rank 1: 1F0.0 1F0.1 1B0.1 1F1.0 1B0.0 1F1.1 1B1.1 1B1.0",
    ]


def test_check_order_refuses_slices_out_of_order() -> None:
    def check(text: str, num_slices: int | None = 2) -> None:
        check_order([Action.parse(a) for a in text.split()], [0], [], range(1), num_slices)

    check("0F0.0 0F0.1 0B0.1 0B0.0")
    with pytest.raises(ValueError, match=r"0F0\.1 comes before 0F0\.0, which it depends on"):
        check("0F0.1 0F0.0 0B0.1 0B0.0")
    with pytest.raises(ValueError, match=r"0B0\.0 comes before 0B0\.1, which it depends on"):
        check("0F0.0 0F0.1 0B0.0 0B0.1")
    with pytest.raises(ValueError, match=r"0F0\.0 does not belong to this order, which has unsliced actions"):
        check("0F0.0 0F0.1 0B0.1 0B0.0", None)
    with pytest.raises(ValueError, match=r"0F0 does not belong to this order, which has slices 0\.\.1"):
        check("0F0 0B0")
    with pytest.raises(ValueError, match=r"1F0\.1 comes before 0F0\.1"):  # hidden states from the stage before
        check_order([Action.parse(a) for a in "0F0.0 1F0.0 1F0.1 0F0.1".split()], [0, 1], chain_edges(2), range(1), 2)


def test_streaming_schedules_refuse_slices_naming_those_that_take_them() -> None:
    for name in ("async", "2bw"):
        with pytest.raises(ValueError, match=rf"'{name}' does not take token slices .* do: \['gpipe', '1f1b'\]"):
            make_schedule(name, [0, 1], 2, num_slices=2)
    with pytest.raises(ValueError, match="num_slices must be at least 1, got 0"):
        make_schedule("gpipe", [0, 1], 2, num_slices=0)


@pytest.mark.parametrize("stage_rank", [[0, 1, 2], [0, 1, 1, 0], [0, 1, 0, 1]])
@pytest.mark.parametrize("num_microbatches, num_slices", [(1, 4), (3, 2), (4, 3)])
def test_sliced_orders_are_valid_and_1f1b_stays_within_its_bound(
    stage_rank: list[int], num_microbatches: int, num_slices: int
) -> None:
    num_stages = len(stage_rank)
    edges = chain_edges(num_stages) + [(0, s) for s in range(2, num_stages)]  # skip connections too
    for name in ("gpipe", "1f1b"):
        order = make_schedule(name, stage_rank, num_microbatches, edges, num_slices=num_slices).global_order()
        check_order(order, stage_rank, edges, range(num_microbatches), num_slices)
        held, peak = [0] * num_stages, [0] * num_stages
        for action in order:
            held[action.stage_index] += 1 if action.computation == "F" else -1
            peak[action.stage_index] = max(peak[action.stage_index], held[action.stage_index])
        bound = [in_flight(name, s, stage_rank, num_microbatches, num_slices=num_slices) for s in range(num_stages)]
        assert all(p <= b for p, b in zip(peak, bound, strict=True)), (name, peak, bound)
        if name == "1f1b":
            total = num_microbatches * num_slices
            assert bound == [min(total, num_stages - s + num_slices - 1) for s in range(num_stages)]


def _finish_time(num_stages: int, num_microbatches: int, num_slices: int, held: list[int]) -> int | None:
    simulation = Simulation(list(range(num_stages)), chain_edges(num_stages), held, num_slices=num_slices)
    simulation.run(available=num_microbatches)
    if min(simulation.next_backward) < num_microbatches * num_slices:
        return None  # stuck: a stage cannot hold what its next backward needs
    return max(simulation.done.values())


@pytest.mark.parametrize("num_stages, num_microbatches, num_slices", [(2, 3, 2), (3, 2, 3), (4, 3, 2)])
def test_the_1f1b_bound_is_as_fast_as_unbounded_memory_and_one_less_is_not(
    num_stages: int, num_microbatches: int, num_slices: int
) -> None:
    """P - s + k - 1 slices at stage s keep the pipeline as busy as holding everything (forward 1,
    backward 2); one fewer at any stage where it binds leaves a bubble, or gets stuck."""
    bound = [min(num_microbatches * num_slices, num_stages - s + num_slices - 1) for s in range(num_stages)]
    fastest = _finish_time(num_stages, num_microbatches, num_slices, [num_microbatches * num_slices] * num_stages)
    assert _finish_time(num_stages, num_microbatches, num_slices, bound) == fastest
    for s in range(num_stages):
        fewer = bound[:s] + [bound[s] - 1] + bound[s + 1 :]
        slower = _finish_time(num_stages, num_microbatches, num_slices, fewer)
        assert slower is None or slower > fastest, (s, fewer)  # type: ignore[operator]


def test_sliced_1f1b_on_four_ranks_warms_up_by_depth_plus_the_slices() -> None:
    schedule = make_schedule("1f1b", [0, 1, 2, 3], 3, num_slices=2)
    before_first_backward = [format_actions(schedule.actions_of(r)).split(f" {r}B")[0].split() for r in range(4)]
    # P - rank + k - 2 forwards of warm-up, then the forward that each 1F1B pair starts with
    assert [len(forwards) for forwards in before_first_backward] == [5, 4, 3, 2]
    assert format_actions(schedule.actions_of(0)) == (
        "0F0.0 0F0.1 0F1.0 0F1.1 0F2.0 0B0.1 0F2.1 0B0.0 0B1.1 0B1.0 0B2.1 0B2.0"
    )
