"""How `PipeTrainer` reads ``data_parallel_size``: D replicas of a P-stage pipeline over the launched processes.

The launcher starts world = P x D processes; replica d is global ranks d*P .. d*P+P-1
(`hf_ftpipe.runtime.replicas.ReplicaLayout`). The plan is made for P stages, once, and every
replica runs it. Batch sizes keep `Trainer`'s meaning under DDP: ``per_device_train_batch_size``
is one replica's mini-batch, so the global batch of a step is ``per_device_train_batch_size x D``
(x ``gradient_accumulation_steps`` per update). Every rank loads that global batch, as one process
with the global batch size would, and the engine gives each replica its contiguous share of the
micro-batches: the run sees the same samples in the same order as one process does.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.schedules.registry import ScheduleTraits

__all__ = [
    "check_data_parallel_size",
    "global_batch_size",
    "launched_pipeline_size",
    "launched_world_size",
    "pipeline_size",
]


def check_data_parallel_size(data_parallel_size: int, schedule: ScheduleTraits, world_size: int | None) -> None:
    """Refuse a ``data_parallel_size`` the run cannot honour (``world_size``: None while not known yet).

    Raises:
        `ValueError`: not a positive integer, not dividing the processes launched, or with a
            schedule whose replicas' weights would drift apart (``async``).
    """
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(
            f"`data_parallel_size={data_parallel_size!r}` must be a positive integer: the number of pipeline "
            "replicas, each of world_size / data_parallel_size stages (1: one pipeline over every process)"
        )
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


def global_batch_size(per_device_batch_size: int, args: Any) -> int:
    """The rows every rank loads for one step: one replica's mini-batch (``per_device_*_batch_size``, as
    under DDP) for each of ``args.data_parallel_size`` replicas. The engine gives replica d its share."""
    return per_device_batch_size * args.data_parallel_size


def launched_world_size() -> int | None:
    """The processes a launcher (torchrun, accelerate launch) started, from ``WORLD_SIZE``; None outside one."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def pipeline_size(data_parallel_size: int, world_size: int, rank: int | None = None) -> int:
    """P, the stages of each replica's pipeline (the plan's number of devices).

    Raises:
        `PipelineError`: ``data_parallel_size`` does not divide ``world_size`` (``rank``: who says so).
    """
    if world_size % data_parallel_size:
        where = "" if rank is None else f"[rank {rank}] "
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise PipelineError(
            f"{where}data_parallel_size={data_parallel_size} does not divide the {world_size} processes launched "
            f"(world size = pipeline stages x data_parallel_size); use one of {divisors}, or launch a multiple "
            f"of {data_parallel_size} processes"
        )
    return world_size // data_parallel_size


def launched_pipeline_size(args: Any) -> int:
    """P in this process group: the stages the plan is made for (``args``: `PipeTrainingArguments`)."""
    return pipeline_size(args.data_parallel_size, dist.get_world_size(), dist.get_rank())
