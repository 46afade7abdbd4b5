"""zb-h1, zbv and interleaved-1f1b: action lists asserted literally (2 ranks × 4 micro-batches),
checked for order and memory on random placements, and refusals of placements they do not run."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.schedules import Action, check_order, held_at_peaks, in_flight, make_schedule, schedule_traits
from hf_ftpipe.schedules.zero_bubble import is_looped, is_v_shape, v_placement


def test_zb_h1_two_ranks_fills_the_cool_down_with_weight_gradients() -> None:
    # F, B, W one unit each. Rank 0 holds 2 micro-batches (1F1B's warm-up), rank 1 one; a stage
    # keeps 3 (S + 1) between F and W. At t = 6 rank 0's 0F3 would make 4: it runs 0W0 first. Rank 1
    # waits for 0F3 from t = 7 to 9 and fills the wait with 1W0 1W1; 13 units, 1f1b's 15.
    schedule = make_schedule("zb-h1", [0, 1], 4)
    assert str(schedule) == (
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3\n"
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3"
    )


def test_zbv_two_ranks_v_placement() -> None:
    # Rank 0 runs stages 0 and 3 (the V's ends), rank 1 stages 1 and 2; the deepest stage first.
    schedule = make_schedule("zbv", [0, 1, 1, 0], 4)
    assert str(schedule) == (
        "rank 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 0F3 0B1 3W0 3F2 3B2 3F3 3B3 0B2 3W1 0B3 3W2 3W3 0W0 0W1 0W2 0W3\n"
        "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 1F3 2F3 2B2 1B2 2B3 1B3 2W0 2W1 2W2 2W3 1W0 1W1 1W2 1W3"
    )


def test_interleaved_1f1b_two_ranks_is_megatrons_order() -> None:
    # Rank 0 (r = 0, P = 2, v = 2) warms up with 2·(P − r − 1) + (v − 1)·P = 4 forwards, rank 1 with 2;
    # forwards take micro-batches 0-1 through stage 0 then stage 2, backwards stage 2 then stage 0.
    schedule = make_schedule("interleaved-1f1b", [0, 1, 0, 1], 4)
    assert str(schedule) == (
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


def test_interleaved_1f1b_with_one_stage_per_rank_is_1f1b() -> None:
    for num_microbatches in (1, 3, 4, 7):
        assert str(make_schedule("interleaved-1f1b", [0, 1, 2], num_microbatches)) == str(
            make_schedule("1f1b", [0, 1, 2], num_microbatches)
        )


def test_placements_they_do_not_run_are_refused_naming_what_fits() -> None:
    with pytest.raises(
        ValueError,
        match=r"'zbv' schedule runs a V placement .* \[0, 1, 1, 0\] on 2 GPUs\); placement "
        r"\[0, 1, 0, 1\] is not one.*'zb-h1', which runs any placement",
    ):
        make_schedule("zbv", [0, 1, 0, 1], 4)
    with pytest.raises(
        ValueError,
        match=r"'interleaved-1f1b' schedule runs a looped placement .* placement "
        r"\[0, 1, 1, 0\] is not one. Use 'zbv' for a V placement",
    ):
        make_schedule("interleaved-1f1b", [0, 1, 1, 0], 4)
    assert v_placement(3) == [0, 1, 2, 2, 1, 0] and is_v_shape([0, 1, 2, 2, 1, 0]) and not is_v_shape([0, 1, 2, 3])
    assert is_looped([0, 1, 0, 1]) and is_looped([0, 1]) and not is_looped([0, 0, 1, 1])


def held_at_most(order: list[Action], num_stages: int) -> tuple[list[int], list[int]]:
    """Per stage, the most micro-batches at once between F and B, and between F and W (or B)."""
    f, b, w = [0] * num_stages, [0] * num_stages, [0] * num_stages
    most_b, most_w = [0] * num_stages, [0] * num_stages
    for action in order:
        s = action.stage_index
        {"F": f, "B": b, "W": w}[action.computation][s] += 1
        most_b[s], most_w[s] = max(most_b[s], f[s] - b[s]), max(most_w[s], f[s] - w[s])
    return most_b, most_w


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.lists(st.integers(0, 3), min_size=1, max_size=7),
    skips=st.sets(st.tuples(st.integers(0, 6), st.integers(2, 3)), max_size=3),
    num_microbatches=st.integers(1, 9),
)
def test_zb_h1_on_any_placement_is_valid_and_keeps_its_memory_bounds(
    ranks: list[int], skips: set[tuple[int, int]], num_microbatches: int
) -> None:
    labels: dict[int, int] = {}
    stage_rank = [labels.setdefault(r, len(labels)) for r in ranks]
    num_stages = len(stage_rank)
    edges = [(s, s + 1) for s in range(num_stages - 1)] + [(s, s + d) for s, d in skips if s + d < num_stages]
    schedule = make_schedule("zb-h1", stage_rank, num_microbatches, sorted(set(edges)))
    order = schedule.global_order()
    check_order(order, stage_rank, schedule.edges, range(num_microbatches), split_backward=True)
    most_b, most_w = held_at_most(order, num_stages)
    for s in range(num_stages):
        assert most_b[s] <= in_flight("zb-h1", s, stage_rank, num_microbatches)
        assert most_w[s] <= min(num_microbatches, num_stages + 1)


@settings(max_examples=40, deadline=None)
@given(num_ranks=st.integers(1, 5), per_rank=st.integers(1, 3), num_microbatches=st.integers(1, 13))
def test_interleaved_and_zbv_orders_are_valid_within_the_in_flight_rule(
    num_ranks: int, per_rank: int, num_microbatches: int
) -> None:
    looped = [s % num_ranks for s in range(num_ranks * per_rank)]
    for name, stage_rank in (("interleaved-1f1b", looped), ("zbv", v_placement(num_ranks))):
        order = make_schedule(name, stage_rank, num_microbatches).global_order()
        split = schedule_traits(name).split_backward
        check_order(
            order,
            stage_rank,
            [(s, s + 1) for s in range(len(stage_rank) - 1)],
            range(num_microbatches),
            split_backward=split,
        )
        most_b, _ = held_at_most(order, len(stage_rank))
        for s, most in enumerate(most_b):
            assert most <= in_flight(name, s, stage_rank, num_microbatches), (name, s)


def test_a_gpus_peak_is_counted_from_its_own_order_not_from_each_stages_busiest_moment() -> None:
    # interleaved-1f1b on [0, 1, 0, 1], 4 micro-batches: stage 0 holds up to 4, stage 2 up to 2, but
    # rank 0 (0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 ...) never holds more than 5 at once; whole backwards.
    states = held_at_peaks("interleaved-1f1b", [0, 1, 0, 1], 4)
    assert [in_flight("interleaved-1f1b", s, [0, 1, 0, 1], 4) for s in (0, 2)] == [4, 2]
    assert max(state[0][0] + state[2][0] for state in states[0]) == 5
    assert all(state[1] == state[3] == (0, 0, 0) for state in states[0])  # rank 1's stages
    # zb-h1, 2 ranks: rank 1 (1F0 1B0 1F1 1B1 1F2 1B2 1W0 ...) peaks at one micro-batch's activations
    # and two awaiting W, before its first W; rank 0 at 2 and 1 (1F1B's and ZB-H1's memory).
    zb = held_at_peaks("zb-h1", [0, 1], 4)
    assert (1, 2, 1) in [state[1] for state in zb[1]] and (2, 1, 1) in [state[0] for state in zb[0]]
    assert held_at_peaks("1f1b", [0, 1], 4) is None  # priced by the depth rule
