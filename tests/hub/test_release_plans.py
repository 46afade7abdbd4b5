"""A plan shared under one transformers release serves the next: pulled from the Hub, read from a
named file or from the cache, it is re-anchored onto the new graph of the same model, and a plan
for another model is still refused (the rules themselves: tests/plan/test_reanchor.py)."""

from __future__ import annotations

import logging

import pytest

from hf_ftpipe.errors import PartitionFormatError
from hf_ftpipe.hub import PartitionStore, resolve_partition
from hf_ftpipe.partitioners import partition_seq_greedy

from toy_graphs import UNIT, make_graph

REPO = "ftpipe/plans"


def _release(extra_op: bool, fingerprint: str = "toy-fingerprint"):
    """Four ops in two layers; the next release adds a no-op inside layer 1, renaming the ops after it."""
    scopes = ["layers.0", "layers.0", "layers.1", "layers.1"]
    if extra_op:
        scopes.insert(3, "layers.1")
    names = [f"mm_{i}" for i in range(len(scopes))]
    nodes = {
        name: {"flops": 0.0 if extra_op and i == 3 else 4.0, "scope": s}
        for i, (name, s) in enumerate(zip(names, scopes))
    }
    return make_graph(nodes, list(zip(names, names[1:])), fingerprint=fingerprint)


OLD, NEW = _release(False), _release(True)
PLAN = partition_seq_greedy(OLD, UNIT.with_count(2), 2, num_microbatches=2, microbatch_size=1)


def _never():
    pytest.fail("a plan that re-anchors must not be recomputed")


def test_a_plan_pushed_under_one_release_is_pulled_and_re_anchored_under_the_next(hub, caplog) -> None:
    PartitionStore(REPO).push(PLAN)
    with caplog.at_level(logging.INFO, logger="hf_ftpipe.hub"):
        pulled = resolve_partition(NEW, PLAN.key, _never, repo_id=REPO, profile=UNIT.with_count(2))
    assert pulled.source == "hub" and pulled.reanchored is not None
    assert pulled.partition.node_stage == {"mm_0": 0, "mm_1": 0, "mm_2": 1, "mm_3": 1, "mm_4": 1}
    assert "re-anchored onto this graph" in caplog.text and "1 placed with their module (in layers.1)" in caplog.text
    cached = resolve_partition(NEW, PLAN.key, _never, repo_id=REPO)  # written back: exact from the cache
    assert (cached.source, cached.reanchored, cached.partition.node_stage) == (
        "cache",
        None,
        pulled.partition.node_stage,
    )


def test_a_named_file_of_the_last_release_is_re_anchored_and_one_for_another_model_is_an_error(tmp_path) -> None:
    path = tmp_path / "plan.json"
    PLAN.to_json(path)
    resolved = resolve_partition(NEW, PLAN.key, _never, partition_file=str(path), profile=UNIT.with_count(2))
    assert resolved.source == "file" and resolved.reanchored.by_module == 1
    other = _release(True, fingerprint="another-model")
    with pytest.raises(PartitionFormatError, match=r"(?s)made for another model.*Fix .*plan\.json"):
        resolve_partition(other, PLAN.key, _never, partition_file=str(path), profile=UNIT.with_count(2))
