"""``auto_find_batch_size``: PipeTrainer trains at the largest batch whose plan fits the GPUs' memory.

The GPUs are a profile (the CPU's, two of them) whose memory holds a plan for micro-batches of 2 rows
and not of 3, by the memory model the planner uses (`fitting_profile`). Given
``per_device_train_batch_size=8`` in ``num_microbatches=2`` (4 rows each), PipeTrainer plans 4 rows
(no), then 2 (yes), then 3 (no), and trains at 4 = 2 × 2: the losses of plain `Trainer` at a batch of 4.
Run by tests/trainer/surface_job.py (PipeTrainer, 2 ranks) and test_trainer_surface.py (`Trainer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from models import tiny_batch, tiny_model
from trainer_comparison import short_run_arguments

GIVEN, FOUND, MICROBATCHES, STEPS = 8, 4, 2, 3


def _arguments(output_dir: str, pipe: bool, batch_size: int, **pipeline: Any) -> Any:
    pipeline = {"num_microbatches": MICROBATCHES, "partitioner": "seq-dp", **pipeline}
    return short_run_arguments(output_dir, pipe, batch_size, STEPS, pipeline)


def fitting_profile(path: str) -> str:
    """Write at ``path`` a profile whose memory lies halfway between what plans for micro-batches of 2 and
    of 3 rows need (`PlanDoesNotFitError`'s own figure, for a profile that fits nothing); ``path``."""
    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.errors import PlanDoesNotFitError
    from hf_ftpipe.graph.trace import capture_model
    from hf_ftpipe.trainer import plan_sharing

    args = _arguments(str(Path(path).parent), True, GIVEN)
    cpu = get_profile("cpu", count=2).to_dict()
    need = {}
    for rows in (FOUND // MICROBATCHES, FOUND // MICROBATCHES + 1):
        traced = capture_model(tiny_model("gpt2"), tiny_batch("gpt2", rows))
        planned = {n: torch.empty(i.shape, device="meta") for n, i in traced.cost_graph.inputs.items() if i.shape}
        try:
            plan_sharing._compute_partition(args, traced, get_profile({**cpu, "memory_bytes": 1}), planned)
        except PlanDoesNotFitError as error:
            need[rows] = error.advice.need_capacity_bytes
    Path(path).write_text(json.dumps({**cpu, "name": "fits-2-rows", "memory_bytes": int(sum(need.values()) / 2)}))
    return path


def train(output_dir: str, pipe: bool, gpu_profile: str = "") -> dict[str, Any]:
    """PipeTrainer given ``GIVEN`` rows with ``auto_find_batch_size`` on ``gpu_profile``, or `Trainer` at
    ``FOUND`` rows: the batch it trained at and every logged loss."""
    from transformers import Trainer

    from hf_ftpipe import PipeTrainer

    if pipe:
        args = _arguments(output_dir, True, GIVEN, auto_find_batch_size=True, gpu_profile=gpu_profile)
    else:
        args = _arguments(output_dir, False, FOUND)
    data = tiny_batch("gpt2", GIVEN * STEPS, seed=5)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    trainer = (PipeTrainer if pipe else Trainer)(model=tiny_model("gpt2", seed=2), args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"batch_size": trainer.args.per_device_train_batch_size, "losses": losses}
