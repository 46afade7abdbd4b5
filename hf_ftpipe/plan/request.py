"""PlanRequest: what a plan is asked for besides the model's graph, the one argument set of every partitioner.

Every partitioner (``partition_<name>``, see ``hf_ftpipe.partitioners.registry``) is called as::

    partition_<name>(graph, profile, num_stages=None, *, num_microbatches, microbatch_size,
                     schedule="gpipe", optimizer="adamw", dtype=None, key=None, memory=None)

and gathers those arguments into one `PlanRequest` before it plans. Whoever holds a request (the
CLI, the trainer, the shipped plans' catalog, `auto`) calls any partitioner the same way,
``registry.run_partitioner(name, graph, request)``. The request holds no graph, so one request can
be planned on several traced models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, TypedDict, get_args

from hf_ftpipe.costmodel.estimate import MemoryOptions, Optimizer, Schedule, estimate, usable_capacity
from hf_ftpipe.costmodel.measured import CostTable
from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
from hf_ftpipe.costmodel.prediction import Prediction
from hf_ftpipe.costmodel.profiles import GPUProfile, canonical_dtype
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.keys import resolve_key
from hf_ftpipe.plan.partition import PartitionKey
from hf_ftpipe.schedules.zero_bubble import v_placement

if TYPE_CHECKING:
    from typing_extensions import Required

__all__ = ["Placement", "PlanOptions", "PlanRequest"]

Placement = Literal["chain", "v"]
"""How a contiguous plan's stages sit on the GPUs: ``chain``, stage s on GPU s (one stage per
GPU); ``v``, 2·P stages on P GPUs, stage s on GPU min(s, 2P − 1 − s) ([0, 1, 1, 0]: the first and
last stage share a GPU), the placement the ``zbv`` schedule runs."""


class PlanOptions(TypedDict, total=False):
    """The keyword arguments of every partitioner (``**options: Unpack[PlanOptions]``): the fields
    of `PlanRequest` but ``profile`` and ``num_stages``, which are positional."""

    num_microbatches: Required[int]
    microbatch_size: Required[int]
    schedule: Schedule
    optimizer: Optimizer
    dtype: str | None
    key: PartitionKey | None
    memory: MemoryOptions | None
    cost_table: CostTable | None
    placement: Placement


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The GPUs and training options a plan is made for."""

    profile: GPUProfile
    """The GPUs: their kind and ``profile.count``, how many."""
    num_microbatches: int
    """Micro-batches per step (what a pipeline keeps in flight follows from it and the schedule)."""
    microbatch_size: int
    """Samples per micro-batch; the graph was traced with this many."""
    schedule: Schedule = "gpipe"
    optimizer: Optimizer = "adamw"
    """Sets the optimizer state each trainable parameter adds to its GPU's memory."""
    dtype: str | None = None
    """Compute dtype for costs (e.g. ``"bfloat16"`` under autocast); by default each op's own, and
    the key records the parameters' dtype."""
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    """Headroom, recomputation and gradient accumulation; ``None`` is taken as the defaults."""
    num_stages: int | None = None
    """Stages asked for; ``None`` lets the partitioner choose (one per GPU for sequential ones)."""
    key: PartitionKey | None = None
    """The key to record; by default built from the graph and this request, which it must agree with."""
    cost_table: CostTable | None = None
    """Measured op costs (``hf-ftpipe profile``) in place of the roofline; it must have been measured
    for the graph planned (a `CostTableError` says what differs) and, when ``dtype`` is given, in it."""

    placement: Placement = "chain"
    """Where a contiguous partitioner puts its stages (`Placement`); ``"v"`` asks for 2 stages per
    GPU in a V (``num_stages`` = 2 × GPUs). Partitioners that choose placements themselves
    (``mixed``) take only ``"chain"``, their own choice."""

    def __post_init__(self) -> None:
        if self.placement not in get_args(Placement):
            raise PartitionError(f"unknown `placement` {self.placement!r}; choose one of {list(get_args(Placement))}")
        if self.memory is None:  # the partitioners' keyword default
            object.__setattr__(self, "memory", MemoryOptions())
        table = self.cost_table
        if table is not None and self.dtype is not None and canonical_dtype(self.dtype) != table.key.dtype:
            asked = canonical_dtype(self.dtype)
            raise PartitionError(
                f"the cost table was measured in {table.key.dtype}, but the plan is asked for dtype {asked!r}; "
                f"profile in {asked} or ask for {table.key.dtype}"
            )

    def node_costs(self, graph: CostGraph) -> dict[str, NodeCost]:
        """Every op's forward and backward time: from ``cost_table`` when given, else the roofline of ``profile``."""
        if self.cost_table is not None:
            return self.cost_table.node_costs(graph)
        return node_costs(graph, self.profile, self.dtype)

    def options(self) -> dict[str, Any]:
        """The `PlanOptions` of this request: the keyword arguments of every partitioner."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("profile", "num_stages")}

    def stages_or(self, default: int | None) -> int | None:
        """``num_stages``, or ``default`` when none was asked; a `PartitionError` unless a positive integer."""
        num_stages = default if self.num_stages is None else self.num_stages
        if num_stages is None:
            return None
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PartitionError(f"`num_stages` must be a positive integer, got {num_stages!r}")
        return num_stages

    def stage_devices(self, num_stages: int) -> list[int]:
        """The GPU of each of ``num_stages`` contiguous stages under `placement`; `PartitionError`
        unless a V has exactly 2 stages per GPU."""
        if self.placement == "chain":
            return list(range(num_stages))
        num_gpus = self.profile.count
        if num_stages != 2 * num_gpus:
            raise PartitionError(
                f"a V placement has 2 stages per GPU: num_stages must be {2 * num_gpus} on the {num_gpus} GPUs "
                f"of profile {self.profile.name!r}, got {num_stages}; leave `num_stages` unset to get {2 * num_gpus}"
            )
        return v_placement(num_gpus)

    @property
    def usable_bytes(self) -> int:
        """Memory a plan may use on each GPU: ``profile.memory_bytes`` less the headroom."""
        return usable_capacity(self.profile, self.memory)

    def key_for(self, graph: CostGraph) -> PartitionKey:
        """The key a plan of ``graph`` records: ``key`` if it agrees with this request, else a new one."""
        return resolve_key(
            graph,
            self.profile,
            self.key,
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            dtype=self.dtype,
        )

    def estimate(
        self,
        graph: CostGraph,
        node_stage: Mapping[str, int],
        stage_device: Sequence[int],
        costs: Mapping[str, NodeCost] | None = None,
    ) -> Prediction:
        """The cost model's prediction of a plan under this request (``costs``: the op costs, when known)."""
        if costs is None:
            costs = self.node_costs(graph)
        return estimate(
            graph, node_stage, list(stage_device), self.profile, num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size, optimizer=self.optimizer, schedule=self.schedule, dtype=self.dtype,
            costs=costs, memory=self.memory,
        )  # fmt: skip
