"""The plan sources alone (no server): each finds a plan or answers None, and resolution takes the first."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hf_ftpipe.hub import PartitionStore, resolve_partition
from hf_ftpipe.hub.sources import CachedPlans, HubPlans, Partitioner, StoredPlanCheck
from hf_ftpipe.partitioners import partition_seq_greedy

from toy_graphs import UNIT, chain

GRAPH = chain([3, 1, 4, 1, 5, 9])
PLAN = partition_seq_greedy(GRAPH, UNIT.with_count(3), 2, num_microbatches=4, microbatch_size=2)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PartitionStore:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return PartitionStore("ftpipe/plans", offline=True)


def test_the_cache_answers_none_until_a_computed_plan_is_written_back(store: PartitionStore) -> None:
    cache = CachedPlans(store, StoredPlanCheck(GRAPH))
    assert cache.find(PLAN.key) is None
    computed = resolve_partition(GRAPH, PLAN.key, lambda: PLAN, store=store)
    assert computed.source == "computed" and Partitioner(lambda: PLAN).find(PLAN.key).source == "computed"
    found = cache.find(PLAN.key)
    assert found is not None and found.source == "cache" and found.location == str(store.cache_path(PLAN.key))


def test_a_refused_cached_plan_is_skipped_with_a_warning(store: PartitionStore, caplog) -> None:
    store.save_cached(PLAN)
    refused = CachedPlans(store, StoredPlanCheck(GRAPH, partitioner="mixed"))
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        assert refused.find(PLAN.key) is None
    assert "refused the cached partition" in caplog.text and "not the 'mixed' asked for" in caplog.text


def test_an_offline_hub_without_a_download_answers_none_and_says_it_is_skipped(store: PartitionStore, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        assert HubPlans(store, "ftpipe/plans", StoredPlanCheck(GRAPH)).find(PLAN.key) is None
    assert "HF_HUB_OFFLINE is set, so the Hub is skipped" in caplog.text
