"""What an executor works with that does not change during a run, built once by `PipelineEngine`.

The executor used to read some twenty attributes its engine's constructor happened to set; they
are one typed record now (`ExecutorContext`). What changes between steps stays on the executor:
its `MicrobatchState` and the `Deliveries` of the messages in flight (both renewed by
``Executor.reset``), and the settings a trainer changes between steps (`ExecutorSetting`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import fx

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.compiled_stages import StageCompiler
from hf_ftpipe.runtime.messages import Transfer
from hf_ftpipe.runtime.replica_gradients import ReplicaGradients
from hf_ftpipe.runtime.slicing import Slicing
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.streaming import StreamingWeights
from hf_ftpipe.schedules.registry import ScheduleTraits

__all__ = ["ExecutorContext", "ExecutorSetting", "LossFunction"]

LossFunction = Callable[[int, dict[str, torch.Tensor], Mapping[str, Any]], torch.Tensor]
"""``(unit, the model's outputs on the loss stage by name, the unit's inputs) -> loss``: a loss computed
from the model's outputs (``PipeTrainer``'s label smoothing, ``compute_loss_func``, ``compute_loss``)."""


@dataclass(frozen=True)
class ExecutorContext:
    """One rank's pipeline as the executor runs it: the stages, where they are, how values travel."""

    rank: int
    position: int
    """This rank's position in its replica's pipeline (its rank when there is one replica)."""
    device: torch.device
    graph: CostGraph
    specs: list[StageSpec]
    """Every stage's data flow (`hf_ftpipe.runtime.stage.plan_stages`)."""
    stage_rank: list[int]
    """Each stage's position in the pipeline."""
    local_stages: list[int]
    """The stages this rank runs."""
    modules: dict[int, fx.GraphModule]
    """This rank's stages, traced at the planned shape."""
    transfers: dict[str, Transfer]
    """Each value that crosses ranks: its dtype, producer and readers (`hf_ftpipe.runtime.messages`)."""
    messenger: Messenger
    """This rank's sends and receives, each wait bounded, in its replica's pipeline."""
    traits: ScheduleTraits
    """The schedule's traits: whether the backward is split, whether updates come every group."""
    scheduled_microbatches: int
    """The micro-batches one step's schedule numbers: the period of the message tags."""
    num_microbatches: int
    """Micro-batches per mini-batch (the default loss weight is one over it)."""
    gradient_accumulation_steps: int
    recompute: bool
    autocast_dtype: torch.dtype | None
    loss_value: str | None
    """The traced loss's value, ``None`` for a model without one."""
    slicing: Slicing
    limits: Sequence[int]
    """The in-flight limits the deliveries hold messages to (`hf_ftpipe.schedules.rules.proof_limits`)."""
    compiler: StageCompiler | None
    streaming_weights: StreamingWeights | None
    """The weight versions of a streaming schedule (``async``, ``2bw``); ``None`` for flushing ones."""
    replica_gradients: ReplicaGradients | None
    """The all-reduce of gradients over replicas (``data_parallel_size`` > 1)."""


T = TypeVar("T")


class ExecutorSetting(Generic[T]):
    """An engine attribute that lives on its ``executor``: ``engine.loss_scale = s`` sets the executor's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> T:
        if engine is None:  # looked up on the class (documentation tools)
            return self  # type: ignore[return-value]
        return getattr(engine.executor, self.name)

    def __set__(self, engine: Any, value: T) -> None:
        setattr(engine.executor, self.name, value)
