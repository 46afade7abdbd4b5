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
from hf_ftpipe.costmodel.profiles import GPUProfile, canonical_dtype, mixes_kinds
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.keys import resolve_key
from hf_ftpipe.plan.partition import PartitionKey
from hf_ftpipe.schedules.zero_bubble import v_placement

if TYPE_CHECKING:
    from typing_extensions import Required

__all__ = ["Placement", "PlanOptions", "PlanRequest", "v_on_mixed_gpus"]

Placement = Literal["chain", "v"]
"""How a contiguous plan's stages sit on the GPUs: ``chain``, stage s on GPU s (one stage per
GPU); ``v``, 2·P stages on P GPUs, stage s on GPU min(s, 2P − 1 − s) ([0, 1, 1, 0]: the first and
last stage share a GPU), the placement the ``zbv`` schedule runs."""


def v_on_mixed_gpus(placement: str, gpus: Sequence[GPUProfile] | None) -> bool:
    """Whether a V placement is asked of GPUs of several kinds (``gpus``: one profile per GPU), which
    is not planned: a GPU holds two stages of the V, and both are sized for one kind of GPU. Each
    caller words the refusal in its own terms (`PlanRequest`'s ``placement``, the trainer's schedule)."""
    return placement == "v" and mixes_kinds(gpus)


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
    gpu_profiles: Sequence[GPUProfile] | None


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

    gpu_profiles: Sequence[GPUProfile] | None = None
    """GPU g's own profile, one per GPU of ``profile.count``, when the GPUs differ (a topology's ranks,
    `Topology.profile_of`): each stage is priced on its GPU and each GPU holds at most its own memory;
    ``profile`` then gives the link between them and the name the plan's key records. Contiguous
    partitioners balance by each GPU's speed; ``mixed`` plans for one kind of GPU only."""

    def __post_init__(self) -> None:
        if self.gpu_profiles is not None:
            self._check_gpu_profiles()
        if self.placement not in get_args(Placement):
            raise PartitionError(f"unknown `placement` {self.placement!r}; choose one of {list(get_args(Placement))}")
        if v_on_mixed_gpus(self.placement, self.gpu_profiles):
            raise PartitionError(
                "a V placement is planned for one kind of GPU, but `gpu_profiles` mixes "
                f"{sorted({g.name for g in self.gpu_profiles or ()})}; use placement='chain' with GPUs of several kinds"
            )
        if self.memory is None:  # the partitioners' keyword default
            object.__setattr__(self, "memory", MemoryOptions())
        table = self.cost_table
        if table is not None and self.dtype is not None and canonical_dtype(self.dtype) != table.key.dtype:
            asked = canonical_dtype(self.dtype)
            raise PartitionError(
                f"the cost table was measured in {table.key.dtype}, but the plan is asked for dtype {asked!r}; "
                f"profile in {asked} or ask for {table.key.dtype}"
            )

    def _check_gpu_profiles(self) -> None:
        gpus = self.gpu_profiles
        if isinstance(gpus, GPUProfile) or not all(isinstance(g, GPUProfile) for g in gpus or ()):
            raise PartitionError(f"`gpu_profiles` must be a sequence of GPUProfile, one per GPU, got {gpus!r}")
        if len(gpus) != self.profile.count:
            raise PartitionError(
                f"`gpu_profiles` lists {len(gpus)} GPUs, profile {self.profile.name!r} has count "
                f"{self.profile.count}; give one profile per GPU (e.g. a topology's `profile_of(rank)` per rank)"
            )
        object.__setattr__(self, "gpu_profiles", tuple(g.with_count(1) for g in gpus))
        if self.cost_table is not None and self.heterogeneous:
            raise PartitionError(
                "a cost table holds one device's measured costs, but `gpu_profiles` mixes GPUs "
                f"{sorted({g.name for g in gpus})}; plan mixed GPUs from the roofline (no cost_table) "
                "or measure and plan for one kind"
            )

    @property
    def heterogeneous(self) -> bool:
        """The GPUs differ (``gpu_profiles`` holds more than one kind)."""
        return mixes_kinds(self.gpu_profiles)

    def gpu_profile(self, gpu: int) -> GPUProfile:
        """GPU ``gpu``'s own profile (``profile`` when the GPUs are all alike)."""
        return self.profile.with_count(1) if self.gpu_profiles is None else self.gpu_profiles[gpu]

    def node_costs(self, graph: CostGraph) -> dict[str, NodeCost]:
        """Every op's forward and backward time: from ``cost_table`` when given, else the roofline of
        ``profile`` (with GPUs of several kinds, of the first GPU: `gpu_costs` has each one's)."""
        if self.cost_table is not None:
            return self.cost_table.node_costs(graph)
        return node_costs(graph, self.gpu_profile(0) if self.heterogeneous else self.profile, self.dtype)

    def gpu_costs(self, graph: CostGraph) -> list[dict[str, NodeCost]] | None:
        """With GPUs of several kinds, every op's times on each GPU (one table per kind, shared); else None."""
        if not self.heterogeneous:
            return None
        assert self.gpu_profiles is not None  # heterogeneous
        tables: list[tuple[GPUProfile, dict[str, NodeCost]]] = []
        for gpu in self.gpu_profiles:
            if not any(known == gpu for known, _ in tables):
                tables.append((gpu, node_costs(graph, gpu, self.dtype)))
        return [next(table for known, table in tables if known == gpu) for gpu in self.gpu_profiles]

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
        """Memory a plan may use on each GPU: ``profile.memory_bytes`` less the headroom (with GPUs of
        several kinds, the smallest GPU's: `usable_bytes_per_gpu` has each one's)."""
        return min(self.usable_bytes_per_gpu)

    @property
    def usable_bytes_per_gpu(self) -> list[int]:
        """Memory a plan may use on each GPU, its own memory less the headroom."""
        return [usable_capacity(self.gpu_profile(g), self.memory) for g in range(self.profile.count)]

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
        gpu_costs: Sequence[Mapping[str, NodeCost]] | None = None,
    ) -> Prediction:
        """The cost model's prediction of a plan under this request (``costs``, or with GPUs of several
        kinds ``gpu_costs``: the op costs, when known)."""
        if self.heterogeneous:
            gpus = self.gpu_profiles
            gpu_costs = self.gpu_costs(graph) if gpu_costs is None else gpu_costs
        else:
            gpus, gpu_costs = None, None
            costs = self.node_costs(graph) if costs is None else costs
        return estimate(
            graph, node_stage, list(stage_device), self.profile, num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size, optimizer=self.optimizer, schedule=self.schedule, dtype=self.dtype,
            costs=costs, memory=self.memory, gpus=gpus, gpu_costs=gpu_costs,
        )  # fmt: skip
