"""How `PipeTrainer` reads ``data_parallel_size``: D replicas of a P-stage pipeline over the launched processes.

The launcher starts world = P x D processes; replica d is global ranks d*P .. d*P+P-1
(`hf_ftpipe.runtime.replicas.ReplicaLayout`). The plan is made for P stages, once, and every
replica runs it. Batch sizes keep `Trainer`'s meaning under DDP: ``per_device_train_batch_size``
is one replica's mini-batch, so the global batch of a step is ``per_device_train_batch_size x D``
(x ``gradient_accumulation_steps`` per update). Every rank loads that global batch, as one process
with the global batch size would, and the engine gives each replica its contiguous share of the
micro-batches: the run sees the same samples in the same order as one process does.

``data_parallel_size="auto"``: the planner picks D (`hf_ftpipe.trainer.layout_choice`), and the
global batch is fixed instead: ``per_device_train_batch_size`` is what one pipeline (D = 1) trains
on, and each of the D replicas takes ``num_microbatches / D`` of its micro-batches. The choice of D
then never changes what the model trains on, only how the work is spread: the losses are D = 1's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.partitioners.layouts import divisors
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.schedules.registry import SCHEDULES, ScheduleTraits

__all__ = [
    "DataParallelSize",
    "Replicas",
    "check_auto_replicas",
    "check_data_parallel_size",
    "global_batch_size",
    "launched_gpus_per_node",
    "launched_pipeline_size",
    "launched_world_size",
    "parse_data_parallel_size",
    "pipeline_size",
]


DataParallelSize = int | Literal["auto"]
"""``data_parallel_size``: D, or ``"auto"`` for the planner's choice."""


@dataclass(frozen=True)
class Replicas:
    """How a run's processes share each global mini-batch, once D is known.

    ``num_microbatches`` is one replica's micro-batches per mini-batch: ``num_microbatches`` of the
    arguments for a given D (each replica has its own mini-batch), ``num_microbatches / D`` under
    ``"auto"`` (the replicas share one mini-batch of ``per_device_train_batch_size``)."""

    data_parallel_size: int
    num_microbatches: int

    @classmethod
    def of(cls, args: Any, data_parallel_size: int | None = None) -> Replicas:
        """The replicas of ``args`` (`PipeTrainingArguments`); under ``"auto"``, with the chosen D."""
        if args.data_parallel_size != "auto":
            return cls(args.data_parallel_size, args.num_microbatches)
        if data_parallel_size is None or args.num_microbatches % data_parallel_size:
            raise PipelineError(
                f"internal: data_parallel_size={data_parallel_size!r} chosen for "
                f"num_microbatches={args.num_microbatches}"
            )
        return cls(data_parallel_size, args.num_microbatches // data_parallel_size)

    def microbatches_per_step(self, args: Any) -> int:
        """One replica's micro-batches per optimizer update (what its plan is made for)."""
        return self.num_microbatches * args.gradient_accumulation_steps


def parse_data_parallel_size(value: object) -> DataParallelSize:
    """``value`` as D or ``"auto"``; the command line gives a string (``--data_parallel_size 2`` or ``auto``).

    Raises:
        `ValueError`: anything else, naming the value and what to give.
    """
    given = value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`data_parallel_size={given!r}` must be a positive integer or 'auto': the number of pipeline "
            "replicas, each of world_size / data_parallel_size stages (1: one pipeline over every process), or "
            "'auto' to let the planner choose it (the global batch is then per_device_train_batch_size)"
        )
    return value


def check_data_parallel_size(
    data_parallel_size: DataParallelSize, schedule: ScheduleTraits, world_size: int | None
) -> None:
    """Refuse a ``data_parallel_size`` the run cannot honour (``world_size``: None while not known yet);
    ``"auto"`` is checked when the planner chooses (every D it may pick divides the world).

    Raises:
        `ValueError`: not a positive integer or ``"auto"``, not dividing the processes launched, or
            with a schedule whose replicas' weights would drift apart (``async``).
    """
    data_parallel_size = parse_data_parallel_size(data_parallel_size)
    if data_parallel_size == "auto":
        return
    if data_parallel_size > 1:
        try:  # the engine's rule: replicas agree on their weights only where updates are paired
            ReplicaLayout(1, data_parallel_size).check_schedule(schedule)
        except PipelineError as error:
            raise ValueError(
                f"`data_parallel_size={data_parallel_size}` with pipeline_schedule={schedule.name!r}: {error}"
            ) from None
    if world_size is not None:
        try:
            pipeline_size(data_parallel_size, world_size)
        except PipelineError as error:
            raise ValueError(str(error)) from None


def check_auto_replicas(args: Any) -> None:
    """``data_parallel_size="auto"`` chooses the pipeline's size: refuse what fixes it or needs it first
    (``args``: `PipeTrainingArguments`).

    Raises:
        `ValueError`: naming the argument and what to give instead.
    """
    fixed = {
        "partition_file": "a partition file fixes the pipeline's GPUs (P)",
        "pipeline_schedule": "a schedule file fixes the pipeline's stages",
        "token_slices": "token_slices='auto' is planned for a known number of stages",
    }
    given = {
        "partition_file": args.partition_file is not None,
        "pipeline_schedule": args.pipeline_schedule not in SCHEDULES,
        "token_slices": args.token_slices == "auto",
    }
    for name, why in fixed.items():
        if given[name]:
            raise ValueError(
                f"`data_parallel_size='auto'` with `{name}={getattr(args, name)!r}`: {why}, but 'auto' chooses it; "
                "give data_parallel_size (world size / the pipeline's GPUs, e.g. 1)"
            )


def global_batch_size(per_device_batch_size: int, args: Any) -> int:
    """The rows every rank loads for one step: one replica's mini-batch (``per_device_*_batch_size``, as
    under DDP) for each of ``args.data_parallel_size`` replicas; under ``"auto"``, ``per_device_*_batch_size``
    itself, whatever D the planner picks. The engine gives replica d its share."""
    if args.data_parallel_size == "auto":
        return per_device_batch_size
    return per_device_batch_size * args.data_parallel_size


def launched_world_size() -> int | None:
    """The processes a launcher (torchrun, accelerate launch) started, from ``WORLD_SIZE``; None outside one."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def launched_gpus_per_node(world_size: int) -> int:
    """The processes each machine runs: torchrun's (and accelerate launch's, which runs it)
    ``LOCAL_WORLD_SIZE``; the whole world when unset or not dividing it (one machine)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(value) if value.isdigit() else 0
    return local if local >= 1 and world_size % local == 0 else world_size


def pipeline_size(data_parallel_size: int, world_size: int, rank: int | None = None) -> int:
    """P, the stages of each replica's pipeline (the plan's number of devices).

    Raises:
        `PipelineError`: ``data_parallel_size`` does not divide ``world_size`` (``rank``: who says so).
    """
    if world_size % data_parallel_size:
        where = "" if rank is None else f"[rank {rank}] "
        raise PipelineError(
            f"{where}data_parallel_size={data_parallel_size} does not divide the {world_size} processes launched "
            f"(world size = pipeline stages x data_parallel_size); use one of {divisors(world_size)}, or launch "
            f"a multiple of {data_parallel_size} processes"
        )
    return world_size // data_parallel_size


def launched_pipeline_size(data_parallel_size: int) -> int:
    """P in this process group: the stages the plan is made for."""
    return pipeline_size(data_parallel_size, dist.get_world_size(), dist.get_rank())
