"""Where PipeTrainer's plan comes from: ``partition_file``, the local cache, the Hub repo, or the partitioner.

The first that gives a plan for this model and setup wins; a computed plan is cached (and pushed
with ``push_partition_to_hub``). A cached or pulled plan that does not fit the traced model (another
fingerprint, other nodes, or a plan ``check`` rejects) is refused with a warning and the next
source is tried. An unreachable Hub, a server error or a timeout is a warning too: the plan is then
computed, so a run never fails because the Hub is down; under ``HF_HUB_OFFLINE`` the repo serves
only plans downloaded before, and a warning says the Hub is skipped. Only an explicit
``partition_file`` that is wrong is an error: the user asked for that file, so the message says to
fix it, not to delete it as for a cached one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hf_ftpipe.errors import HubError, PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.hub.store import PartitionStore
from hf_ftpipe.plan.partition import Partition, PartitionKey, user_file_fix, with_fix

__all__ = ["Resolved", "resolve_partition"]

logger = logging.getLogger(__name__)

Source = Literal["file", "cache", "hub", "computed"]

_CACHED_FILE_FIX = "Delete the file so that the partition is recomputed."


@dataclass(frozen=True)
class Resolved:
    partition: Partition
    source: Source
    location: str
    """The file, cache path or ``hf://`` location the plan came from ("" when computed)."""


def resolve_partition(
    graph: CostGraph,
    key: PartitionKey,
    compute: Callable[[], Partition],
    *,
    partition_file: str | None = None,
    repo_id: str | None = None,
    revision: str | None = None,
    push: bool = False,
    use_cache: bool = True,
    check: Callable[[Partition], None] | None = None,
    check_stored: Callable[[Partition], None] | None = None,
    partitioner: str = "auto",
    store: PartitionStore | None = None,
) -> Resolved:
    """The plan for ``graph`` under ``key``; ``compute()`` runs only when no source has one.

    A pinned ``revision`` skips the local cache: the plan must be the one at that revision
    (huggingface_hub's download cache still serves it offline). With a ``partitioner`` other than
    ``"auto"``, a stored plan made by another partitioner is refused: the key does not record it.
    ``check`` (raising `PartitionError`) applies to every plan; ``check_stored`` to plans from the
    cache or the Hub only, e.g. that they fit this run's memory budget, which the key does not
    record either.
    """

    def fits(partition: Partition, source: str) -> None:
        if partitioner != "auto" and partition.partitioner != partitioner:
            raise PartitionError(
                f"{source}: made by the {partition.partitioner!r} partitioner, not the {partitioner!r} asked for "
                "(`partitioner='auto'` takes a stored plan by any partitioner)"
            )
        partition.check_key(key, source=source)
        partition.check_matches(graph, source=source)
        for stored_check in (check, check_stored):
            if stored_check is not None:
                stored_check(partition)

    if partition_file:
        fix = (
            f"{user_file_fix(partition_file)} Or drop `partition_file` so that a plan is taken from the cache "
            "or `partition_repo`, or computed."
        )
        with with_fix(fix):
            partition = Partition.from_json(partition_file, expected_key=key)
            partition.check_matches(graph, source=partition_file)
        if check is not None:
            check(partition)
        return Resolved(partition, "file", partition_file)
    store = store or PartitionStore(repo_id, revision=revision)
    if use_cache and not revision:
        path = store.cache_path(key)
        try:
            with with_fix(_CACHED_FILE_FIX):
                cached = store.load_cached(key)
                if cached is not None:
                    fits(cached, str(path))
                    logger.info("partition from the local cache: %s", path)
                    return Resolved(cached, "cache", str(path))
        except PartitionError as e:
            logger.warning("refused the cached partition (%s); looking further", e)
    if repo_id:
        pulled = None
        if store.offline:  # huggingface_hub's download cache still serves a plan pulled before
            logger.warning(
                "HF_HUB_OFFLINE is set, so the Hub is skipped: `partition_repo` %s serves only a plan downloaded "
                "from it before (unset HF_HUB_OFFLINE to pull)",
                repo_id,
            )
        try:
            pulled = store.pull(key, revision=revision)
            if pulled is None:
                logger.info("no partition for this model and setup in %s; computing one", repo_id)
            else:
                fits(pulled.partition, pulled.location)
        except HubError as e:
            logger.warning("could not read the partition from the Hub (%s); computing it instead", e)
            pulled = None
        except PartitionError as e:
            logger.warning("refused the partition from the Hub: %s\nComputing it instead.", e)
            pulled = None
        if pulled is not None:
            logger.info("partition from the Hub: %s (commit %s)", pulled.location, pulled.commit)
            if use_cache:
                store.save_cached(pulled.partition)
            return Resolved(pulled.partition, "hub", pulled.location)
    partition = compute()
    if check is not None:
        check(partition)
    if partition.key != key:
        logger.warning("the partitioner recorded key %s, expected %s: it will not be found again", partition.key, key)
    if use_cache:
        logger.info("partition cached at %s", store.save_cached(partition))
    if push and repo_id:
        try:
            path, commit = store.push(partition)
            logger.info("partition pushed to hf://datasets/%s/%s (commit %s)", repo_id, path, commit)
        except (HubError, PartitionError) as e:
            logger.warning("could not push the partition to %s (%s); it is kept in the local cache", repo_id, e)
    return Resolved(partition, "computed", "")
