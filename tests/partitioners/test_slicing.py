"""TeraPipe's slicing DP against brute force over every slicing, and the shapes its answers take."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from hf_ftpipe.partitioners.slicing import (
    LatencyFn,
    SlicingByLength,
    plan_slicing,
    slicing_step,
    step_time_s,
    uniform_slices,
)


def latency(fixed: float, token: float, context: float, token_context: float, squared: float = 0.0) -> LatencyFn:
    return lambda s, c, b: fixed + b * (token * s + context * c + token_context * s * c + squared * s * s)


def compositions(n: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``n`` as an ordered sum of positive integers (2^(n-1) of them)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        parts, length = [], 1
        for cut in cuts:
            if cut:
                parts.append(length)
                length = 0
            length += 1
        yield (*parts, length)


def batch_splits(batch: int, largest: int | None = None) -> Iterator[list[int]]:
    """Every multiset of micro-batch sizes adding up to ``batch``, largest first."""
    largest = batch if largest is None else largest
    if batch == 0:
        yield []
    for size in range(min(batch, largest), 0, -1):
        for rest in batch_splits(batch - size, size):
            yield [size, *rest]


def brute_force(t: LatencyFn, n: int, num_stages: int, batch: int = 1) -> float:
    best = float("inf")
    for sizes in batch_splits(batch):
        for slicings in itertools.product(list(compositions(n)), repeat=len(sizes)):
            best = min(best, step_time_s(t, list(zip(sizes, slicings, strict=True)), num_stages))
    return best


RNG = random.Random(17)
RANDOM_MODELS = [latency(*(RNG.choice([0.0, RNG.uniform(0, 3)]) for _ in range(5))) for _ in range(6)] + [
    latency(5.0, 1.0, 0.0, 0.0),
    latency(0.0, 1.0, 0.5, 0.3, 0.3),
]


@pytest.mark.parametrize("model", range(len(RANDOM_MODELS)))
@pytest.mark.parametrize(("n", "num_stages"), [(1, 3), (7, 1), (10, 2), (12, 4)])
def test_dp_equals_brute_force_over_every_slicing(model: int, n: int, num_stages: int) -> None:
    t = RANDOM_MODELS[model]
    result = plan_slicing(t, n, num_stages, step=1, tolerance=0)
    assert sum(result.slices) == n
    assert result.step_time_s == pytest.approx(brute_force(t, n, num_stages), rel=1e-12)
    assert result.step_time_s == pytest.approx(step_time_s(t, result.microbatches, num_stages))


@pytest.mark.parametrize("model", [0, 2, 7])
def test_dp_with_micro_batches_equals_brute_force(model: int) -> None:
    t = RANDOM_MODELS[model]
    result = plan_slicing(t, 5, 3, batch_size=3, step=1, tolerance=0)
    assert sum(result.microbatch_sizes) == 3 and all(sum(slices) == 5 for _, slices in result.microbatches)
    assert result.step_time_s == pytest.approx(brute_force(t, 5, 3, batch=3), rel=1e-12)


def test_one_stage_gives_one_slice() -> None:
    # With nothing to overlap, slicing only adds fixed and context costs.
    result = plan_slicing(latency(1e-3, 1e-5, 1e-7, 1e-9), 512, 1)
    assert result.slices == (512,)


def test_a_large_fixed_cost_per_slice_gives_fewer_slices() -> None:
    counts = [len(plan_slicing(latency(fixed, 1e-5, 0.0, 1e-9), 512, 4).slices) for fixed in (1e-5, 1e-3, 1e-1)]
    assert counts[0] > counts[1] > counts[2] == 1


def test_slices_shrink_toward_the_end_when_context_costs() -> None:
    slices = plan_slicing(latency(1e-4, 1e-5, 0.0, 1e-7), 1024, 8).slices
    assert slices[0] > slices[-1]
    assert all(a >= b for a, b in itertools.pairwise(slices)), slices
    assert all(length % 8 == 0 for length in slices)


def test_tolerance_bounds_the_distance_to_the_exact_dp() -> None:
    t = latency(1e-4, 1e-5, 1e-8, 1e-7, 1e-7)
    exact = plan_slicing(t, 256, 4, tolerance=0).step_time_s
    fast = plan_slicing(t, 256, 4, tolerance=0.01).step_time_s
    assert exact <= fast <= exact * 1.01


def test_the_dp_beats_or_ties_every_uniform_slicing() -> None:
    t = latency(1e-4, 1e-5, 1e-8, 1e-7, 1e-7)
    best = plan_slicing(t, 256, 4).step_time_s
    for count in (1, 2, 4, 8, 16, 32):
        assert best <= step_time_s(t, [(1, uniform_slices(256, count, 8))], 4) * (1 + 1e-3)


def test_uniform_slices() -> None:
    assert uniform_slices(64, 4, 8) == [16, 16, 16, 16]
    assert uniform_slices(40, 3, 8) == [16, 16, 8]
    with pytest.raises(ValueError, match="use 1 to 5 slices"):
        uniform_slices(40, 6, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 100}, "`seq_len` 100 is not a multiple of `step` 8; pick a step that divides it (e.g. 4)"),
        ({"num_stages": 0}, "`num_stages` must be a positive integer, got 0"),
        ({"tolerance": -1.0}, "`tolerance` must be ≥ 0"),
    ],
)
def test_bad_arguments_say_what_to_change(kwargs: dict, message: str) -> None:
    arguments = {"seq_len": 64, "num_stages": 2, **kwargs}
    with pytest.raises(ValueError) as error:
        plan_slicing(latency(1.0, 1.0, 0.0, 0.0), **arguments)
    assert message in str(error.value)


def test_a_negative_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="latency must be a number ≥ 0"):
        plan_slicing(lambda s, c, b: -1.0, 16, 2)


def test_slicing_by_length_plans_each_length_once_alike_everywhere() -> None:
    """A run of variable lengths: each length planned by the DP (a length off the step rounded up, its
    last slice cut), kept, and the same from another instance (another rank) on the same latency."""
    t = latency(fixed=2.0, token=1.0, context=0.01, token_context=0.01)
    calls = []
    counted: LatencyFn = lambda s, c, b: calls.append((s, c, b)) or t(s, c, b)  # noqa: E731
    planner, other = SlicingByLength(counted, num_stages=4, microbatch_size=2), SlicingByLength(t, 4, 2)
    at_64 = plan_slicing(lambda s, c, _: t(s, c, 2), 64, 4, step=slicing_step(64))
    assert planner(64) == at_64.slices and planner.plan(64).step_time_s == pytest.approx(at_64.step_time_s)
    assert {b for _, _, b in calls} == {2}, "every slice is timed at the micro-batch's sequences"
    at_69 = plan_slicing(lambda s, c, _: t(s, c, 2), 72, 4, step=slicing_step(69))  # 69 rounded up to 9 steps
    assert planner(69) == (*at_69.slices[:-1], at_69.slices[-1] - 3)
    for seq_len in (64, 69, 37, 5, 1):
        slices = planner(seq_len)
        assert sum(slices) == seq_len and min(slices) >= 1, seq_len
        assert slices == other(seq_len), f"{seq_len}: planned differently from the same latency"
    timed = len(calls)
    assert planner(69) == other(69) and len(calls) == timed, "a length is planned once"
    assert planner.planned_lengths == [1, 5, 37, 64, 69]
