"""What a plan is priced for besides its graph and GPUs: the optimizer, the schedule, memory options
and token slices, and the checks of their values; shared by the time and the memory estimates."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.schedules.registry import ScheduleName

__all__ = [
    "MemoryOptions",
    "Optimizer",
    "Schedule",
    "TokenSlices",
    "check_choice",
    "check_positive",
    "check_schedule",
    "check_training",
    "usable_capacity",
]

Optimizer = Literal["sgd", "sgd-momentum", "adam", "adamw", "adafactor"]
Schedule = ScheduleName
"""The pipeline schedules a plan can be priced for (`hf_ftpipe.schedules.registry`)."""


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """How memory is budgeted when a plan is made and checked."""

    headroom: float = 0.1
    """Fraction of each GPU's memory kept free (allocator fragmentation, CUDA context, buffers)."""
    recompute: bool = False
    """Activation recomputation: a stage keeps only its inputs per micro-batch in flight, and
    recomputes one micro-batch's activations during its backward."""
    gradient_accumulation_steps: int = 1
    """For `async`: micro-batches per weight update; fewer updates in flight means fewer stashed
    weight versions."""

    def __post_init__(self) -> None:
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)):
            raise PartitionError(f"`headroom` must be a number in [0, 1), got {self.headroom!r}")
        if not 0.0 <= self.headroom < 1.0:
            raise PartitionError(
                f"`headroom` is the fraction of GPU memory kept free and must be in [0, 1), got "
                f"{self.headroom!r}; e.g. 0.1 keeps 10% free"
            )
        check_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)


@dataclass(frozen=True, kw_only=True)
class TokenSlices:
    """Token slicing (TeraPipe) for the memory model: each sequence cut into ``slice_lengths``.

    A slice is a unit in flight like a micro-batch (``in_flight(..., num_slices=k)``), keeping what
    its own length's graph saves (`memory_rules.sliced_saved_bytes`); each sequence in flight
    also holds its keys and values on every stage (`memory_rules.kv_buffer_bytes`), and the one in
    backward their gradients too. Plain data, built from ``SlicedModel`` by the caller.
    """

    slice_lengths: tuple[int, ...]
    graphs: Mapping[int, CostGraph]
    """Slice length → the model's graph at that length."""
    node_stages: Mapping[int, Mapping[str, int]]
    """Slice length → that graph's node → stage: the same stages as the whole graph's."""

    def __post_init__(self) -> None:
        missing = sorted(set(self.slice_lengths) - set(self.graphs) | set(self.slice_lengths) - set(self.node_stages))
        if missing:
            raise PartitionError(f"`TokenSlices` lacks a graph or a node → stage map for slice lengths {missing}")


def usable_capacity(profile: GPUProfile, memory: MemoryOptions | None = None) -> int:
    """Bytes a plan may use on one GPU of ``profile``: its memory less ``memory.headroom``."""
    headroom = (memory or MemoryOptions()).headroom
    return int(profile.memory_bytes * (1.0 - headroom))


def check_choice(name: str, value: str, options: object) -> None:
    valid = get_args(options)
    if value not in valid:
        raise PartitionError(f"unknown `{name}` {value!r}; use one of {list(valid)}")


def check_schedule(schedule: str) -> None:
    """A registered schedule's name, or a file of per-rank orders (`hf_ftpipe.schedules.from_file`)."""
    from hf_ftpipe.schedules.from_file import is_schedule_file

    if not is_schedule_file(schedule):
        check_choice("schedule", schedule, Schedule)


def check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PartitionError(f"`{name}` must be a positive integer, got {value!r}")


def check_training(schedule: str, optimizer: str, num_microbatches: int) -> None:
    """The training options every estimate prices, checked alike: `PartitionError` naming the bad one."""
    check_schedule(schedule)
    check_choice("optimizer", optimizer, Optimizer)
    check_positive("num_microbatches", num_microbatches)
