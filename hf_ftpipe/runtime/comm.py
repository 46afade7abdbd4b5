"""Point-to-point transfers and collectives that fail together instead of hanging.

Every wait goes through the rank's `Watchdog`: a peer that fails publishes ``[rank r, stage s]
...`` first, so this rank stops within a fraction of a second with that message instead of
blocking until a transport timeout, and a wait that outlives ``timeout_s`` stops the job, naming
what it waited for. Messages carry tags (gloo matches on them); both ends issue them in one global
order, which NCCL's in-order matching needs. Point-to-point messages go through their own process
group, so a send still waiting for its receiver never holds up a collective queued behind it
(NCCL runs one communicator's operations in order).

With replicas of the pipeline (`hf_ftpipe.runtime.replicas`) peers are named by their position in
this rank's pipeline, as the schedule names them; the messenger maps a position to its global rank
(``pipeline_ranks``), and a broadcast stays within the pipeline's own group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_ftpipe.runtime.watchdog import Watchdog

__all__ = ["Messenger"]


@dataclass
class _Send:
    work: dist.Work
    what: str
    dst: int
    """The receiver's global rank."""
    tensor: torch.Tensor
    """Kept alive until the transport is done with it."""
    generation: int
    send_id: int


class Messenger:
    """Sends, receives and reduces tensors for one rank, every wait bounded by its `Watchdog`.

    A peer failure noticed between waits raises `PipelineError`; one that happens while this rank
    is blocked, or a wait past ``timeout_s``, ends the process with the reason (see `Watchdog`).

    Args:
        rank (`int`): this process's rank in the default group.
        timeout_s (`float`): the longest any single wait may block before the job is stopped.
        run_id (`str`): distinguishes this pipeline's keys in the store from earlier ones.
        watchdog (`Watchdog`, *optional*): one shared with the caller (PipeTrainer bounds its own
            collectives with it, so a failure in either is seen by both); made here if not given.
        pipeline_ranks (`Sequence[int]`, *optional*): the global rank at each position of this rank's
            pipeline (default: every rank, position = rank); `send`, `recv` and `broadcast` name positions.
        pipeline_group (`dist.ProcessGroup`, *optional*): the collectives of this rank's pipeline
            (default: the default group).
    """

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        run_id: str,
        p2p_group: dist.ProcessGroup | None = None,
        watchdog: Watchdog | None = None,
        pipeline_ranks: Sequence[int] | None = None,
        pipeline_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.pipeline_ranks = list(pipeline_ranks) if pipeline_ranks is not None else list(range(dist.get_world_size()))
        self.position = self.pipeline_ranks.index(rank)
        """This rank's position in its pipeline."""
        self.pipeline_group = pipeline_group
        self.watchdog = watchdog or Watchdog(rank, dist.get_world_size(), timeout_s, run_id)
        self.p2p_group = p2p_group
        self.generation = 0
        """Sends are stamped with it; `flush` can wait for the older ones only."""
        self._pending_sends: list[_Send] = []
        self._next_send_id = 0

    # -- transfers --------------------------------------------------------------------------

    def rank_of(self, position: int) -> int:
        """The global rank at ``position`` of this rank's pipeline."""
        return self.pipeline_ranks[position]

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> int:
        """Start sending ``tensor`` to position ``dst``; it is kept alive until the send is known to be complete.
        Returns the send's id, for `delivered`.

        A step's sends would otherwise keep every micro-batch's activations and gradients alive
        until `flush` at the end of the step, where the micro-batches in flight are all a stage
        needs (``memory_rules``). So each new send lets go of those the transport reports
        complete (NCCL does), and `delivered` of those the caller knows were received (gloo
        reports a send complete only once it was waited on).
        """
        self._pending_sends = [entry for entry in self._pending_sends if not entry.work.is_completed()]
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, self.rank_of(dst), group=self.p2p_group, tag=tag)
        self._next_send_id += 1
        self._pending_sends.append(_Send(work, what, self.rank_of(dst), tensor, self.generation, self._next_send_id))
        return self._next_send_id

    def delivered(self, send_id: int) -> None:
        """The peer has received send ``send_id`` (the caller knows, e.g. from what the peer sent
        back since): finish it and let go of its tensor. Waiting on it returns at once. Nothing
        to do if it is no longer pending."""
        for index, entry in enumerate(self._pending_sends):
            if entry.send_id == send_id:
                del self._pending_sends[index]
                self.wait(entry.work, f"sending {entry.what}", peers=(entry.dst,))
                return

    def pending(self, send_id: int) -> bool:
        return any(entry.send_id == send_id for entry in self._pending_sends)

    def post_recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int
    ) -> tuple[dist.Work, torch.Tensor]:
        """Start receiving from position ``src`` into a new buffer; `wait` on the returned work before reading it."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        return dist.irecv(buffer, self.rank_of(src), group=self.p2p_group, tag=tag), buffer

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int, what: str
    ) -> torch.Tensor:
        work, buffer = self.post_recv(shape, dtype, device, src, tag)
        self.wait(work, f"receiving {what} from rank {self.rank_of(src)}", peers=(self.rank_of(src),))
        return buffer

    def flush(self, older_than: int | None = None) -> None:
        """Wait until every send started so far (or before generation ``older_than``) was delivered.

        Streaming schedules end a step with messages whose receives are posted at the start of the
        next step: they wait for the previous step's sends only, which are then certain to complete.
        """
        keep = []
        for entry in self._pending_sends:
            if older_than is None or entry.generation < older_than:
                self.wait(entry.work, f"sending {entry.what}", peers=(entry.dst,))
            else:
                keep.append(entry)
        self._pending_sends = keep

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """Broadcast ``tensor`` from position ``src`` to every rank of this pipeline."""
        rank = self.rank_of(src)
        work = dist.broadcast(tensor, rank, group=self.pipeline_group, async_op=True)
        peers = (rank,) if rank != self.rank else _others(self.pipeline_group)
        self.wait(work, f"broadcasting {what} from rank {rank}", peers=peers)
        return tensor

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        self.wait(work, f"reducing {what}", peers=_others(group))
        return tensor

    def wait(self, work: dist.Work, what: str, peers: tuple[int, ...] = ()) -> None:
        """Block on ``work`` (a transfer with ``peers``); a transport error becomes the peer's own
        failure message if it left one, else names ``peers`` (see `Watchdog.waiting`)."""
        with self.watchdog.waiting(what, peers=peers):
            work.wait()

    def raise_if_peer_failed(self, what: str = "") -> None:
        self.watchdog.raise_if_peer_failed(what)

    def report_failure(self, message: str) -> None:
        """Publish this rank's failure so every peer stops with ``message``."""
        self.watchdog.report_failure(message)


def _others(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The other ranks of ``group`` (the default group if ``None``), in the default group's numbering."""
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return tuple(rank for rank in ranks if rank != dist.get_rank())
