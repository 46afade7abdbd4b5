"""The registry: every schedule's traits, asserted literally, and the rules that derive from them."""

from typing import get_args

import pytest

from hf_ftpipe.costmodel.estimate import Schedule
from hf_ftpipe.schedules import (
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleName,
    gradients_persist,
    in_flight,
    make_schedule,
    schedule_traits,
    weight_versions,
)


def test_traits_of_every_schedule() -> None:
    table = {
        name: (
            t.flushes,
            t.holds_every_microbatch,
            t.weights,
            t.updates_every_group,
            t.weight_prediction,
            t.split_backward,
            t.v_placement,
        )
        for name, t in SCHEDULES.items()
    }
    assert table == {
        "gpipe": (True, True, "single", False, False, False, False),
        "1f1b": (True, False, "single", False, False, False, False),
        "async": (False, False, "stashed", True, True, False, False),
        "2bw": (False, False, "double-buffered", False, False, False, False),
        "zb-h1": (True, False, "single", False, False, True, False),
        "zbv": (True, False, "single", False, False, True, True),
        "interleaved-1f1b": (True, False, "single", False, False, False, False),
        "zb-auto": (True, False, "single", False, False, True, False),
    }


def test_names_are_written_once_and_derived_everywhere() -> None:
    assert (
        SCHEDULE_NAMES
        == ("gpipe", "1f1b", "async", "2bw", "zb-h1", "zbv", "interleaved-1f1b", "zb-auto")
        == get_args(ScheduleName)
        == get_args(Schedule)
    )
    placements = {"zbv": [0, 1, 1, 0]}
    made = [make_schedule(name, placements.get(name, [0, 1]), 2).name for name in SCHEDULE_NAMES]
    assert made == list(SCHEDULE_NAMES)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zb'; choose one of \['gpipe', '1f1b', "):
        schedule_traits("zb")


def test_update_every() -> None:
    assert [SCHEDULES[name].update_every(4, 2) for name in SCHEDULE_NAMES] == [4, 4, 2, 4, 4, 4, 4, 4]


def test_rules_per_schedule_on_three_stages() -> None:
    """Stage 0 of a 3-stage chain on 3 GPUs, 4 micro-batches, 2 micro-batches per async update."""
    rules = {
        name: (
            in_flight(name, 0, [0, 1, 2], 4),
            weight_versions(name, 0, [0, 1, 2], num_microbatches=4, gradient_accumulation_steps=2),
            gradients_persist(name, 0, [0, 1, 2], 4, gradient_accumulation_steps=2),
        )
        for name in SCHEDULE_NAMES
    }
    assert rules == {
        "gpipe": (4, 1, False),
        "1f1b": (3, 1, True),
        "async": (3, 2, True),
        "2bw": (3, 2, True),
        "zb-h1": (3, 1, True),
        "zbv": (3, 1, True),
        "interleaved-1f1b": (3, 1, True),
        "zb-auto": (3, 1, True),
    }
