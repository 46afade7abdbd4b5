"""A schedule from a file: each rank's actions, as ``hf-ftpipe schedule`` prints them or as CSV.

``make_schedule("path/to/order.csv", ...)`` (and the cost model and the simulator, which take a
schedule by name) runs the order a file gives, in the manner of torchtitan's CSV schedules. Two forms are read:

- the text ``hf-ftpipe schedule`` prints, one line per rank (a ``step:`` line is skipped)::

      rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3
      rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3

- CSV, row r the actions of rank r, one per cell: ``0F0,0F1,0B0,...``.

The file is checked before anything runs (`FileSchedule`): every action names a stage of its own
rank; every forward and backward of every micro-batch runs once (and, where the file has ``W``
actions, every backward is split: one ``W`` after each ``B``, see `ScheduleTraits.split_backward`),
each after what it depends on; the ranks' orders do not wait on each other in a circle (no
deadlock). It flushes: one optimizer step per mini-batch, so the update is that of one process.
Its memory is what its order holds (`ScheduleTraits.held_by_order`), which the memory rules count
and the planner checks against each GPU's memory like any schedule's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path

from hf_ftpipe.schedules.actions import Action, check_order
from hf_ftpipe.schedules.orders import Schedule
from hf_ftpipe.schedules.registry import SCHEDULE_NAMES, ScheduleTraits
from hf_ftpipe.schedules.zero_bubble import is_v_shape, replay_orders

__all__ = [
    "FileSchedule",
    "FileSummary",
    "GivenSchedule",
    "file_traits",
    "given_traits",
    "is_schedule_file",
    "read_rank_orders",
    "summarize_file",
]

_RANK_LINE = re.compile(r"^\s*rank\s+(\d+)\s*:(.*)$")


def is_schedule_file(name: str) -> bool:
    """Whether ``pipeline_schedule`` names a file rather than a registered schedule."""
    return name.endswith((".csv", ".txt")) or os.sep in name or os.path.isfile(name)


def read_rank_orders(path: str | os.PathLike[str]) -> dict[int, list[Action]]:
    """Each rank's actions in the file at ``path``; `ValueError` naming the file and line of an
    action that does not parse or a rank given twice."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"pipeline schedule file {str(file)!r} does not exist; give an existing file or a schedule's name, one "
            f"of {list(SCHEDULE_NAMES)}"
        )
    orders: dict[int, list[Action]] = {}
    csv_row = 0
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        match = _RANK_LINE.match(text)
        if match is None and (not text or text.startswith("#") or text.endswith(":")):  # blank, comment, "step:"
            continue
        if match is not None:
            rank, cells = int(match[1]), match[2].split()
        else:
            rank, cells = csv_row, [cell for cell in text.split(",") if cell.strip()]
            csv_row += 1
        if rank in orders:
            raise ValueError(f"{file}:{number}: rank {rank} is given twice")
        try:
            orders[rank] = [Action.parse(cell) for cell in cells]
        except ValueError as error:
            raise ValueError(f"{file}:{number}: {error}") from None
    if not orders:
        raise ValueError(f"{file}: no rank's actions found; write one line per rank, e.g. 'rank 0: 0F0 0B0'")
    return orders


@dataclasses.dataclass(frozen=True)
class FileSummary:
    """What a schedule file fixes before any plan is at hand: its stages' ranks and its micro-batches."""

    stage_rank: list[int] | None
    """The rank of each stage its orders name, or ``None`` where they name a stage on two ranks or
    leave a stage out (`GivenSchedule` says which)."""
    num_microbatches: int
    """The micro-batches its orders run, 0 to this less 1: a step of fewer runs the order less the
    missing ones' actions (`hf_ftpipe.schedules.actions.restrict_order`)."""
    split_backward: bool
    """Whether it has ``W`` actions (`ScheduleTraits.split_backward`)."""


def summarize_file(path: str) -> FileSummary:
    """`FileSummary` of the file at ``path`` (read again when the file changes); `ValueError` as
    `read_rank_orders`."""
    return _summary(path, Path(path).stat().st_mtime_ns if Path(path).is_file() else 0)


@functools.lru_cache(maxsize=16)
def _summary(path: str, modified_ns: int) -> FileSummary:
    orders = read_rank_orders(path)
    actions = [a for rank_actions in orders.values() for a in rank_actions]
    return FileSummary(
        stage_rank=_placement(orders),
        num_microbatches=1 + max((a.microbatch_index for a in actions), default=-1),
        split_backward=any(a.computation == "W" for a in actions),
    )


def _placement(orders: dict[int, list[Action]]) -> list[int] | None:
    ranks_of: dict[int, set[int]] = {}
    for rank, actions in orders.items():
        for action in actions:
            ranks_of.setdefault(action.stage_index, set()).add(rank)
    if sorted(ranks_of) != list(range(len(ranks_of))) or any(len(ranks) > 1 for ranks in ranks_of.values()):
        return None
    return [ranks_of[s].pop() for s in range(len(ranks_of))]


def file_traits(path: str) -> ScheduleTraits:
    """The traits of the schedule in ``path``: flushing, one weight version, its memory counted
    from its order, its backwards split where it has ``W`` actions, a V placement where its is one."""
    summary = summarize_file(path)
    return given_traits(path, summary.split_backward, summary.stage_rank is not None and is_v_shape(summary.stage_rank))


def given_traits(source: str, split_backward: bool, v_placement: bool) -> ScheduleTraits:
    """The traits of a schedule given as orders (``source``: where from): those of the defaults, a
    synchronous schedule like ``1f1b`` without token slices, its memory counted from its order."""
    return ScheduleTraits(
        name=source,
        split_backward=split_backward,
        v_placement=v_placement,
        held_by_order=True,
        help=f"the per-rank orders of {source}.",
    )


class GivenSchedule(Schedule):
    """A schedule given as each rank's actions, checked against the plan (see the module).

    Args:
        source (`str`): where the orders come from (a file's path), for the errors.
        orders (`dict[int, list[Action]]`): each rank's actions.
        stage_rank, num_microbatches, edges: as for every `Schedule`.
    """

    def __init__(
        self,
        source: str,
        orders: dict[int, list[Action]],
        stage_rank: Sequence[int],
        num_microbatches: int,
        edges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        self.name = source  # type: ignore[assignment]  # not a registered name
        super().__init__(stage_rank, num_microbatches, edges)
        ranks = sorted(set(self.stage_rank))
        if sorted(orders) != ranks:
            raise ValueError(f"{source} gives the actions of ranks {sorted(orders)}; the plan runs ranks {ranks}")
        placement = _placement(orders)
        if placement != self.stage_rank:
            raise ValueError(
                f"{source} does not run the plan's stages where the plan does: {_where(orders)}; the plan's "
                f"placement is {self.stage_rank} (stage s on rank placement[s]); write the file for it "
                f"(`hf-ftpipe schedule --placement {','.join(map(str, self.stage_rank))} ...` prints one), or plan "
                "for the file's"
            )
        order = replay_orders(orders, self.stage_rank, self.edges)
        self.split_backward = any(a.computation == "W" for a in order)
        self.v_placement = is_v_shape(self.stage_rank)
        given = 1 + max(a.microbatch_index for a in order)
        if given != num_microbatches:
            raise ValueError(
                f"{source} orders {given} micro-batches, but a step here runs {num_microbatches}; write the file "
                f"for {num_microbatches} (`hf-ftpipe schedule --num-microbatches {num_microbatches} ...`), or run "
                f"steps of {given} (a shorter step runs the order less its missing micro-batches' actions)"
            )
        try:
            check_order(order, self.stage_rank, self.edges, range(num_microbatches), split_backward=self.split_backward)
        except ValueError as error:
            raise ValueError(
                f"{source} is not a valid schedule for {num_microbatches} micro-batches: {error}"
            ) from None
        self._order = order

    @property
    def traits(self) -> ScheduleTraits:
        return given_traits(self.name, self.split_backward, self.v_placement)

    def global_order(self) -> list[Action]:
        return list(self._order)


class FileSchedule(GivenSchedule):
    """The schedule in the file at ``path`` (see the module)."""

    def __init__(
        self,
        path: str,
        stage_rank: Sequence[int],
        num_microbatches: int,
        edges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(path, read_rank_orders(path), stage_rank, num_microbatches, edges)


def _where(orders: dict[int, list[Action]]) -> str:
    """Where the orders run each stage, e.g. ``rank 0 runs stages [0, 1], rank 1 none``."""
    parts = []
    for rank in sorted(orders):
        stages = sorted({a.stage_index for a in orders[rank]})
        parts.append(f"rank {rank} runs {'stages ' + str(stages) if stages else 'no stage'}")
    return ", ".join(parts)
