"""What would fit when no plan does: one figure for the memory, one for the GPU count, and the
changes that help, in the words of whoever asked.

A partitioner that finds no plan within the GPUs' memory raises `PlanDoesNotFitError` with what it
found and a `FitAdvice`, which says, once:

- the memory per GPU that would fit on this many GPUs: the least that the fullest GPU of any plan
  we know needs (the leanest contiguous split, or a partitioner's own plan), plus the headroom;
- the fewest of these GPUs that would fit, or that none would and which ops are to blame;
- which change would make it fit, when one of recomputation, a 1F1B schedule or Adafactor (or a
  pair of them) does, with its GPU count; and the other changes worth trying.

The figures are seq-dp's, so they hold for seq-dp, for mixed (which starts from seq-dp's plan) and
for auto (which runs both). A partitioner that cuts without regard to memory (seq-greedy, and the
baselines uniform and params) may miss a plan that seq-dp finds: its advice says that the figures
are for a memory-aware partitioner, and a change is named for it only after running it again with
that change (``FitAdvice.blind_partitioner``), so that following the advice works.

The figures come from seq-dp's chain and the memory rules every partitioner prices plans with
(``split_fit.contiguous_fit``): ``partition_seq_dp`` succeeds on the GPU count named and fails on one
fewer. They take a fraction of a second on GPT2-XL, where running every partitioner at growing
GPU counts took most of a minute and still named counts that did not fit.

Fixes are named as the reader names them (``Caller``): ``memory=MemoryOptions(recompute=True)``
for the partition API, ``activation_checkpointing=True`` for `PipeTrainingArguments`,
``--recompute`` for ``hf-ftpipe``.

A layer above ``contiguous`` and ``chain`` and below the partitioners: it runs the partitioner
asked only through the registry (``run_partitioner``), so it imports none of them. The memory
check of a contiguous plan (``check_memory``) lives here, since its error carries the advice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import combinations

from hf_ftpipe._units import format_bytes
from hf_ftpipe.costmodel.estimate import MemoryOptions, usable_capacity
from hf_ftpipe.costmodel.profiles import GPUProfile, list_profiles
from hf_ftpipe.errors import Caller, PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner
from hf_ftpipe.partitioners.registry import run_partitioner
from hf_ftpipe.partitioners.split_fit import ContiguousFit, contiguous_fit
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanRequest

__all__ = ["FitAdvice", "check_memory"]

# How each reader names a fix; {n}: a GPU count, {name}: a profile, {count}: the GPUs asked for,
# {h}: a headroom. An empty entry: that reader has no such knob.
_WORDS: dict[str, dict[Caller, str]] = {
    "partitioner": {
        "python": "`partition_auto`, which also runs the memory-aware seq-dp and mixed",
        "trainer": '`partitioner="auto"`',
        "cli": "`--partitioner auto`",
    },
    "gpus": {
        "python": "`profile.with_count({n})`",
        "trainer": "`accelerate launch --num_processes {n}`",
        "cli": "`--gpus {n}`",
    },
    "gpu_profile": {
        "python": '`get_profile("{name}", count={count})`',
        "trainer": '`gpu_profile="{name}"`',
        "cli": "`--gpu-profile {name}`",
    },
    "headroom": {
        "python": "`memory=MemoryOptions(headroom={h})`",
        "trainer": "`partition_memory_headroom={h}`",
        "cli": "`--headroom {h}`",
    },
    "recompute": {
        "python": "`memory=MemoryOptions(recompute=True)`",
        "trainer": "`activation_checkpointing=True`",
        "cli": "`--recompute`",
    },
    "1f1b": {"python": '`schedule="1f1b"`', "trainer": '`pipeline_schedule="1f1b"`', "cli": "`--schedule 1f1b`"},
    "adafactor": {
        "python": '`optimizer="adafactor"`',
        "trainer": '`optim="adafactor"`',
        "cli": "`--optimizer adafactor`",
    },
    "microbatches": {"python": "fewer `num_microbatches`", "trainer": "", "cli": "fewer `--num-microbatches`"},
    "microbatch": {
        "python": "a graph traced with a smaller micro-batch",
        "trainer": "a smaller `per_device_train_batch_size`",
        "cli": "a smaller `--batch-size`",
    },
}
_CHANGES = ("recompute", "1f1b", "adafactor")
"""Fixes whose effect is computed (they need no new trace), tried alone, then in pairs."""


@dataclass(frozen=True)
class _Figures:
    need_bytes: float | None
    """The least memory of the fullest GPU over the plans known, on the GPUs asked for."""
    need_source: str
    fit: ContiguousFit | None
    change: _Change | None
    own_change: _Change | None = None
    """Fixes with which the blind partitioner asked itself makes a plan that fits the GPUs asked
    (advised instead of ``change`` when they are no more)."""
    own_need_bytes: float | None = None
    """What the blind partitioner's plan needs on its fullest GPU under ``change``, which it does not fit."""


@dataclass(frozen=True)
class _Change:
    """Fixes of ``_CHANGES`` that make a contiguous split fit."""

    fixes: tuple[str, ...]
    num_gpus: int
    """The fewest GPUs it then fits."""
    fits_asked: bool
    """It then fits the GPUs asked for (not implied by fitting fewer: 1F1B-like schedules hold
    more micro-batches on longer pipelines)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class FitAdvice:
    """A request that no plan fits, and what would (figures computed on first use, once)."""

    graph: CostGraph = field(repr=False)
    request: PlanRequest
    """What was asked for (its ``key`` plays no part)."""
    plans: tuple[tuple[str, Partition], ...] = field(default=(), repr=False)
    """Plans already made, with their partitioner: the memory figure is the least of theirs too."""
    blind_partitioner: str | None = None
    """The partitioner asked, when it cuts by compute or parameters alone (seq-greedy, uniform,
    params): the figures are seq-dp's, which it may not reach, so a change is named for it only
    once it made a plan that fits with that change. None for seq-dp, mixed and auto."""

    @property
    def profile(self) -> GPUProfile:
        return self.request.profile

    @property
    def memory(self) -> MemoryOptions:
        return self.request.memory

    @property
    def usable_bytes(self) -> int:
        return self.request.usable_bytes

    @property
    def need_capacity_bytes(self) -> float | None:
        """Memory per GPU (before the headroom) that would fit on ``profile.count`` GPUs."""
        need = self.figures.need_bytes
        return None if need is None else need / (1.0 - self.memory.headroom)

    @property
    def num_gpus(self) -> int | None:
        """The fewest of these GPUs a contiguous split fits (None: no number, or unknown)."""
        return self.figures.fit.num_gpus if self.figures.fit is not None else None

    @cached_property
    def figures(self) -> _Figures:
        fit = self._contiguous_fit(self.request, least_peak=True)
        candidates = [(p, f"{name}'s plan") for name, plan in self.plans if (p := _peak(plan)) is not None]
        if fit is not None and fit.least_peak_bytes is not None:
            candidates.insert(0, (fit.least_peak_bytes, "the leanest contiguous split"))
        need, source = min(candidates, key=lambda c: c[0], default=(None, ""))
        fits_here = need is not None and need <= self.usable_bytes
        change = None if fits_here or fit is None else self._change(fit.num_gpus)
        if self.blind_partitioner is None or fits_here:
            return _Figures(need, source, fit, change)
        own = self._own_change()
        if own is not None and (change is None or not change.fits_asked or len(own.fixes) <= len(change.fixes)):
            return _Figures(need, source, fit, change, own_change=own)
        own_need = self._run_asked(self._changed(change.fixes))[1] if change is not None and change.fits_asked else None
        return _Figures(need, source, fit, change, own_need_bytes=own_need)

    def text(self, caller: Caller) -> str:
        """What would fit, then the fixes, as ``caller`` names them; each figure once."""
        f, name, count = self.figures, self.profile.name, self.profile.count
        usable = format_bytes(self.usable_bytes)
        blind = self.blind_partitioner
        fits_here = f.need_bytes is not None and f.need_bytes <= self.usable_bytes
        lines = []
        if fits_here:  # only the partitioner was wrong: the one fix is another partitioner
            lines.append(
                f"seq-dp finds a plan that fits: {f.need_source} needs {format_bytes(f.need_bytes or 0)} on its "
                f"fullest GPU, within the {usable} usable."
            )
        else:
            if blind:
                lines.append(
                    f"{blind} cuts without regard to memory: what follows is for {self._word('partitioner', caller)}."
                )
            if f.need_bytes is not None:
                plus = f", plus {self.memory.headroom:.0%} headroom" if self.memory.headroom else ""
                lines.append(
                    f"It would fit on GPUs of at least {format_bytes(self.need_capacity_bytes or 0)} each "
                    f"({f.need_source} needs {format_bytes(f.need_bytes)} on its fullest GPU{plus})"
                    f"{self._bigger_gpus(caller)}."
                )
            if f.fit is not None and f.fit.num_gpus is not None and f.fit.num_gpus != count:
                n = f.fit.num_gpus
                lines.append(f"It would fit on {n} × {name} ({self._word('gpus', caller, n=n)}), the fewest that a "
                             "contiguous split fits.")  # fmt: skip
            elif f.fit is not None and f.fit.num_gpus is None:
                lines.append(f"No number of {name} fits: {_piece(self.graph, f.fit, usable)}.")
        change = f.own_change or f.change
        if change is not None:
            fixes = " and ".join(self._word(c, caller) for c in change.fixes)
            n = change.num_gpus
            where = (
                f"it would fit these {count} × {name}"
                if change.fits_asked
                else f"{n} × {name} would fit ({self._word('gpus', caller, n=n)})"
            )
            if f.own_change is not None:
                where += f", {blind}'s own plan included"
            elif blind and f.own_need_bytes is not None:
                need = format_bytes(f.own_need_bytes)
                where += f" ({blind}'s own plan would not: it would need {need} on its fullest GPU)"
            lines.append(f"With {fixes}, {where}.")
        if fits_here:
            others = [self._word("partitioner", caller)] if blind else []
        else:
            others = [self._word(c, caller) for c in self._applicable() if not change or c not in change.fixes]
            if self.request.num_microbatches > 1:
                others.append(self._word("microbatches", caller))
            if self.request.microbatch_size > 1:
                others.append(self._word("microbatch", caller))
        others = [fix for fix in others if fix]
        if others:
            lines.append(f"{'Other changes' if change else 'Changes'} that help: {', '.join(others)}.")
        return "\n".join(lines)

    # -- helpers ---------------------------------------------------------------------------------

    def _applicable(self) -> list[str]:
        """The computed fixes that change this request."""
        request = self.request
        applies = (
            not request.memory.recompute,
            request.schedule == "gpipe" and request.num_microbatches > 1,
            request.optimizer not in ("adafactor", "sgd"),
        )
        return [c for c, yes in zip(_CHANGES, applies) if yes]

    def _change(self, num_gpus: int | None) -> _Change | None:
        """The fewest fixes that fit the GPUs asked for, else the fewest GPUs if fewer than ``num_gpus``."""
        found: list[_Change] = []
        for size in (1, 2):
            for fixes in combinations(self._applicable(), size):
                fit = self._contiguous_fit(self._changed(fixes), least_peak=False)
                if fit is not None and fit.num_gpus is not None:
                    found.append(_Change(fixes, fit.num_gpus, fit.fits_count))
            if any(c.fits_asked for c in found):
                break
        best = min(found, key=lambda c: (not c.fits_asked, len(c.fixes), c.num_gpus), default=None)
        if best is None or not (best.fits_asked or num_gpus is None or best.num_gpus < num_gpus):
            return None
        return best

    def _own_change(self) -> _Change | None:
        """The fewest fixes with which the blind partitioner asked makes a plan that fits these GPUs,
        found by running it (it is cheap: one cut and one estimate)."""
        for size in (1, 2):
            for fixes in combinations(self._applicable(), size):
                if self._run_asked(self._changed(fixes))[0]:
                    return _Change(fixes, self.profile.count, True)
        return None

    def _run_asked(self, request: PlanRequest) -> tuple[bool, float | None]:
        """Whether the blind partitioner's plan for ``request`` fits, and what it needs on its fullest GPU."""
        assert self.blind_partitioner is not None
        try:
            plan = run_partitioner(self.blind_partitioner, self.graph, replace(request, key=None))
        except PlanDoesNotFitError as error:
            plans = error.advice.plans if isinstance(error.advice, FitAdvice) else ()
            return False, _peak(plans[0][1]) if plans else None
        except PartitionError:
            return False, None
        return True, _peak(plan)

    def _changed(self, fixes: Sequence[str]) -> PlanRequest:
        """The request with ``fixes`` (names of ``_CHANGES``) applied."""
        return replace(
            self.request,
            memory=replace(self.memory, recompute=True) if "recompute" in fixes else self.memory,
            schedule="1f1b" if "1f1b" in fixes else self.request.schedule,
            optimizer="adafactor" if "adafactor" in fixes else self.request.optimizer,
        )

    def _contiguous_fit(self, request: PlanRequest, *, least_peak: bool) -> ContiguousFit | None:
        try:
            return contiguous_fit(self.graph, request.profile, least_peak=least_peak, **request.options())
        except PartitionError:  # e.g. more GPUs than ops: no figure, the reason says enough
            return None

    def _bigger_gpus(self, caller: Caller) -> str:
        """``", e.g. l4 (--gpu-profile l4)"``: the smallest built-in profile that would hold the
        plan, and a smaller headroom if the GPUs asked for would hold it with that."""
        need = self.figures.need_bytes or 0.0
        text = ""
        bigger = [p for p in list_profiles() if usable_capacity(p, self.memory) >= need]
        if bigger:
            smallest = min(bigger, key=lambda p: p.memory_bytes).name
            text += f", e.g. {smallest} ({self._word('gpu_profile', caller, name=smallest)})"
        headroom = math.floor((1.0 - need / self.profile.memory_bytes) * 100) / 100
        if 0.0 <= headroom < self.memory.headroom:
            text += f", or these with less headroom ({self._word('headroom', caller, h=f'{headroom:g}')})"
        return text

    def _word(self, fix: str, caller: Caller, **values: object) -> str:
        return _WORDS[fix][caller].format(count=self.profile.count, **values)


def check_memory(planner: ContiguousPlanner, plan: Partition) -> Partition:
    """``plan`` (``planner``'s) when each GPU holds its share within the usable memory, else
    ``PlanDoesNotFitError`` naming each GPU over it."""
    request = planner.request
    capacity = request.usable_bytes_per_gpu  # each GPU's own (GPUs of several kinds differ)
    assert plan.predicted is not None  # ContiguousPlanner.partition always predicts
    over = [(g, gpu.memory_bytes) for g, gpu in enumerate(plan.predicted.gpus) if gpu.memory_bytes > capacity[g]]
    if not over:
        return plan
    if request.heterogeneous:
        needs = ", ".join(f"GPU {g} {format_bytes(need)} of its {format_bytes(capacity[g])} usable" for g, need in over)
        reason = f"{planner.name}: its plan does not fit in GPU memory: {needs}"
    else:
        needs = ", ".join(f"GPU {g} {format_bytes(need)}" for g, need in over)
        reason = (
            f"{planner.name}: its plan does not fit in GPU memory: {needs}, more than the "
            f"{format_bytes(capacity[0])} usable per GPU ({format_bytes(request.profile.memory_bytes)} less "
            f"{request.memory.headroom * 100:g}% headroom)"
        )
    # seq-dp never makes such a plan; the others cut by compute or parameters alone, so the advice
    # checks its fixes by running the partitioner again
    advice = FitAdvice(
        graph=planner.graph, request=request, plans=((planner.name, plan),), blind_partitioner=planner.name
    )
    raise PlanDoesNotFitError(reason, advice)


def _peak(plan: Partition) -> float | None:
    predicted = plan.predicted
    return max((g.memory_bytes for g in predicted.gpus), default=0) if predicted is not None else None


def _piece(graph: CostGraph, fit: ContiguousFit, usable: str) -> str:
    """``"`linear` (lm_head) alone needs 10.55 GiB with 4 micro-batches in flight, ..."``."""
    ops = fit.piece
    scopes = [graph.node(n).get("scope", "") for n in ops]
    scope = _common_scope(scopes)
    where = f" ({scope})" if scope else ""
    if len(ops) == 1:
        what = f"`{ops[0]}`{where} alone needs {format_bytes(fit.piece_bytes)} on a GPU of its own"
    else:
        what = (
            f"the {len(ops)} ops from `{ops[0]}` to `{ops[-1]}`{where}, which seq-dp keeps together, need "
            f"{format_bytes(fit.piece_bytes)} on a GPU of their own"
        )
    flight = f"{fit.piece_in_flight} micro-batch{'es' if fit.piece_in_flight != 1 else ''} in flight"
    where_in_pipeline = "the fewest it can hold" if fit.piece_anywhere else "in a pipeline of one such piece per GPU"
    return f"{what} with {flight} ({where_in_pipeline}), more than the {usable} usable"


def _common_scope(scopes: Sequence[str]) -> str:
    """The module path every scope starts with: ``["a.b.c", "a.b.d"]`` → ``"a.b"``."""
    parts = [s.split(".") for s in scopes if s]
    if len(parts) < len(scopes) or not parts:
        return ""
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)
