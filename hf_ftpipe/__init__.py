"""hf_ftpipe: fine-tune models too large for one GPU by swapping `Trainer` for `PipeTrainer`."""

__version__ = "0.1.0"

from .errors import (
    CheckpointError,
    FtpipeError,
    HubError,
    PartitionError,
    PartitionFormatError,
    PipelineError,
    ProfileError,
    TraceError,
)
from .graph import CostGraph, capture_model, trace_model
from .partition import Partition, PartitionKey, partition_seq_greedy, validate_partition
from .profile import GPUProfile, detect_profile, get_profile, list_profiles
from .runtime import PipelineEngine

__all__ = [
    "PipeTrainer",
    "PipeTrainingArguments",
    "CheckpointError",
    "CostGraph",
    "FtpipeError",
    "GPUProfile",
    "HubError",
    "Partition",
    "PartitionError",
    "PartitionFormatError",
    "PartitionKey",
    "PipelineEngine",
    "PipelineError",
    "ProfileError",
    "TraceError",
    "__version__",
    "capture_model",
    "detect_profile",
    "get_profile",
    "list_profiles",
    "partition_seq_greedy",
    "trace_model",
    "validate_partition",
]


def __getattr__(name: str) -> object:
    # The trainer pulls in transformers' Trainer stack: import it only when asked for.
    if name == "PipeTrainer":
        from .trainer import PipeTrainer

        return PipeTrainer
    if name == "PipeTrainingArguments":
        from .training_args import PipeTrainingArguments

        return PipeTrainingArguments
    raise AttributeError(f"module 'hf_ftpipe' has no attribute {name!r}")
