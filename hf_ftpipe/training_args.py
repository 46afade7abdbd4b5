"""PipeTrainingArguments: `TrainingArguments` plus the pipeline's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

__all__ = ["PipeTrainingArguments"]

SUPPORTED_SCHEDULES = ("gpipe",)
SUPPORTED_PARTITIONERS = ("seq-greedy",)


@dataclass
class PipeTrainingArguments(TrainingArguments):
    """`TrainingArguments` for `PipeTrainer`.

    Batch sizes: ``per_device_train_batch_size`` is the mini-batch of one pipeline step (one
    optimizer update); it is split into ``num_microbatches`` equal micro-batches that flow through
    the stages. Every rank reads the same mini-batch from its own data loader, so the effective
    batch size is ``per_device_train_batch_size`` whatever the number of processes.
    """

    pipeline_schedule: Literal["gpipe"] = field(
        default="gpipe",
        metadata={"help": "Pipeline schedule. 'gpipe': all forwards, then all backwards, one update per mini-batch."},
    )
    num_microbatches: int = field(
        default=4,
        metadata={"help": "Micro-batches per mini-batch; per_device_train_batch_size must be a multiple of it."},
    )
    partitioner: Literal["seq-greedy"] = field(
        default="seq-greedy",
        metadata={"help": "How the model is cut into stages. 'seq-greedy': contiguous stages of equal cost."},
    )
    gpu_profile: str = field(
        default="auto",
        metadata={
            "help": "GPU profile for the cost model: 'auto' (detect), a built-in name (e.g. 'a100-80gb') "
            "or a JSON file."
        },
    )
    partition_file: str | None = field(
        default=None,
        metadata={
            "help": "A partition JSON to use instead of computing one; refused if made for another model or setup."
        },
    )
    weights_path: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint folder (safetensors) each rank reads its own stages' weights from. Needed when the "
            "model was built with empty weights (accelerate.init_empty_weights); default: the model's "
            "name_or_path when that is a local folder."
        },
    )
    release_unused_weights: bool = field(
        default=True,
        metadata={"help": "Free, on each rank, the weights of stages other ranks run (one slice per process)."},
    )
    pipeline_timeout_s: float = field(
        default=300.0,
        metadata={"help": "Longest wait for any transfer between ranks before the whole job stops with an error."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pipeline_schedule not in SUPPORTED_SCHEDULES:
            raise ValueError(
                f"`pipeline_schedule={self.pipeline_schedule!r}` is not available in this version; "
                f"choose one of {list(SUPPORTED_SCHEDULES)}"
            )
        if self.partitioner not in SUPPORTED_PARTITIONERS:
            raise ValueError(
                f"`partitioner={self.partitioner!r}` is not available in this version; "
                f"choose one of {list(SUPPORTED_PARTITIONERS)}"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be at least 1, got {self.num_microbatches}")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            size = getattr(self, name)
            if size % self.num_microbatches:
                raise ValueError(
                    f"`{name}={size}` is not a multiple of `num_microbatches={self.num_microbatches}`; "
                    f"use e.g. {name}={max(1, size // self.num_microbatches) * self.num_microbatches}"
                )
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"`gradient_accumulation_steps={self.gradient_accumulation_steps}`: the pipeline accumulates "
                "over micro-batches itself; set it to 1 and raise `per_device_train_batch_size` (and "
                "`num_microbatches`) instead"
            )
        if self.pipeline_timeout_s <= 0:
            raise ValueError(f"`pipeline_timeout_s` must be positive, got {self.pipeline_timeout_s}")
