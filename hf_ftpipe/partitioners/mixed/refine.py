"""Mixed-Pipe step 3: uncoarsen to atoms and move them between stages while the plan improves.

FTPipe (ATC'21, "Uncoarsening, Refinement: shift blocks across adjacent stages while improving
throughput objective or I/O"). With the blocks undone, an atom (an op with the parts that must
stay with it) may move to another GPU's stage when:

- the stage lies between the last stage it reads from and the first stage reading it, so the
  stage numbering stays topological and the stage graph acyclic;
- no GPU is left empty;
- the objective improves (`IncrementalCost.key`, compared in order): memory over the limits
  shrinks, or stays and the worst GPU's cost drops, or that stays and the GPU costs spread less,
  or that stays too and less time is spent communicating. A plan that fits keeps fitting.

Atoms are taken from the fullest GPU while the plan does not fit, then from the worst GPU; each
pass moves the first improving atom and looks at the worst GPU again, until none improves or the
budget of trial moves is spent. The budget counts moves tried, not seconds, so that the same
inputs give the same plan however loaded the machine is.
"""

from __future__ import annotations

import math

from hf_ftpipe.partitioners.mixed.objective import IncrementalCost

__all__ = ["refine"]

_TARGETS_PER_ATOM = 4
"""Stages tried per atom: those on the least-loaded GPUs, nearest first."""


def refine(state: IncrementalCost, max_trials: float = math.inf) -> tuple[int, int]:
    """Improve ``state`` in place, trying at most ``max_trials`` moves; returns (atoms moved,
    moves tried)."""
    moved = trials = 0
    stuck: set[int] = set()  # GPUs whose atoms cannot improve the plan as it is now
    while trials < max_trials:
        if state.overflow() > 0:  # first make it fit: the fullest GPU gives
            urgency = [state.memory(g) - state.limit[g] for g in range(len(state.limit))]
        else:
            urgency = state.costs()
        order = sorted((g for g in range(len(urgency)) if g not in stuck), key=lambda g: -urgency[g])
        if not order:
            break
        improved, tried = _move_one_off(state, order[0], max_trials - trials)
        trials += tried
        if improved:
            moved += 1
            stuck.clear()
        else:
            stuck.add(order[0])
    return moved, trials


def _move_one_off(state: IncrementalCost, g: int, max_trials: float) -> tuple[bool, int]:
    """Move the first atom of GPU ``g`` whose move improves the key, trying at most
    ``max_trials`` moves; (whether one did, moves tried)."""
    trials = 0
    if len(state.atoms_of_gpu[g]) <= 1:
        return False, trials
    current = state.key()
    costs = state.costs()
    fits = current[0] == 0
    for a in sorted(state.atoms_of_gpu[g]):
        weight = state.atom_weight[a]
        if fits and weight == 0:
            continue
        # Cheap test first: a receiver that would end up above the worst GPU cannot help.
        receivers = [h for h in range(len(costs)) if h != g and (not fits or state.compute[h] + weight < costs[g])]
        if not receivers:
            continue
        s = state.atom_stage[a]
        lo, hi = state.stage_range(a)
        if lo == hi == s:
            continue
        targets = [t for t in range(lo, hi + 1) if state.stage_device[t] in receivers]
        targets.sort(key=lambda t: (costs[state.stage_device[t]], abs(t - s)))
        for t in targets[:_TARGETS_PER_ATOM]:
            if trials >= max_trials:
                return False, trials
            trials += 1
            state.move(a, t)
            if _better(state.key(), current):
                return True, trials
            state.move(a, s)
    return False, trials


def _better(new: tuple[float, ...], old: tuple[float, ...]) -> bool:
    """Lexicographic, with a relative tolerance so that rounding never counts as a gain."""
    for x, y in zip(new, old):
        slack = 1e-9 * max(abs(x), abs(y), 1e-30)
        if x < y - slack:
            return True
        if x > y + slack:
            return False
    return False
