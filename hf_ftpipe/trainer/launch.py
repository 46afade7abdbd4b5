"""What the launcher started, as every rank must see it: the processes' device, and which one writes.

`torchrun` (or ``accelerate launch --multi_gpu``) without ``use_cpu`` on a machine with no GPU:
accelerate finds no device backend for several processes, so transformers' `TrainingArguments`
count one process and make each rank process 0 of 1 (``process_index``, ``should_save``,
``is_world_process_zero()`` all true everywhere), while accelerate still opens a process group
for them. The pipeline runs across that group, and every rank then writes the model and the
results files at once. A machine without an accelerator has no device but the CPU, so
`PipeTrainingArguments` asks for it (`use_cpu_for_launch`) before transformers sets the devices
up: the launch then becomes the one ``use_cpu=True`` gives, a gloo process group whose rank 0
alone writes, logs and goes first in ``main_process_first``. Where transformers still counts
fewer processes than the group (a device accelerate cannot spread processes over),
`check_one_writer` refuses to train rather than let every rank write.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from hf_ftpipe.errors import PipelineError

__all__ = ["check_one_writer", "use_cpu_for_launch"]


def use_cpu_for_launch() -> bool:
    """Whether a launcher started several processes (``LOCAL_RANK`` and ``WORLD_SIZE`` > 1 in the
    environment, as torchrun and accelerate set them) on a machine with no accelerator."""
    launched = os.environ.get("LOCAL_RANK") is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched and not torch.accelerator.is_available()


def check_one_writer(args: TrainingArguments) -> None:
    """Refuse a launch in which `TrainingArguments` counts fewer processes than the process group:
    every rank would take itself for process 0 and write the same files.

    Raises:
        `PipelineError`: the group and ``args.world_size`` disagree; the message says to ask for CPU.
    """
    if not dist.is_initialized() or args.world_size == dist.get_world_size():
        return
    raise PipelineError(
        f"[rank {dist.get_rank()}] the launcher started {dist.get_world_size()} processes, but TrainingArguments "
        f"counts {args.world_size} (transformers found no device to spread them over), so every rank would take "
        "itself for process 0 and write the same model and results files; pass use_cpu=True (--use_cpu) to run "
        "the processes on CPU, or launch one process per GPU"
    )
