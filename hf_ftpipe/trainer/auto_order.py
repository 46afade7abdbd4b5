"""``pipeline_schedule="zb-auto"``: the order built for the run's plan, written where the user can read it.

A ``zb-auto`` plan is made as a ``zb-h1`` one (the memory rules walk zb-h1's order,
`hf_ftpipe.schedules.zero_bubble.ScheduleZeroBubbleAuto`). Once every rank holds the plan, each
builds the same order from the plan's recorded stage times (`hf_ftpipe.simulator.plan_auto_schedule`:
measured ones where the plan was priced by a cost table, ``cost_table="measured"``) and runs it as a
schedule file (`hf_ftpipe.schedules.from_file`), so that a short last flush runs it less the missing
micro-batches' actions, as any file's. It is kept only where the simulator finds it no slower than
zb-h1's order, it keeps every dependency between the graph's own stages, and the memory model finds
that it fits each GPU as this run checks a stored plan (its capacity less ``partition_memory_headroom``,
`hf_ftpipe.plan.validate.check_fits_run`); otherwise zb-h1's order runs, no order file is left, and
the log says why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan import Partition
from hf_ftpipe.plan.validate import check_fits_run, stage_graph
from hf_ftpipe.schedules.orders import make_schedule
from hf_ftpipe.simulator.api import plan_profile
from hf_ftpipe.simulator.auto_schedule import plan_auto_schedule
from hf_ftpipe.trainer.plan_sharing import memory_options, planned_optimizer
from hf_ftpipe.trainer.run_log import get_logger

if TYPE_CHECKING:
    from hf_ftpipe.trainer.arguments import PipeTrainingArguments

__all__ = ["ORDER_FILE", "engine_schedule"]

logger = get_logger(__name__)

ORDER_FILE = "zb-auto-order.txt"
"""In ``output_dir``: the order ``zb-auto`` built and runs, one line per rank (`hf-ftpipe schedule`'s text)."""


def engine_schedule(args: PipeTrainingArguments, partition: Partition, graph: CostGraph, num_microbatches: int) -> str:
    """What the engine runs for ``args.pipeline_schedule``: the name itself, or for ``zb-auto`` the
    path of the order built for ``partition`` over ``num_microbatches`` (one flush's), or ``zb-auto``
    (zb-h1's order) where that order is not kept (see the module)."""
    if args.pipeline_schedule != "zb-auto":
        return args.pipeline_schedule
    try:
        built, simulated = plan_auto_schedule(partition, num_microbatches=num_microbatches)
    except PartitionError as error:  # a plan without its recorded stage times
        _log(logging.WARNING, "zb-auto: cannot build an order for this plan (%s); running zb-h1's", error)
        return "zb-auto"
    if built.name != "zb-auto":
        _log(logging.INFO, "zb-auto: zb-h1's order simulates at least as fast on this plan; running it")
        return "zb-auto"
    path = Path(args.output_dir) / ORDER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{os.getpid()}.{path.name}")  # this process's, checked before it becomes the order
    draft.write_text(str(built), encoding="utf-8")
    problem = _why_not(draft, partition, graph, num_microbatches, args)
    if problem is not None:
        draft.unlink()
        _log(logging.WARNING, "zb-auto: the order built for this plan %s; running zb-h1's", problem)
        return "zb-auto"
    os.replace(draft, path)  # whole: every rank writes the same order, maybe to one shared folder
    _log(
        logging.INFO,
        "zb-auto: an order built for the plan's stage times, simulated step %.1f ms; it runs from %s",
        simulated.step_time_s * 1e3,
        path,
    )
    return str(path)


def _why_not(
    order: Path, partition: Partition, graph: CostGraph, num_microbatches: int, args: PipeTrainingArguments
) -> str | None:
    """Why the order in the file ``order``, built from the plan file's stage graph, cannot run
    ``partition``: a dependency between the graph's own stages it breaks, or a GPU it does not fit
    (checked as a stored plan is for this run, `check_fits_run`); None when it can."""
    edges = sorted(stage_graph(graph, partition.node_stage).edges)
    try:
        make_schedule(str(order), partition.stage_device, num_microbatches, edges)
    except ValueError as error:
        return f"does not fit its graph ({error})"
    ordered = dataclasses.replace(partition, key=dataclasses.replace(partition.key, schedule=str(order)))
    capacity = plan_profile(partition).memory_bytes
    try:
        check_fits_run(ordered, graph, capacity, optimizer=planned_optimizer(args), memory=memory_options(args))
    except PartitionError as error:
        return f"does not fit in memory ({error})"
    return None


def _log(level: int, message: str, *values: object) -> None:
    """Log on rank 0 only: every rank makes the same choice from the same plan."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message, *values)
