"""Token slicing for causal LMs: TeraPipe's dynamic program over slice lengths.

TeraPipe (Li et al., ICML 2021, §3.3; zhuohan123/terapipe, ``terapipe.py``) cuts each sequence
into slices ``l_1..l_M`` that flow through ``K`` equal stages like micro-batches. With
``t_i = t(l_i, c_i)`` one stage's time for slice ``i`` after ``c_i = l_1 + … + l_{i−1}`` tokens,
the pipeline takes::

    T = Σ_i t_i + (K − 1) · max_j t_j

    stage 0 | 1 | 2 |  3  |
    stage 1     | 1 | 2 |  3  |          the first K−1 stages wait for the slowest slice
    stage 2         | 1 | 2 |  3  |      once each, every stage runs every slice once

For a bound ``t_max`` the best sum is a shortest path over token positions:
``S(0) = 0, S(i) = min over k with t(k, i−k) ≤ t_max of S(i−k) + t(k, i−k)``, and
``T*(t_max) = S(n) + (K−1)·t_max``. The best ``T`` is the minimum over every distinct latency
``t_max`` can be, ascending, stopping once no larger bound can win. With ``B`` sequences the
batch is split into micro-batches too: ``g(B') = min_b g(B'−b) + S_b(n)``, where ``S_b`` is the
DP at micro-batch size ``b`` (the same bound for every micro-batch, since the max is global).
Lengths are multiples of ``step`` tokens (TeraPipe: 8) to keep the table ``O((L/step)²)``.

Later slices attend over more context, so with a large context cost the slices shrink toward the
end of the sequence; with a large fixed cost per slice there are fewer of them. Pure Python.

A run whose batches vary in length re-plans for each length it meets (`SlicingByLength`): the same
latency model, cached per length, and deterministic, so every rank that holds the same model
cuts a batch alike without a message.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "LatencyFn",
    "Microbatch",
    "Slicing",
    "SlicingByLength",
    "plan_slicing",
    "slicing_step",
    "step_time_s",
    "uniform_slices",
]

MAX_STEPS = 128
"""The most token steps a re-plan cuts a sequence into: its table grows with their square."""

LatencyFn = Callable[[int, int, int], float]
"""``t(slice_len, context_len, batch_size)``: one stage's time for one slice, seconds
(e.g. a `hf_ftpipe.costmodel.latency.SliceLatency`)."""


Microbatch = tuple[int, tuple[int, ...]]
"""``(sequences, slice lengths)``: one micro-batch of that many sequences, each cut the same way."""


@dataclass(frozen=True)
class Slicing:
    """How a batch is cut: micro-batches, each of some sequences cut into slices (token lengths
    adding up to the sequence length), and the predicted step time."""

    microbatches: tuple[Microbatch, ...]
    step_time_s: float
    """``Σ t_i + (K − 1) · max t_i`` over every (micro-batch, slice) unit."""

    @property
    def slices(self) -> tuple[int, ...]:
        """The first micro-batch's slices (every micro-batch's, when the batch is one)."""
        return self.microbatches[0][1]

    @property
    def microbatch_sizes(self) -> tuple[int, ...]:
        return tuple(size for size, _ in self.microbatches)


def step_time_s(latency: LatencyFn, microbatches: Sequence[tuple[int, Sequence[int]]], num_stages: int) -> float:
    """Predicted time of one step through ``num_stages`` equal stages of ``microbatches`` (each
    ``(sequences, slice lengths)``): ``Σ t + (K − 1) · max t`` over all units."""
    times = []
    for b, slices in microbatches:
        context = 0
        for length in slices:
            times.append(latency(length, context, b))
            context += length
    return sum(times) + (num_stages - 1) * max(times)


def uniform_slices(seq_len: int, num_slices: int, step: int = 1) -> list[int]:
    """``seq_len`` cut into ``num_slices`` slices of whole ``step``s, as equal as possible (the
    longer ones first)."""
    units, remainder = divmod(seq_len, step)
    if remainder or not 1 <= num_slices <= units:
        raise ValueError(
            f"cannot cut {seq_len} tokens into {num_slices} slices of whole {step}-token steps; "
            f"use 1 to {units} slices and a length that is a multiple of `step`"
        )
    base, extra = divmod(units, num_slices)
    return [(base + (i < extra)) * step for i in range(num_slices)]


def plan_slicing(
    latency: LatencyFn,
    seq_len: int,
    num_stages: int,
    *,
    batch_size: int = 1,
    step: int = 8,
    tolerance: float = 1e-3,
) -> Slicing:
    """The slicing (and micro-batch split) of least predicted step time, by TeraPipe's DP.

    ``latency(s, c, b)`` must be non-negative; ``seq_len`` a multiple of ``step``. Micro-batches
    of equal size are cut alike; sizes may differ when that is faster (``batch_size`` 5 as 4 + 1).

    ``tolerance`` thins the bounds tried: the distinct latencies, ascending, are grouped in windows
    ``[w, w·(1 + tolerance))`` and each window is tried at its largest value. The optimum's own
    max ``m`` then has a tried bound in ``[m, m·(1 + tolerance))``, whose sum is no worse, so the
    result is within ``tolerance·(K−1)·m ≤ tolerance·T`` of the exact DP, at a fraction of its
    cost (each bound is an ``O(n²)`` pass). ``tolerance=0`` tries every bound (exact).
    """
    _check(seq_len, num_stages, batch_size, step)
    if not tolerance >= 0:
        raise ValueError(f"`tolerance` must be ≥ 0, got {tolerance!r}")
    n = seq_len // step
    tables = {b: _Table(latency, n, step, b) for b in range(1, batch_size + 1)}
    # Below the least bound some slicing meets (a minimax pass) every bound is infeasible.
    lowest = min(table.least_feasible_bound() for table in tables.values())
    unbounded = _batch_split({b: table.shortest(math.inf) for b, table in tables.items()}, batch_size)[0]
    bounds = sorted({t for table in tables.values() for t in table.values if t >= lowest})
    best: tuple[float, list[int], float] | None = None
    i = 0
    while i < len(bounds):
        # No bound from here on can win: its sum is at least the unbounded one.
        if best is not None and unbounded + (num_stages - 1) * bounds[i] >= best[0]:
            break
        # The window [bounds[i], bounds[i]·(1 + tolerance)) is tried at its largest value.
        i = bisect.bisect_left(bounds, bounds[i] * (1 + tolerance), lo=i + 1) if tolerance else i + 1
        bound = bounds[i - 1]
        total, sizes = _batch_split({b: table.shortest(bound) for b, table in tables.items()}, batch_size)
        if math.isfinite(total) and (best is None or total + (num_stages - 1) * bound < best[0]):
            best = (total + (num_stages - 1) * bound, sizes, bound)
    assert best is not None  # the least feasible bound is among the values
    _, sizes, bound = best
    microbatches = tuple((b, tuple(k * step for k in tables[b].path(bound))) for b in sorted(sizes, reverse=True))
    return Slicing(microbatches, step_time_s(latency, microbatches, num_stages))


def slicing_step(seq_len: int) -> int:
    """The token step slice lengths are multiples of (but the last, cut to what is left): TeraPipe's
    8 tokens; finer for a short sequence, so the DP has at least 8 steps to place cuts between;
    coarser for a long one, so it has at most `MAX_STEPS`."""
    step = 8
    while step > 1 and seq_len // step < 8:
        step //= 2
    return max(step, math.ceil(seq_len / MAX_STEPS))


class SlicingByLength:
    """TeraPipe's slicing of a micro-batch of ``microbatch_size`` sequences, for any sequence length:
    planned by `plan_slicing` the first time a length comes, then kept.

    A length that is not a whole number of steps (`slicing_step`) is planned rounded up to one, and
    its last slice cut to what is left (less than a step off the DP's own optimum).

    Args:
        latency (`LatencyFn`): one stage's time for a slice (e.g. the cost model's `RooflineSliceTime`).
        num_stages (`int`): the pipeline's stages (TeraPipe's equal ones).
        microbatch_size (`int`, defaults to 1): sequences per micro-batch: every micro-batch is cut
            alike, so the DP plans one unit of this many sequences.
    """

    def __init__(self, latency: LatencyFn, num_stages: int, microbatch_size: int = 1) -> None:
        self.latency, self.num_stages, self.microbatch_size = latency, num_stages, microbatch_size
        self._plans: dict[int, Slicing] = {}
        self._times: dict[tuple[int, int], float] = {}
        """(slice, context) → latency: lengths of one step share most of the DP's table."""

    def _unit_time(self, slice_len: int, context_len: int, _: int = 1) -> float:
        key = (slice_len, context_len)
        if key not in self._times:
            self._times[key] = self.latency(slice_len, context_len, self.microbatch_size)
        return self._times[key]

    def plan(self, seq_len: int) -> Slicing:
        if seq_len not in self._plans:
            step = slicing_step(seq_len)
            padded = math.ceil(seq_len / step) * step
            slicing = plan_slicing(
                self._unit_time,
                padded,
                self.num_stages,
                batch_size=1,
                step=step,
            )
            if padded != seq_len:
                (size, slices), *_ = slicing.microbatches
                cut = (size, (*slices[:-1], slices[-1] - (padded - seq_len)))
                slicing = Slicing((cut,), step_time_s(self._unit_time, [cut], self.num_stages))
            self._plans[seq_len] = slicing
        return self._plans[seq_len]

    def __call__(self, seq_len: int) -> tuple[int, ...]:
        return self.plan(seq_len).slices

    @property
    def planned_lengths(self) -> list[int]:
        """The sequence lengths planned so far."""
        return sorted(self._plans)


class _Table:
    """Every slice's latency at one micro-batch size, in steps: for each end position ``i``, the
    slices ending there as ``(time, start)`` sorted by time, so that a bound admits a prefix."""

    def __init__(self, latency: LatencyFn, n: int, step: int, batch_size: int) -> None:
        self.n = n
        self.rows: list[list[tuple[float, int]]] = [[]]
        for i in range(1, n + 1):
            row = sorted((latency(k * step, (i - k) * step, batch_size), i - k) for k in range(1, i + 1))
            if row[0][0] < 0 or any(math.isnan(t) for t, _ in row):
                raise ValueError(f"latency must be a number ≥ 0 for every slice, got {row[0][0]}")
            self.rows.append(row)
        self.times = [[t for t, _ in row] for row in self.rows]

    @property
    def values(self) -> list[float]:
        return [t for row in self.times for t in row]

    def least_feasible_bound(self) -> float:
        """The least ``max t_i`` of any slicing (a minimax DP)."""
        worst = [0.0] + [math.inf] * self.n
        for i in range(1, self.n + 1):
            worst[i] = min(max(worst[j], t) for t, j in self.rows[i])
        return worst[self.n]

    def _costs(self, bound: float) -> list[float]:
        """``S(i)`` for every ``i``: the least sum with every slice's time ≤ ``bound``."""
        cost = [0.0] + [math.inf] * self.n
        for i in range(1, self.n + 1):
            allowed = bisect.bisect_right(self.times[i], bound)
            row = self.rows[i]
            cost[i] = min((cost[row[p][1]] + row[p][0] for p in range(allowed)), default=math.inf)
        return cost

    def shortest(self, bound: float) -> float:
        return self._costs(bound)[self.n]

    def path(self, bound: float) -> list[int]:
        """The slice lengths (in steps) of ``S(n)`` at ``bound``."""
        cost = self._costs(bound)
        slices, i = [], self.n
        while i > 0:
            allowed = bisect.bisect_right(self.times[i], bound)
            _, j = min(((cost[j] + t, j) for t, j in self.rows[i][:allowed]), key=lambda x: x[0])
            slices.append(i - j)
            i = j
        return slices[::-1]


def _batch_split(sums: dict[int, float], batch_size: int) -> tuple[float, list[int]]:
    """``g(B) = min_b g(B − b) + S_b(n)``: the micro-batch sizes of least summed time."""
    g = [0.0] + [math.inf] * batch_size
    choice = [0] * (batch_size + 1)
    for total in range(1, batch_size + 1):
        for b in range(1, total + 1):
            value = g[total - b] + sums[b]
            if value < g[total]:
                g[total], choice[total] = value, b
    sizes, left = [], batch_size
    while left > 0 and choice[left]:
        sizes.append(choice[left])
        left -= choice[left]
    return g[batch_size], sizes


def _check(seq_len: int, num_stages: int, batch_size: int, step: int) -> None:
    for name, value in (("seq_len", seq_len), ("num_stages", num_stages), ("batch_size", batch_size), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    if seq_len % step:
        raise ValueError(
            f"`seq_len` {seq_len} is not a multiple of `step` {step}; pick a step that divides it "
            f"(e.g. {math.gcd(seq_len, step)})"
        )
