"""``HF_HUB_OFFLINE=1`` with a ``partition_repo``: the Hub is skipped, and the run says so (issue 14, item 6).

A tiny GPT-2 traced for real; a loopback Hub (``tests/helpers/hub_server.py``) stands where the repo would
be, to show that nothing is asked of it.
"""

from __future__ import annotations

import logging

import pytest

from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.graph import capture_model
from hf_ftpipe.hub import resolve_partition
from hf_ftpipe.partitioners import partition_seq_greedy

from hub_server import HubServer
from models import tiny_batch, tiny_model

REPO = "ftpipe/plans"


def test_offline_run_says_the_hub_is_skipped(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    graph = capture_model(tiny_model("gpt2"), tiny_batch("gpt2", 2)).cost_graph
    plan = partition_seq_greedy(graph, get_profile("cpu", count=2), num_microbatches=2, microbatch_size=2)
    server = HubServer().start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with caplog.at_level(logging.INFO, logger="hf_ftpipe.hub"):
            resolved = resolve_partition(graph, plan.key, lambda: plan, repo_id=REPO)
    finally:
        server.stop()
    assert resolved.source == "computed" and server.requests == []
    notices = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("hf_ftpipe")]
    assert [record.getMessage() for record in notices] == [
        f"HF_HUB_OFFLINE is set, so the Hub is skipped: `partition_repo` {REPO} serves only a plan downloaded "
        "from it before (unset HF_HUB_OFFLINE to pull)"
    ]
