"""The runs of tests/trainer/test_replicas_trainer.py: PipeTrainer on 4 processes as 2 replicas of a
2-stage pipeline (or one 4-stage pipeline), and plain `Trainer` on one process with the global batch.

Tiny GPT-2 (tied embeddings), 16 samples with label padding (micro-batches hold different numbers of
label tokens), AdamW, clipping at 1.0, one epoch: with ``per_device_train_batch_size=2`` and
``data_parallel_size=2`` the global batch is 4, as `Trainer`'s with ``per_device_train_batch_size=4``,
so both train 4 steps; then both evaluate 14 samples as a batch of 8 (``per_device_eval_batch_size`` x 2
for either: `Trainer`'s eval loss depends on the batching) and a short one of 6, which the replicas share
unevenly (Trainer's eval loss weighs each batch by its rows: the full one must count for 8).
The 1f1b run smooths its labels (its loss is computed from the outputs on the last stage, for each
replica's own micro-batches) and accumulates 2 global batches per update (one flush of both, each
shared among the replicas): 2 steps. A run is ``{"name", "schedule", "data_parallel_size", "resume",
"save_steps", "label_smoothing_factor", "gradient_accumulation_steps", "num_microbatches", "gpu_profile",
"partitioner", "generate"}``; with ``generate`` the trained pipeline also generates with
`PipeTrainer.generate` on every rank (`generation_cases`). Under ``data_parallel_size="auto"``
PipeTrainer's ``per_device_train_batch_size`` is the global batch itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from generation_cases import generate_on_every_rank
from models import tiny_model
from parity_runs import make_data

GLOBAL_BATCH = 4
GLOBAL_EVAL_BATCH = 8
SAMPLES = 16
STEPS = SAMPLES // GLOBAL_BATCH
"""Optimizer steps of one epoch without gradient accumulation (see `steps`)."""

RUNS = [
    # 2 x 2: each replica's mini-batch is half the global batch; checkpoint-2 is resumed below. (A resumed
    # run saves at the checkpoint's `save_steps`, which its trainer state carries.)
    {"name": "gpipe", "schedule": "gpipe", "data_parallel_size": 2, "save_steps": 1, "generate": True},
    {
        "name": "1f1b",
        "schedule": "1f1b",
        "data_parallel_size": 2,
        "label_smoothing_factor": 0.1,
        "gradient_accumulation_steps": 2,
    },
    # 4 x 1 from the 2 x 2 checkpoint: another partition (4 stages), the same global batch.
    {
        "name": "resumed",
        "schedule": "gpipe",
        "data_parallel_size": 1,
        "resume": "gpipe/checkpoint-2",
        "save_steps": 1,
    },
    # The planner picks P x D; per_device_train_batch_size is then the global batch, whose 4 micro-batches
    # the replicas share (1, 2 or 4 replicas all divide them).
    {"name": "auto", "schedule": "gpipe", "data_parallel_size": "auto", "num_microbatches": 4},
    # Two generations of cards named as a topology: one 4-GPU pipeline planned GPU by GPU.
    {
        "name": "mixed",
        "schedule": "gpipe",
        "data_parallel_size": 1,
        "gpu_profile": "rtx3090+rtx2080ti",
        "partitioner": "seq-dp",
    },
]
CHOICE_LOGGER = "transformers.hf_ftpipe.trainer.layout_choice"
"""Where ``data_parallel_size="auto"`` logs its choice (rank 0, at info level)."""


def steps(spec: dict[str, Any]) -> int:
    """The optimizer steps of the run ``spec``: one epoch of global batches, G per step."""
    return STEPS // spec.get("gradient_accumulation_steps", 1)


def common_arguments(output_dir: str, replicas: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The arguments PipeTrainer (``replicas``: its ``data_parallel_size``) and `Trainer` (1) share."""
    return dict(
        output_dir=output_dir,
        label_smoothing_factor=spec.get("label_smoothing_factor", 0.0),
        gradient_accumulation_steps=spec.get("gradient_accumulation_steps", 1),
        use_cpu=True,
        per_device_train_batch_size=GLOBAL_BATCH // replicas,  # one replica's share, as under DDP
        per_device_eval_batch_size=GLOBAL_EVAL_BATCH // replicas,
        num_train_epochs=1,
        optim="adamw_torch",
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        seed=0,
        data_seed=0,
    )


def trainer_run(output_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Plain `Trainer` on this process with the global batch: the reference of the run ``spec``."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(save_strategy="no", **common_arguments(output_dir, 1, spec))
    trainer = Trainer(model=tiny_model("gpt2"), args=args, **_data())
    trainer.train()
    trainer.save_model(output_dir)
    metrics = trainer.evaluate()
    return {"history": trainer.state.log_history, "total_flos": trainer.state.total_flos, "evaluate": metrics}


def pipe_run(spec: dict[str, Any], root: str) -> dict[str, Any]:
    """One PipeTrainer run of ``RUNS`` in these processes; every rank returns the same dict."""
    from hf_ftpipe import PipeTrainer, PipeTrainingArguments

    replicas = spec["data_parallel_size"]
    output_dir = str(Path(root) / spec["name"])
    save_steps = spec.get("save_steps")
    choices = _Recorded()
    logging.getLogger(CHOICE_LOGGER).addHandler(choices)
    logging.getLogger(CHOICE_LOGGER).setLevel(logging.INFO)
    args = PipeTrainingArguments(
        data_parallel_size=replicas,
        pipeline_schedule=spec["schedule"],
        num_microbatches=spec.get("num_microbatches", 2),
        gpu_profile=spec.get("gpu_profile", "auto"),
        partitioner=spec.get("partitioner", "params"),
        partition_cache=False,
        plan_max_length=16 if spec.get("generate") else None,  # generation: prompts of 6 tokens, 5 new ones
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        **common_arguments(output_dir, 1 if replicas == "auto" else replicas, spec),
    )
    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args, **_data())
    resume = spec.get("resume")
    try:
        trainer.train(resume_from_checkpoint=str(Path(root) / resume) if resume else None)
    finally:
        logging.getLogger(CHOICE_LOGGER).removeHandler(choices)
    trainer.save_model(output_dir)
    if spec.get("generate"):  # each replica decodes every row through its own pipeline's cache
        generate_on_every_rank(trainer, "gpt2", str(Path(output_dir) / "generated"))
    engine = trainer.engine
    return {
        "history": trainer.state.log_history,
        "total_flos": trainer.state.total_flos,
        "train_batch_size": trainer.state.train_batch_size,
        "layout": (engine.layout.pipeline_size, engine.layout.data_parallel_size),
        "stages": trainer.partition.num_stages,
        "planned_gpus": trainer.partition.key.num_gpus,  # the plan's (and its cache and Hub key's) GPUs: P
        "planned_profile": trainer.partition.key.gpu_profile,
        "replica_microbatches": engine.num_microbatches,
        "choices": choices.messages,
        "evaluate": trainer.evaluate(),
    }


class _Recorded(logging.Handler):
    """The messages of the logger it is added to."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _data() -> dict[str, Any]:
    return {"train_dataset": make_data("gpt2", SAMPLES, seed=1), "eval_dataset": make_data("gpt2", 14, seed=2)}
