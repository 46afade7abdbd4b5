"""Point-to-point transfers and collectives that fail together instead of hanging.

Every wait polls its request and, a few times a second, the rendezvous store: a rank that fails
writes ``[rank r, stage s] ...`` there first, so its peers stop within a fraction of a second
with that message instead of blocking until a transport timeout. A wait that outlives
``timeout_s`` raises too, naming what it waited for. Messages carry tags (gloo matches on them);
both ends issue them in one global order, which NCCL's in-order matching needs. Point-to-point
messages go through their own process group, so a send still waiting for its receiver never holds
up a collective queued behind it (NCCL runs one communicator's operations in order).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PipelineError

__all__ = ["Messenger"]

_FAILURE_KEY = "hf_ftpipe/failure"
_STORE_POLL_S = 0.2


@dataclass
class _Send:
    work: dist.Work
    what: str
    tensor: torch.Tensor
    """Kept alive until the transport is done with it."""
    generation: int
    send_id: int


class Messenger:
    """Sends, receives and reduces tensors for one rank, watching for failures of the others.

    Transport waits cannot be interrupted (a gloo wait with a timeout breaks the connection), so a
    watchdog thread does the watching: it polls the store, and when a peer has failed or a wait
    outlived ``timeout_s`` while this rank is blocked, it publishes the reason and ends the process
    with that message. A peer failure noticed between waits raises `PipelineError` instead.

    Args:
        rank (`int`): this process's rank in the default group.
        timeout_s (`float`): the longest any single wait may block before the job is stopped.
        run_id (`str`): distinguishes this pipeline's failure key from earlier ones in the same store.
    """

    def __init__(self, rank: int, timeout_s: float, run_id: str, p2p_group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.failure_key = f"{_FAILURE_KEY}/{run_id}"
        self.p2p_group = p2p_group
        self.generation = 0
        """Sends are stamped with it; `flush` can wait for the older ones only."""
        self._store = _default_store()
        self._pending_sends: list[_Send] = []
        self._next_send_id = 0
        self._waiting: tuple[float, str] | None = None
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"hf_ftpipe-watchdog-{rank}", daemon=True)
        self._watchdog.start()

    # -- transfers --------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> int:
        """Start sending ``tensor``; it is kept alive until the send is known to be complete.
        Returns the send's id, for `delivered`.

        A step's sends would otherwise keep every micro-batch's activations and gradients alive
        until `flush` at the end of the step, where the micro-batches in flight are all a stage
        needs (``memory_rules``). So each new send lets go of those the transport reports
        complete (NCCL does), and `delivered` of those the caller knows were received (gloo
        reports a send complete only once it was waited on).
        """
        self._pending_sends = [entry for entry in self._pending_sends if not entry.work.is_completed()]
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, dst, group=self.p2p_group, tag=tag)
        self._next_send_id += 1
        self._pending_sends.append(_Send(work, what, tensor, self.generation, self._next_send_id))
        return self._next_send_id

    def delivered(self, send_id: int) -> None:
        """The peer has received send ``send_id`` (the caller knows, e.g. from what the peer sent
        back since): finish it and let go of its tensor. Waiting on it returns at once. Nothing
        to do if it is no longer pending."""
        for index, entry in enumerate(self._pending_sends):
            if entry.send_id == send_id:
                del self._pending_sends[index]
                self.wait(entry.work, f"sending {entry.what}")
                return

    def pending(self, send_id: int) -> bool:
        return any(entry.send_id == send_id for entry in self._pending_sends)

    def post_recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int
    ) -> tuple[dist.Work, torch.Tensor]:
        """Start receiving into a new buffer; `wait` on the returned work before reading it."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        return dist.irecv(buffer, src, group=self.p2p_group, tag=tag), buffer

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int, what: str
    ) -> torch.Tensor:
        work, buffer = self.post_recv(shape, dtype, device, src, tag)
        self.wait(work, f"receiving {what} from rank {src}")
        return buffer

    def flush(self, older_than: int | None = None) -> None:
        """Wait until every send started so far (or before generation ``older_than``) was delivered.

        Streaming schedules end a step with messages whose receives are posted at the start of the
        next step: they wait for the previous step's sends only, which are then certain to complete.
        """
        keep = []
        for entry in self._pending_sends:
            if older_than is None or entry.generation < older_than:
                self.wait(entry.work, f"sending {entry.what}")
            else:
                keep.append(entry)
        self._pending_sends = keep

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        self.wait(dist.broadcast(tensor, src, async_op=True), f"broadcasting {what} from rank {src}")
        return tensor

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        self.wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), f"reducing {what}")
        return tensor

    def wait(self, work: dist.Work, what: str) -> None:
        """Block on ``work``; a transport error becomes the peer's own failure message if it left one."""
        self.raise_if_peer_failed(what)
        self._waiting = (time.monotonic(), what)
        try:
            work.wait()
        except Exception as error:
            failure = self.peer_failure()
            reason = (
                failure
                if failure is not None
                else f"{type(error).__name__}: {error} (no rank reported a failure, so a peer process probably "
                "died: killed, out of memory, or a lost machine)"
            )
            raise PipelineError(f"[rank {self.rank}] stopped while {what}: {reason}") from error
        finally:
            self._waiting = None

    def close(self) -> None:
        self._closed.set()

    # -- failure handling -------------------------------------------------------------------

    def raise_if_peer_failed(self, what: str = "") -> None:
        failure = self.peer_failure()
        if failure is not None:
            doing = f" while {what}" if what else ""
            raise PipelineError(f"[rank {self.rank}] stopped{doing} because {failure}")

    def peer_failure(self) -> str | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([self.failure_key]):
                return None
            return self._store.get(self.failure_key).decode(errors="replace")
        except Exception as error:  # the store lives on rank 0's host: it died or is unreachable
            return f"the rendezvous store is unreachable ({type(error).__name__}); rank 0 may have died"

    def report_failure(self, message: str) -> None:
        """Publish this rank's failure so every peer stops with ``message``."""
        if self._store is None:
            return
        try:
            if not self._store.check([self.failure_key]):
                self._store.set(self.failure_key, message)
        except Exception:  # best effort: peers still stop on their own timeout
            pass

    def _watch(self) -> None:
        while not self._closed.wait(_STORE_POLL_S):
            waiting = self._waiting
            if waiting is None:
                continue
            since, what = waiting
            failure = self.peer_failure()
            if failure is None and time.monotonic() - since > self.timeout_s:
                failure = (
                    f"[rank {self.rank}] timed out after {self.timeout_s:.0f} s {what}; a peer is stuck or dead. "
                    "Raise `pipeline_timeout_s` if a step legitimately takes longer."
                )
                self.report_failure(failure)
            if failure is not None and self._waiting is waiting:
                # The main thread is blocked in a transport wait that nothing can interrupt.
                sys.stderr.write(f"hf_ftpipe: [rank {self.rank}] stopping while {what}: {failure}\n")
                sys.stderr.flush()
                os._exit(1)


def _default_store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
