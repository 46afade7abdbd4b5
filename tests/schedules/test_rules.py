"""The schedules' memory rules (`hf_ftpipe.schedules.rules`): micro-batches in flight, weight versions
kept, whether gradients persist; the cost model prices a plan with them (tests/costmodel/test_memory_estimate.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.schedules import (
    awaiting_weight_gradients,
    gradients_persist,
    held_at_peaks,
    in_flight,
    stage_moments,
    weight_versions,
)


@pytest.mark.parametrize("schedule", ["1f1b", "async", "2bw"])
def test_in_flight_counts_stages_not_gpus(schedule):
    # GPU 1 runs stages 1 and 2 one action at a time: a micro-batch queues at both, so stage 0
    # needs one in flight per stage after it (runtime.schedule's limits), not per GPU.
    assert [in_flight(schedule, s, [0, 1, 1, 0], 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(schedule, s, [0, 1, 1, 0], 3) for s in range(4)] == [3, 3, 2, 1]  # M caps it
    assert [in_flight("gpipe", s, [0, 1, 1, 0], 8) for s in range(4)] == [8, 8, 8, 8]


def test_in_flight_of_a_16_stage_zigzag_on_8_gpus():
    zigzag = [*range(8), *reversed(range(8))]  # GPU g runs stages g and 15 − g
    assert [in_flight("1f1b", s, zigzag, 16) for s in range(16)] == list(range(16, 0, -1))
    assert [in_flight("async", s, zigzag, 8) for s in range(16)] == [8] * 9 + [7, 6, 5, 4, 3, 2, 1]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.integers(1, 16),
    st.sampled_from(["gpipe", "1f1b", "async", "2bw"]),
)
def test_in_flight_is_the_depth_in_stages_capped_by_the_microbatches(stage_device, m, schedule):
    num_stages = len(stage_device)
    held = [in_flight(schedule, s, stage_device, m) for s in range(num_stages)]
    if schedule == "gpipe":
        assert held == [m] * num_stages
    else:
        assert held == [min(m, num_stages - s) for s in range(num_stages)]


def test_in_flight_names_a_stage_outside_the_plan():
    with pytest.raises(PartitionError, match=r"`stage_index` 3 is outside the plan's stages 0..2"):
        in_flight("1f1b", 3, [0, 1, 0], 4)


@pytest.mark.parametrize(
    ("schedule", "stage_index", "accumulation", "expected"),
    [
        ("gpipe", 0, 1, 1),
        ("1f1b", 0, 1, 1),
        ("2bw", 0, 1, 2),
        ("2bw", 3, 1, 2),
        ("async", 0, 1, 4),  # 4 micro-batches in flight, one version each
        ("async", 3, 1, 1),  # the last stage updates right after each backward
        ("async", 0, 2, 3),  # micro-batches 5 6 7 8 used versions 2 3 3 4
        ("async", 0, 4, 2),
        ("async", 0, 100, 2),
        ("async", 2, 2, 2),
    ],
)
def test_weight_versions(schedule, stage_index, accumulation, expected):
    got = weight_versions(
        schedule, stage_index, [0, 1, 2, 3], num_microbatches=8, gradient_accumulation_steps=accumulation
    )
    assert got == expected


def test_async_versions_capped_by_microbatches_in_flight():
    assert weight_versions("async", 0, range(8), num_microbatches=3) == 3
    assert weight_versions("async", 0, range(8)) == 8


def test_async_versions_count_stages_from_the_stage_on():
    zigzag = [*range(8), *reversed(range(8))]
    assert weight_versions("async", 0, zigzag) == 16  # 16 stages deep, though on 8 GPUs
    assert weight_versions("async", 0, zigzag, num_microbatches=8) == 8
    assert [weight_versions("async", s, [0, 1, 1, 0], num_microbatches=8) for s in range(4)] == [4, 3, 2, 1]
    assert weight_versions("async", 0, zigzag, gradient_accumulation_steps=2) == 9  # ⌈15/2⌉ + 1


@pytest.mark.parametrize(
    ("schedule", "stage_device", "num_microbatches", "accumulation", "recompute", "expected"),
    [
        ("async", [0, 1], 4, 1, False, [False, False]),  # applied right after each backward
        ("async", [0, 1], 4, 1, True, [False, False]),
        ("async", [0, 1], 4, 2, False, [True, True]),  # kept across the forwards between two backwards
        ("2bw", [0, 1], 4, 1, False, [True, True]),
        ("gpipe", [0, 1], 4, 1, False, [False, False]),  # every forward of the step before any backward
        ("gpipe", [0, 1], 4, 1, True, [True, True]),  # beside what the second backward recomputes
        ("gpipe", [0, 1], 1, 1, True, [False, False]),  # one backward per step
        ("gpipe", [0, 1, 0], 4, 1, False, [True, False, True]),  # GPU 0's two stages interleave backwards
        ("1f1b", [0, 1], 4, 1, False, [True, True]),
        ("1f1b", [0, 1, 2], 2, 1, False, [False, False, True]),  # stages 0, 1 hold both micro-batches
    ],
)
def test_gradients_persist(schedule, stage_device, num_microbatches, accumulation, recompute, expected):
    got = [
        gradients_persist(
            schedule,
            s,
            stage_device,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=accumulation,
            recompute=recompute,
        )
        for s in range(len(stage_device))
    ]
    assert got == expected


def test_stage_moments_are_each_stage_s_busiest_states_in_the_walk():
    # zb-h1 on [0, 1], M = 4: stage 0 holds 2 micro-batches' activations and 1 awaiting W before
    # its first W, or 1 and 2 after it; its backwards start from (1, 1) after or (2, 1) before.
    assert stage_moments("zb-h1", [0, 1], 4)[0] == ([(1, 2, 0), (2, 1, 1)], [(1, 1, 0), (2, 1, 1)])
    # zbv's first stage at some moment holds all 4 micro-batches awaiting W, none in flight: what
    # the per-stage rules (4 in flight, none awaiting W) miss where W's inputs outweigh the stage's
    # inputs (recomputation).
    moments = stage_moments("zbv", [0, 1, 1, 0], 4)
    assert (0, 4, 1) in moments[0][0]
    assert (in_flight("zbv", 0, [0, 1, 1, 0], 4), awaiting_weight_gradients("zbv", 0, [0, 1, 1, 0], 4)) == (4, 0)
    assert stage_moments("1f1b", [0, 1], 4) is None  # priced by the per-stage rules


@pytest.mark.parametrize(
    ("schedule", "stage_device", "m"),
    [("zb-h1", [0, 1, 2], 5), ("zbv", [0, 1, 2, 2, 1, 0], 6), ("interleaved-1f1b", [0, 1, 0, 1], 4)],
)
def test_every_state_of_the_walk_is_reached_or_beaten_by_a_stage_moment(schedule, stage_device, m):
    moments = stage_moments(schedule, stage_device, m)
    for gpu, states in enumerate(held_at_peaks(schedule, stage_device, m)):
        for state in states:
            for s, (a, w, before_w) in enumerate(state):
                if stage_device[s] == gpu:
                    assert any(x >= a and y >= w and f <= before_w for x, y, f in moments[s][0]), (s, state)
