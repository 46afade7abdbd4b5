"""PartitionStore against the loopback Hub, with the real huggingface_hub client."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import pytest

from hf_ftpipe.errors import HubError, PartitionError, PartitionFormatError
from hf_ftpipe.hub import MAX_HUB_FILE_BYTES, PartitionStore, path_for, resolve_partition
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition

from toy_graphs import UNIT, chain

REPO = "ftpipe/plans"


def _graph():
    return chain([3, 1, 4, 1, 5, 9])


def _plan(graph=None, num_gpus: int = 3) -> Partition:
    return partition_seq_greedy(graph or _graph(), UNIT.with_count(num_gpus), 2, num_microbatches=4, microbatch_size=2)


def test_push_then_pull_gives_the_identical_plan_and_list_finds_it(hub) -> None:
    plan = _plan()
    path, commit = PartitionStore(REPO).push(plan)
    assert path == path_for(plan.key) and path.startswith("plans/v2/ToyModel/toy-fingerprint/unitx3/gpipe-mb4-")
    assert hub.repo(REPO).commits[commit].title.startswith("ToyModel on 3 × unit, gpipe, 4 micro-batches: ")
    assert "samples/s predicted, worst/ideal" in hub.repo(REPO).commits[commit].title

    pulled = PartitionStore(REPO).pull(plan.key)
    assert pulled is not None and pulled.commit == commit
    assert pulled.partition.to_dict() == plan.to_dict()

    entries = PartitionStore(REPO).list(model="toymodel", gpu_profile="unit")
    assert [e.path for e in entries] == [path]
    assert entries[0].num_gpus == 3 and entries[0].key_digest == plan.key.digest()
    assert PartitionStore(REPO).list(gpu_profile="a100_80gb") == []
    assert PartitionStore(REPO).pull(_plan(num_gpus=2).key) is None  # another key: nothing there


def test_a_push_without_a_token_is_refused_by_the_server(hub, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError, match="cannot push"):
        PartitionStore(REPO).push(_plan())


def test_a_pinned_revision_is_honoured(hub) -> None:
    first = _plan()
    _, first_commit = PartitionStore(REPO).push(first)
    second = replace(first, partitioner="hand-made", stage_device=[1, 0])
    _, second_commit = PartitionStore(REPO).push(second)
    assert first_commit != second_commit
    assert PartitionStore(REPO).pull(first.key).partition.to_dict() == second.to_dict()
    old = PartitionStore(REPO, revision=first_commit).pull(first.key)
    assert old.commit == first_commit and old.partition.to_dict() == first.to_dict()
    initial = hub.repo(REPO).commits[first_commit].parent  # the empty repo, before the first push
    assert [e.path for e in PartitionStore(REPO).list(revision=first_commit)] == [path_for(first.key)]
    assert PartitionStore(REPO).list(revision=initial) == []
    with pytest.raises(HubError, match="revision 'no-such-branch' does not exist"):
        PartitionStore(REPO).pull(first.key, revision="no-such-branch")


def test_offline_reads_the_cache_and_never_the_network(hub, monkeypatch) -> None:
    plan = _plan()
    PartitionStore(REPO).push(plan)
    PartitionStore(REPO).pull(plan.key)  # fills huggingface_hub's download cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    pulled = PartitionStore(REPO).pull(plan.key)
    assert pulled.partition.to_dict() == plan.to_dict()
    assert [e.path for e in PartitionStore(REPO).list()] == [path_for(plan.key)]
    assert PartitionStore(REPO).pull(_plan(num_gpus=2).key) is None  # not downloaded before: not found offline
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        PartitionStore(REPO).push(plan)
    assert hub.requests == []


def _upload(hub, path: str, content: bytes) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url)
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    api.upload_file(path_or_fileobj=content, path_in_repo=path, repo_id=REPO, repo_type="dataset")


def test_a_corrupt_file_is_refused_with_its_hub_location(hub) -> None:
    plan = _plan()
    _upload(hub, path_for(plan.key), b'{"format": "hf_ftpipe.partition", "format_version": 1, "node_st')
    with pytest.raises(PartitionFormatError) as error:
        PartitionStore(REPO).pull(plan.key)
    message = str(error.value)
    assert message.startswith(f"hf://datasets/{REPO}@main/{path_for(plan.key)}: not valid JSON")


def test_a_plan_for_another_model_is_refused(hub) -> None:
    plan = _plan()
    other = _plan(chain([3, 1, 4, 1, 5, 9], fingerprint="another-model"))
    _upload(hub, path_for(plan.key), json.dumps(other.to_dict()).encode())
    with pytest.raises(PartitionFormatError, match="planned for another model or setup:\n  model_fingerprint"):
        PartitionStore(REPO).pull(plan.key)


def test_an_oversized_file_is_refused_before_download_and_after(hub) -> None:
    plan = _plan()
    _upload(hub, path_for(plan.key), b" " * (MAX_HUB_FILE_BYTES + 1))
    hub.requests.clear()
    with pytest.raises(PartitionFormatError, match=r"more than the 8388608 .* refused without downloading it"):
        PartitionStore(REPO).pull(plan.key)
    assert [method for method, _ in hub.requests] == ["HEAD"]
    hub.omit_head_length = True  # no size in the HEAD answer: checked on disk
    with pytest.raises(PartitionFormatError, match=r"8388608 a partition file from the Hub may have; refused$"):
        PartitionStore(REPO).pull(plan.key)


@pytest.mark.parametrize("fault", ["500", "timeout"])
def test_a_server_error_or_timeout_falls_back_to_computing_with_a_warning(hub, monkeypatch, caplog, fault) -> None:
    graph, plan = _graph(), _plan()
    PartitionStore(REPO).push(plan)
    if fault == "500":
        hub.fail_with(500)
    else:
        monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "0.3")
        hub.delay_s = 2.0
    computed = []

    def compute() -> Partition:
        computed.append(1)
        return _plan(graph)

    with caplog.at_level(logging.INFO, logger="hf_ftpipe.hub"):
        resolved = resolve_partition(graph, plan.key, compute, repo_id=REPO, use_cache=False)
    assert computed == [1] and resolved.source == "computed"
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "could not read the partition from the Hub" in warning and "computing it instead" in warning
    assert ("500" in warning) if fault == "500" else ("Timeout" in warning)


def test_resolution_order_cache_then_hub_then_compute(hub, caplog) -> None:
    graph, plan = _graph(), _plan()
    computed = []

    def compute() -> Partition:
        computed.append(1)
        return _plan(graph)

    first = resolve_partition(graph, plan.key, compute, repo_id=REPO, push=True)
    assert first.source == "computed" and computed == [1]
    assert PartitionStore(REPO).list() != []  # pushed
    assert resolve_partition(graph, plan.key, compute, repo_id=REPO).source == "cache"
    PartitionStore().cache_path(plan.key).unlink()
    pulled = resolve_partition(graph, plan.key, compute, repo_id=REPO)
    assert pulled.source == "hub" and pulled.partition.to_dict() == first.partition.to_dict() and computed == [1]

    # A stored plan by another partitioner than the one asked for is refused ('auto' takes any).
    assert resolve_partition(graph, plan.key, compute, repo_id=REPO, partitioner="seq-greedy").source == "cache"
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        by_mixed = resolve_partition(graph, plan.key, compute, repo_id=REPO, partitioner="mixed", use_cache=False)
    assert by_mixed.source == "computed" and computed == [1, 1]
    assert "made by the 'seq-greedy' partitioner, not the 'mixed' asked for" in caplog.text
    caplog.clear()

    # A plan whose nodes are not the traced model's is refused, with a warning, and recomputed.
    PartitionStore().cache_path(plan.key).unlink()
    wrong = replace(plan, node_stage={f"{name}_renamed": s for name, s in plan.node_stage.items()}, anchors=None)
    _upload(hub, path_for(plan.key), json.dumps(wrong.to_dict()).encode())
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        again = resolve_partition(graph, plan.key, compute, repo_id=REPO)
    assert again.source == "computed" and computed == [1, 1, 1]
    assert "refused the partition from the Hub" in caplog.text and "does not fit this model's graph" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"push_partition_to_hub": True}, "`push_partition_to_hub=True` needs `partition_repo`"),
        ({"partition_repo": "plans"}, "`partition_repo='plans'` is not a repo id; use 'namespace/name'"),
        ({"partition_revision": "main"}, "`partition_revision='main'` needs `partition_repo`"),
    ],
)
def test_hub_arguments_name_the_problem_and_the_fix(tmp_path, overrides: dict, message: str) -> None:
    from hf_ftpipe import PipeTrainingArguments

    with pytest.raises(ValueError) as error:
        PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)
    assert message in str(error.value)


def test_an_explicit_partition_file_wins_and_a_wrong_one_is_an_error(hub, tmp_path) -> None:
    graph, plan = _graph(), _plan()
    plan.to_json(tmp_path / "plan.json")

    def compute() -> Partition:
        raise AssertionError("an explicit partition_file must not be recomputed")

    resolved = resolve_partition(graph, plan.key, compute, partition_file=str(tmp_path / "plan.json"), repo_id=REPO)
    assert resolved.source == "file" and resolved.partition.to_dict() == plan.to_dict() and hub.requests == []
    _plan(num_gpus=2).to_json(tmp_path / "other.json")
    with pytest.raises(PartitionFormatError, match="num_gpus: file has 2, expected 3"):
        resolve_partition(graph, plan.key, compute, partition_file=str(tmp_path / "other.json"))


def test_a_server_error_falls_back_to_the_copy_downloaded_before(hub, caplog) -> None:
    plan = _plan()
    PartitionStore(REPO).push(plan)
    PartitionStore(REPO).pull(plan.key)
    hub.fail_with(503)
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        pulled = PartitionStore(REPO).pull(plan.key)
    assert pulled.partition.to_dict() == plan.to_dict()
    assert "503" in caplog.text and "using the copy downloaded before" in caplog.text


def test_a_stored_plan_that_does_not_fit_this_runs_budget_is_refused_and_recomputed(hub, caplog) -> None:
    """The key does not record the optimizer, recomputation or headroom: ``check_stored`` (PipeTrainer
    re-estimates the plan's memory under the run's options) refuses a cached or pulled plan made for
    a lighter budget, with a warning, and the plan is computed for this run."""
    graph, plan = _graph(), _plan()
    computed = []

    def compute() -> Partition:
        computed.append(1)
        return _plan(graph)

    def too_big(partition: Partition) -> None:
        raise PartitionError("the plan was made for another memory budget and does not fit this run's")

    resolve_partition(graph, plan.key, compute, repo_id=REPO, push=True)
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        again = resolve_partition(graph, plan.key, compute, repo_id=REPO, check_stored=too_big)
    assert again.source == "computed" and computed == [1, 1]
    assert caplog.text.count("made for another memory budget") == 2  # the cached copy, then the Hub's
    assert resolve_partition(graph, plan.key, compute, repo_id=REPO, check_stored=lambda _: None).source == "cache"


def test_a_silent_server_fails_push_pull_and_list_within_three_timeouts(hub, monkeypatch) -> None:
    """huggingface_hub waits for an answer without limit; the store gives up after 3 × HF_HUB_ETAG_TIMEOUT
    (a pull's first request, the HEAD, already has that timeout)."""
    PartitionStore(REPO).push(_plan())
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "0.2")
    hub.delay_s = 3.0
    calls = {
        r"no answer within 0.6 s \(3 × HF_HUB_ETAG_TIMEOUT\)": lambda store: store.push(_plan()),
        r"listing ftpipe/plans at .*: no answer within 0.6 s": lambda store: store.list(),
        r"cannot read it from .*Timeout": lambda store: store.pull(_plan().key),
    }
    for message, call in calls.items():
        started = time.monotonic()
        with pytest.raises(HubError, match=message):
            call(PartitionStore(REPO))
        assert time.monotonic() - started < 2.0
