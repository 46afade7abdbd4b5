"""Replicas of one pipeline (PipeDream-2BW's pipeline × data parallelism): who is who, the process
groups, and each replica's share of a global mini-batch.

``world = P × D``: replica ``d`` runs on the global ranks ``d·P .. d·P + P − 1``, and global rank ``r`` is
pipeline position ``r % P`` of replica ``r // P``; every replica runs the same partition, whose
``stage_device`` names positions. Inside a replica the engine speaks positions (the schedule, the
lowering and the messages are those of a one-replica pipeline); `Messenger` maps a position to its
global rank on the wire. Ranks at one position in every replica form a data group, over which the
gradients are summed (`hf_ftpipe.runtime.replica_gradients`); each replica trains its share of the
global mini-batch (`hf_ftpipe.runtime.replica_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.schedules.registry import ScheduleTraits

__all__ = ["ReplicaGroups", "ReplicaLayout"]


@dataclass(frozen=True)
class ReplicaLayout:
    """``data_parallel_size`` replicas of a pipeline of ``pipeline_size`` positions, numbered as above."""

    pipeline_size: int
    data_parallel_size: int

    def __post_init__(self) -> None:
        for name in ("pipeline_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PipelineError(f"`{name}` must be an integer >= 1, got {value!r}")

    @classmethod
    def of_world(cls, pipeline_size: int, data_parallel_size: int, world_size: int) -> ReplicaLayout:
        """The layout of a job of ``world_size`` processes, which must be ``P × D``."""
        layout = cls(pipeline_size, data_parallel_size)
        if layout.world_size == world_size:
            return layout
        P, D = pipeline_size, data_parallel_size  # noqa: N806 (the paper's names)
        fix = f"launch with --num_processes {P * D}"
        if world_size % P == 0:
            fix += f", or set data_parallel_size={world_size // P}"
        raise PipelineError(
            f"the partition places stages on P={P} GPUs and data_parallel_size is D={D}, so the job needs "
            f"P x D = {P * D} processes, but {world_size} were started; {fix}, or recompute the partition "
            f"for {world_size // D if world_size % D == 0 else world_size} GPUs per pipeline"
        )

    def check_schedule(self, traits: ScheduleTraits) -> None:
        """Replicas need weights every replica agrees on: a flush, or ``2bw``'s versions (one all-reduce each)."""
        if self.data_parallel_size > 1 and not traits.flushes and traits.weights != "double-buffered":
            raise PipelineError(
                f"the {traits.name!r} schedule updates each replica's weights at its own pace, so replicas would "
                f"train on different stale weights (not defined); use data_parallel_size=1, or '2bw', gpipe or 1f1b"
            )

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size

    def replica_of(self, rank: int) -> int:
        return rank // self.pipeline_size

    def position_of(self, rank: int) -> int:
        return rank % self.pipeline_size

    def global_rank(self, replica: int, position: int) -> int:
        return replica * self.pipeline_size + position

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The global ranks of ``replica``, by position."""
        return [self.global_rank(replica, p) for p in range(self.pipeline_size)]

    def data_ranks(self, position: int) -> list[int]:
        """The global ranks at ``position`` in every replica, by replica."""
        return [self.global_rank(d, position) for d in range(self.data_parallel_size)]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's process groups.

    ``p2p`` carries the pipeline's point-to-point messages (apart from its collectives, see
    `hf_ftpipe.runtime.comm`); ``pipeline`` its collectives (norms, evaluation outputs), the default
    group when there is one replica; ``data`` the sum of gradients over replicas (``None``: one replica).
    """

    p2p: dist.ProcessGroup
    pipeline: dist.ProcessGroup
    data: dist.ProcessGroup | None

    @classmethod
    def create(cls, layout: ReplicaLayout, rank: int) -> ReplicaGroups:
        """Every rank calls it, in the same place: ``new_group`` is collective over the whole job, so
        each rank creates every replica's and every position's group, in one order, and keeps its own."""
        replica, position = layout.replica_of(rank), layout.position_of(rank)
        p2p = [dist.new_group(layout.pipeline_ranks(d)) for d in range(layout.data_parallel_size)][replica]
        if layout.data_parallel_size == 1:
            return cls(p2p, dist.group.WORLD, None)
        pipeline = [dist.new_group(layout.pipeline_ranks(d)) for d in range(layout.data_parallel_size)][replica]
        data = [dist.new_group(layout.data_ranks(p)) for p in range(layout.pipeline_size)][position]
        return cls(p2p, pipeline, data)

    def destroy(self) -> None:
        """Destroy the groups this rank made (not the default group): their sockets are released."""
        for group in (self.p2p, self.pipeline, self.data):
            if group is not None and group is not dist.group.WORLD:
                dist.destroy_process_group(group)
