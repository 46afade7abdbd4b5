"""The places a plan can come from, each a small object that finds the plan for a key or says it has none.

`resolve_partition` walks them in order (``PlanFile``; else ``CachedPlans``, ``HubPlans``,
``Partitioner``) and takes the first plan found. A source that cannot serve (a refused file in
the cache, an unreachable Hub) warns and answers None, so the next one is tried; only
``PlanFile``, the file the user named, raises: the message then says to fix that file.

A stored plan (a file, the cache, the Hub) made on another release's graph of the same model is
re-anchored onto this graph (`plan.reanchor.fit_to_graph`) and served with one info line naming
both versions and what moved; only when that fails is it refused, saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import HubError, PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.hub.store import PartitionStore
from hf_ftpipe.plan.partition import Partition, PartitionKey, user_file_fix, with_fix
from hf_ftpipe.plan.reanchor import Reanchored, fit_to_graph

__all__ = ["CachedPlans", "HubPlans", "Partitioner", "PlanFile", "PlanSource", "Resolved", "StoredPlanCheck"]

logger = logging.getLogger(__name__)

Source = Literal["file", "cache", "hub", "computed"]

_CACHED_FILE_FIX = "Delete the file so that the partition is recomputed."


@dataclass(frozen=True)
class Resolved:
    partition: Partition
    source: Source
    location: str
    """The file, cache path or ``hf://`` location the plan came from ("" when computed)."""
    reanchored: Reanchored | None = None
    """How a stored plan made on another release's graph was placed onto this one; None when exact."""


class PlanSource(Protocol):
    """One link of the chain: the plan for ``key``, or None to let the next source try."""

    name: Source

    def find(self, key: PartitionKey) -> Resolved | None: ...


@dataclass(frozen=True)
class StoredPlanCheck:
    """What a stored plan (a named file, the cache, the Hub) must pass: this model, this key, and the
    run's checks.

    A plan made on another release's graph of the model is re-anchored onto this graph first
    (priced with ``profile``, the run's GPUs). With a ``partitioner`` other than ``"auto"``, a plan
    made by another partitioner is refused: the key does not record it. ``check`` applies to every
    plan; ``check_stored`` only to stored ones (e.g. that they fit this run's memory budget, which
    the key does not record either).
    """

    graph: CostGraph
    partitioner: str = "auto"
    check: Callable[[Partition], None] | None = None
    check_stored: Callable[[Partition], None] | None = None
    profile: GPUProfile | None = None

    def __call__(self, partition: Partition, key: PartitionKey, source: str) -> tuple[Partition, Reanchored | None]:
        """``partition`` (read from ``source``) as it serves this run, maybe re-anchored; a
        `PartitionError` if it does not serve."""
        if self.partitioner != "auto" and partition.partitioner != self.partitioner:
            raise PartitionError(
                f"{source}: made by the {partition.partitioner!r} partitioner, not the {self.partitioner!r} asked "
                "for (`partitioner='auto'` takes a stored plan by any partitioner)"
            )
        partition.check_key(key, source=source)
        partition, reanchored = fit_to_graph(partition, self.graph, self.profile, source=source)
        for stored_check in (self.check, self.check_stored):
            if stored_check is not None:
                stored_check(partition)
        if reanchored is not None:
            logger.info("%s: %s", source, reanchored.describe())
        return partition, reanchored


@dataclass(frozen=True)
class PlanFile:
    """``partition_file``: the user asked for this file, so a wrong one is an error, not a fallback."""

    path: str
    graph: CostGraph
    check: Callable[[Partition], None] | None = None
    profile: GPUProfile | None = None
    name: Source = "file"

    def find(self, key: PartitionKey) -> Resolved:
        fix = (
            f"{user_file_fix(self.path)} Or drop `partition_file` so that a plan is taken from the cache "
            "or `partition_repo`, or computed."
        )
        # Whatever partitioner made it, and without the budget checks of plans nobody named.
        fits = StoredPlanCheck(self.graph, check=self.check, profile=self.profile)
        with with_fix(fix):
            partition, reanchored = fits(Partition.from_json(self.path, expected_key=key), key, self.path)
        return Resolved(partition, "file", self.path, reanchored)


@dataclass(frozen=True)
class CachedPlans:
    """The local cache (``$HF_HOME/hf_ftpipe/partitions``); a refused file there is skipped with a warning."""

    store: PartitionStore
    fits: StoredPlanCheck
    name: Source = "cache"

    def find(self, key: PartitionKey) -> Resolved | None:
        path = self.store.cache_path(key)
        try:
            with with_fix(_CACHED_FILE_FIX):
                cached = self.store.load_cached(key)
                if cached is not None:
                    cached, reanchored = self.fits(cached, key, str(path))
                    logger.info("partition from the local cache: %s", path)
                    return Resolved(cached, "cache", str(path), reanchored)
        except PartitionError as e:
            logger.warning("refused the cached partition (%s); looking further", e)
        return None


@dataclass(frozen=True)
class HubPlans:
    """A Hub dataset repo. Unreachable, failing or refused: a warning, and the plan is computed instead;
    under ``HF_HUB_OFFLINE`` it serves only plans downloaded before."""

    store: PartitionStore
    repo_id: str
    fits: StoredPlanCheck
    revision: str | None = None
    name: Source = "hub"

    def find(self, key: PartitionKey) -> Resolved | None:
        if self.store.offline:  # huggingface_hub's download cache still serves a plan pulled before
            logger.warning(
                "HF_HUB_OFFLINE is set, so the Hub is skipped: `partition_repo` %s serves only a plan downloaded "
                "from it before (unset HF_HUB_OFFLINE to pull)",
                self.repo_id,
            )
        try:
            pulled = self.store.pull(key, revision=self.revision)
            if pulled is None:
                logger.info("no partition for this model and setup in %s; computing one", self.repo_id)
                return None
            partition, reanchored = self.fits(pulled.partition, key, pulled.location)
        except HubError as e:
            logger.warning("could not read the partition from the Hub (%s); computing it instead", e)
            return None
        except PartitionError as e:
            logger.warning("refused the partition from the Hub: %s\nComputing it instead.", e)
            return None
        logger.info("partition from the Hub: %s (commit %s)", pulled.location, pulled.commit)
        return Resolved(partition, "hub", pulled.location, reanchored)


@dataclass(frozen=True)
class Partitioner:
    """The last source: run the partitioner (``compute``); it always has a plan, or raises why none fits."""

    compute: Callable[[], Partition]
    check: Callable[[Partition], None] | None = None
    name: Source = "computed"

    def find(self, key: PartitionKey) -> Resolved:
        partition = self.compute()
        if self.check is not None:
            self.check(partition)
        if partition.key != key:
            logger.warning(
                "the partitioner recorded key %s, expected %s: it will not be found again", partition.key, key
            )
        return Resolved(partition, "computed", "")
