"""Bounded waits: a rank blocked on its peers stops with the reason instead of hanging.

Transport waits and collectives cannot be interrupted (a gloo wait with a timeout breaks the
connection), so a thread does the watching. A rank enters every blocking call through
`Watchdog.waiting`; the thread polls the rendezvous store a few times a second. A rank that
fails writes ``[rank r, stage s] ...`` there first, so its peers stop within a fraction of a
second with that message; a wait that outlives ``timeout_s`` publishes its own reason and ends
the process. Collectives that every rank issues in the same order also record how far each rank
got, so a timed-out collective names the ranks that never arrived (a rank stopped, swapped out
or deadlocked elsewhere) rather than blaming "a peer"; a wait on given peers (a transfer, a
reduction within a group) names those.

A rank fails in one of two ways, and both end as an error naming it on every other rank:

- it raises: `Watchdog.report_exception` publishes the exception (``[rank r] failed while ...``)
  before it leaves the rank, so a peer blocked on it stops within a fraction of a second with that
  message, and one that is not blocked raises it at its next wait;
- its process dies (killed, out of memory): a peer blocked on it gets a transport error
  (gloo's ``Connection closed by peer``), which `Watchdog.waiting` turns into an error naming the
  ranks that did not arrive, or the failure a rank published, rather than passing it on raw.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist

from hf_ftpipe.errors import PipelineError

__all__ = ["Watchdog"]

T = TypeVar("T")

_KEY = "hf_ftpipe/watchdog"
_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
"""gloo's ``[/path/to/pair.cc:537] `` before its message."""
_STORE_POLL_S = 0.2
_STORE_ANSWER_S = 5.0
"""How long the watchdog waits for the store when it is about to stop the process: the store's
host may be the rank that stopped answering."""


class Watchdog:
    """Watches this rank's blocking calls and the failures its peers publish.

    Args:
        rank (`int`): this process's rank in the default group.
        world_size (`int`): the number of ranks (for naming those that did not arrive).
        timeout_s (`float`): the longest any single wait may block before the job is stopped.
        run_id (`str`): distinguishes this run's keys in the store from earlier ones in the same job.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, run_id: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.failure_key = f"{_KEY}/{run_id}/failure"
        self._arrival_key = f"{_KEY}/{run_id}/arrived"
        self._arrivals = 0
        self._arrived: tuple[int, str] | None = None
        """This rank's last collective (number, what), published to the store by the thread."""
        self._published: tuple[int, str] | None = None
        self._store = _default_store()
        self._waiting: tuple[float, str, int | None, tuple[int, ...]] | None = None
        """(since, what, the collective's number, the peers waited on) of the wait in progress, if any."""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hf_ftpipe-watchdog-{rank}", daemon=True)
        self._thread.start()
        # A daemon thread still inside a store call when the interpreter finalizes is ended by
        # pthread_exit, which C++ frames turn into std::terminate (SIGABRT at the very end of a
        # successful job): stop the thread while the interpreter is still whole.
        atexit.register(self.close)

    @contextmanager
    def waiting(
        self, what: str, collective: bool = False, peers: Sequence[int] = (), runs_user_code: bool = False
    ) -> Iterator[None]:
        """Block inside this context for at most ``timeout_s``: past it, or when a peer fails, the
        process ends with the reason (nothing can interrupt the blocked thread).

        ``collective``: every rank enters this wait, in the same order (a barrier, a gather); its
        arrival is recorded (by the watching thread: the store's host may be the rank that stopped)
        so that a timeout can name the ranks that never came. ``peers``: the ranks the wait
        depends on otherwise (the other end of a transfer, the group of a reduction), named if it
        times out.

        An exception the body raises becomes a `PipelineError` naming its cause: the failure a
        peer published, else (a transport error: a peer's process died) the ranks that did not
        arrive. With ``runs_user_code`` (the body also runs the user's code, e.g. a collator) an
        exception is passed on as it is unless a peer published a failure.
        """
        self.raise_if_peer_failed(what)
        number = None
        if collective:
            self._arrivals += 1
            number = self._arrivals
            self._arrived = (number, what)
        outer = self._waiting
        self._waiting = (time.monotonic(), what, number, tuple(peers))
        try:
            yield
        except PipelineError:
            raise
        except Exception as error:
            failure = self.peer_failure()
            if failure is None and runs_user_code:
                raise
            raise PipelineError(
                f"[rank {self.rank}] stopped while {what}: {failure or self._transport_failure(error, number, peers)}"
            ) from error
        finally:
            self._waiting = outer

    def broadcast_from_rank0(self, payload: list[Any], what: str) -> None:
        """Fill ``payload`` on every rank with rank 0's (`dist.broadcast_object_list`), a collective wait
        named ``what`` and bounded as `waiting` bounds any."""
        with self.waiting(what, collective=True):
            dist.broadcast_object_list(payload, src=0)

    def report_exception(self, what: str, error: BaseException) -> None:
        """Publish ``error``, raised by this rank while ``what``, so that every peer stops with
        ``[rank r] failed while {what}: ...`` instead of waiting for this rank or dying on a closed
        connection. The first failure published wins: callers nested around one call name the
        innermost ``what``."""
        text = str(error)
        if not text.startswith("[rank "):
            text = f"[rank {self.rank}] failed while {what}: {type(error).__name__}: {text}"
        self.report_failure(text)

    def raise_if_peer_failed(self, what: str = "") -> None:
        failure = self.peer_failure()
        if failure is not None:
            doing = f" while {what}" if what else ""
            raise PipelineError(f"[rank {self.rank}] stopped{doing} because {failure}")

    def peer_failure(self) -> str | None:
        """The failure a rank published, if any."""
        try:
            return self._store_call(
                lambda store: (
                    store.get(self.failure_key).decode(errors="replace") if store.check([self.failure_key]) else None
                )
            )
        except Exception as error:  # the store lives on one host: it died or is unreachable
            return f"the rendezvous store is unreachable ({type(error).__name__}); the rank hosting it may have died"

    def report_failure(self, message: str) -> None:
        """Publish this rank's failure so every peer stops with ``message`` (the first one wins)."""
        try:
            self._store_call(
                lambda store: None if store.check([self.failure_key]) else store.set(self.failure_key, message)
            )
        except Exception:  # best effort: peers still stop on their own timeout
            pass

    def close(self) -> None:
        """Stop watching; waits for the thread to leave any store call it is in."""
        self._closed.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * _STORE_ANSWER_S)

    # -- the watching thread ----------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(_STORE_POLL_S):
            arrived = self._arrived
            if arrived is not None and arrived != self._published:
                self._bounded(partial(self._publish_arrival, arrived), None)
            waiting = self._waiting
            if waiting is None:
                continue
            since, what, number, peers = waiting
            if time.monotonic() - since > self.timeout_s:
                offline = self._timed_out(what, None, peers, ask_store=False)  # if the store does not answer
                failure = self._bounded(partial(self._timed_out, what, number, peers), offline)
                self._bounded(partial(self.report_failure, failure), None)
            else:  # a store that does not answer yet is no reason to stop before the timeout
                failure = self._bounded(self.peer_failure, None)
            if failure is not None and self._waiting is waiting:
                # The main thread is blocked in a wait that nothing can interrupt.
                own = failure.startswith(f"[rank {self.rank}]")
                sys.stderr.write(
                    f"hf_ftpipe: {failure}\n"
                    if own
                    else f"hf_ftpipe: [rank {self.rank}] stopping while {what}: {failure}\n"
                )
                sys.stderr.flush()
                os._exit(1)

    def _publish_arrival(self, arrived: tuple[int, str]) -> None:
        number, what = arrived
        self._store_call(lambda store: store.set(f"{self._arrival_key}/{self.rank}", f"{number}\n{what}"))
        self._published = arrived

    def _timed_out(self, what: str, number: int | None, peers: tuple[int, ...], ask_store: bool = True) -> str:
        message = f"[rank {self.rank}] timed out after {self.timeout_s:.0f} s {what}"
        if not ask_store:
            silent = "; ".join(f"rank {rank} did not answer" for rank in peers)
        elif number is not None:
            silent = self._silent_ranks(number)
        else:
            silent = self._peers_seen(peers)
        if silent:
            message += f": {silent}"
        else:
            message += "; a peer is stuck or dead"
        return message + ". Raise `pipeline_timeout_s` if this legitimately takes longer."

    def _transport_failure(self, error: Exception, number: int | None, peers: Sequence[int]) -> str:
        """Why a wait failed when no rank published a failure: a peer's process died. Names the
        ranks that did not arrive where it can, then the transport's own words, less gloo's
        source location."""
        silent = self._bounded(partial(self._silent_ranks, number), None) if number is not None else None
        silent = silent or self._bounded(partial(self._peers_seen, tuple(peers)), None)
        detail = _LOCATION.sub("", (str(error).strip().splitlines() or [""])[0]).split(". ")[0][:300]
        died = "no rank reported a failure, so a peer process probably died (killed, out of memory, or a lost machine)"
        if silent:
            return f"{silent}, and {died}: {type(error).__name__}: {detail}"
        return f"{type(error).__name__}: {detail} ({died})"

    def _silent_ranks(self, number: int) -> str | None:
        """Which ranks never reached collective ``number``, and where each one last was."""
        behind = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            count, where = self._last_arrival(rank)
            if count < number:
                behind.append(f"rank {rank} did not answer ({_seen(where)})")
        return "; ".join(behind) or None

    def _peers_seen(self, peers: tuple[int, ...]) -> str | None:
        """The ranks a wait depends on, and where each one last was."""
        return "; ".join(f"rank {rank} did not answer ({_seen(self._last_arrival(rank)[1])})" for rank in peers) or None

    def _last_arrival(self, rank: int) -> tuple[int, str]:
        """The number and name of the last collective ``rank`` reached (0 and "" if none)."""
        key = f"{self._arrival_key}/{rank}"
        last = self._store_call(lambda store: store.get(key).decode() if store.check([key]) else None)
        count, _, where = (last or "0\n").partition("\n")
        return int(count), where

    def _store_call(self, call: Callable[[dist.Store], T]) -> T | None:
        return None if self._store is None else call(self._store)

    @staticmethod
    def _bounded(call: Callable[[], T], default: T) -> T:
        """``call()`` from a helper thread, or ``default`` when it raises or takes longer than
        `_STORE_ANSWER_S`: a store whose host stopped never answers."""
        answer: list[T] = []

        def run() -> None:
            try:
                answer.append(call())
            except Exception:
                pass

        helper = threading.Thread(target=run, daemon=True)
        helper.start()
        helper.join(_STORE_ANSWER_S)
        return answer[0] if answer else default


def _seen(where: str) -> str:
    return f"last seen {where}" if where else "never arrived"


def _default_store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
