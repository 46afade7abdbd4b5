"""Where PipeTrainer's plan comes from: ``partition_file``, the local cache, the Hub repo, or the partitioner.

The plan sources (``hub.sources``) form a chain, tried in that order; the first that gives a plan
for this model and setup wins. A plan pulled from the Hub or computed is written back to the cache,
and a computed one is pushed with ``push_partition_to_hub``. A cached or pulled plan that does not
fit the traced model (another model, a graph it cannot be re-anchored onto, or a plan ``check``
rejects) is refused with a warning and the next source is tried; one made on another transformers
release's graph of the same model is re-anchored onto this graph, and a re-anchored plan is
written back to the cache. An unreachable Hub, a server error or a timeout is a
warning too: the plan is then computed, so a run never fails because the Hub is down; under
``HF_HUB_OFFLINE`` the repo serves only plans downloaded before, and a warning says the Hub is
skipped. Only an explicit ``partition_file`` that is wrong is an error: the user asked for that
file, so the message says to fix it, not to delete it as for a cached one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import HubError, PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.hub.sources import (
    CachedPlans,
    HubPlans,
    Partitioner,
    PlanFile,
    PlanSource,
    Resolved,
    StoredPlanCheck,
)
from hf_ftpipe.hub.store import PartitionStore
from hf_ftpipe.plan.partition import Partition, PartitionKey

__all__ = ["Resolved", "resolve_partition"]

logger = logging.getLogger(__name__)


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
    profile: GPUProfile | None = None,
) -> Resolved:
    """The plan for ``graph`` under ``key``; ``compute()`` runs only when no source has one.

    A pinned ``revision`` skips the local cache: the plan must be the one at that revision
    (huggingface_hub's download cache still serves it offline). With a ``partitioner`` other than
    ``"auto"``, a stored plan made by another partitioner is refused: the key does not record it.
    ``check`` (raising `PartitionError`) applies to every plan; ``check_stored`` to plans from the
    cache or the Hub only, e.g. that they fit this run's memory budget, which the key does not
    record either. ``profile``, the run's GPUs, prices a stored plan that must be re-anchored onto
    this graph (by default the built-in profile its key names).
    """
    if partition_file:  # the store is not even made: a named file needs neither cache nor Hub
        return PlanFile(partition_file, graph, check, profile).find(key)
    store = store or PartitionStore(repo_id, revision=revision)
    fits = StoredPlanCheck(graph, partitioner, check, check_stored, profile)
    sources: list[PlanSource] = []
    if use_cache and not revision:
        sources.append(CachedPlans(store, fits))
    if repo_id:
        sources.append(HubPlans(store, repo_id, fits, revision))
    sources.append(Partitioner(compute, check))
    for source in sources:  # the partitioner, last, always has a plan (or raises why none fits)
        found = source.find(key)
        if found is not None:
            _write_back(found, store, repo_id if push else None, use_cache=use_cache)
            return found
    raise AssertionError("unreachable: the partitioner ends the chain")


def _write_back(found: Resolved, store: PartitionStore, push_to: str | None, *, use_cache: bool) -> None:
    """Cache a plan the cache did not have (pulled, re-anchored or computed); push a computed one to
    ``push_to``."""
    if use_cache and (found.source == "hub" or (found.source == "cache" and found.reanchored is not None)):
        store.save_cached(found.partition)
    if found.source != "computed":
        return
    if use_cache:
        logger.info("partition cached at %s", store.save_cached(found.partition))
    if push_to:
        try:
            path, commit = store.push(found.partition)
            logger.info("partition pushed to hf://datasets/%s/%s (commit %s)", push_to, path, commit)
        except (HubError, PartitionError) as e:
            logger.warning("could not push the partition to %s (%s); it is kept in the local cache", push_to, e)
