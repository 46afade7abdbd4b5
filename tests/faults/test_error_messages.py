"""Errors that name their real cause and the fix, not a later symptom (issue 14, item 3).

A wrong ``partition_file`` (fix or rewrite it, not "delete it", which is the advice for a cached
file); JSON nested too deep to parse; a model whose forward branches on its labels. Real tiny
models (``tests/helpers/models.py``) and real files. Checkpoints that cannot be resumed are in
``test_checkpoint_faults.py``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.errors import PartitionFormatError, ProfileError, TraceError
from hf_ftpipe.graph import CostGraph, capture_model
from hf_ftpipe.hub import PartitionStore, resolve_partition
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition

from models import VOCAB, tiny_batch
from tiny_captures import tiny_graph

TOO_DEEP = "[" * 100_000


# -- partition files ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_graph() -> CostGraph:
    return tiny_graph("gpt2")


def _plan(graph: CostGraph, num_gpus: int = 2) -> Partition:
    profile = get_profile("cpu", count=num_gpus)
    return partition_seq_greedy(graph, profile, num_microbatches=2, microbatch_size=2)


def _never() -> Partition:
    raise AssertionError("an explicit partition_file must not be recomputed")


def _other_setup(plan: Partition, path: Path) -> None:
    replace(plan, key=replace(plan.key, num_gpus=3)).to_json(path)


def _other_model(plan: Partition, path: Path) -> None:
    nodes = {f"other_{name}": stage for name, stage in plan.node_stage.items()}
    replace(plan, node_stage=nodes, anchors=None).to_json(path)  # a hand-made plan: no graph recorded


def _truncated(plan: Partition, path: Path) -> None:
    plan.to_json(path)
    path.write_text(path.read_text()[:200])


@pytest.mark.parametrize(
    ("write", "problem"),
    [
        (_other_setup, "this partition was planned for another model or setup:\n  num_gpus: file has 3, expected 2"),
        (_other_model, "the partition does not fit this model's graph"),
        (_truncated, "not valid JSON"),
    ],
    ids=["another-setup", "another-model", "truncated"],
)
def test_a_bad_partition_file_the_user_passed_is_to_be_fixed_not_deleted(
    gpt2_graph: CostGraph, tmp_path: Path, write, problem: str
) -> None:
    plan = _plan(gpt2_graph)
    path = tmp_path / "plan.json"
    write(plan, path)
    with pytest.raises(PartitionFormatError) as error:
        resolve_partition(gpt2_graph, plan.key, _never, partition_file=str(path))
    message = str(error.value)
    assert message.startswith(str(path)) and problem in message
    assert f"Fix {path}, or write it again with `hf-ftpipe partition MODEL --gpus N ... -o {path}`." in message
    assert "Or drop `partition_file`" in message and "Delete" not in message


def test_a_bad_cached_partition_is_still_to_be_deleted(gpt2_graph: CostGraph, caplog) -> None:
    plan = _plan(gpt2_graph)
    cached = PartitionStore().cache_path(plan.key)
    cached.parent.mkdir(parents=True)
    _truncated(plan, cached)
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.hub"):
        resolved = resolve_partition(gpt2_graph, plan.key, lambda: plan)
    assert resolved.source == "computed"
    assert "refused the cached partition" in caplog.text
    assert "Delete the file so that the partition is recomputed." in caplog.text


def test_show_advises_writing_a_bad_file_again(gpt2_graph: CostGraph, tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    _truncated(_plan(gpt2_graph), path)
    assert cli.main(["show", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-ftpipe show: error: {path}: not valid JSON")
    assert f"write it again with `hf-ftpipe partition MODEL --gpus N ... -o {path}`" in error
    assert "Delete" not in error and error.count("\n") == 1


# -- JSON nested too deep --------------------------------------------------------------------


def test_json_nested_too_deep_is_refused_before_parsing(gpt2_graph: CostGraph, tmp_path: Path, capsys) -> None:
    # Before: a RecursionError, and `hf-ftpipe show` printed a traceback and exited with 1.
    path = tmp_path / "deep.json"
    path.write_text(TOO_DEEP)
    depth = "JSON nested 100000 levels deep, more than the 64 levels any file hf_ftpipe reads has"
    plan = _plan(gpt2_graph)
    with pytest.raises(PartitionFormatError) as error:
        resolve_partition(gpt2_graph, plan.key, _never, partition_file=str(path))
    assert str(error.value).startswith(f"{path}: {depth}") and "Or drop `partition_file`" in str(error.value)

    assert cli.main(["show", str(path)]) == 2
    error_line = capsys.readouterr().err
    assert error_line.startswith(f"hf-ftpipe show: error: {path}: {depth}") and error_line.count("\n") == 1

    with pytest.raises(ProfileError) as error:
        get_profile(str(path))
    assert str(error.value).startswith(f"GPU profile file '{path}': {depth}")
    # A real plan is far from the limit: it nests 4 levels.
    plan.to_json(tmp_path / "plan.json")
    assert Partition.from_json(tmp_path / "plan.json", expected_key=plan.key).to_dict() == plan.to_dict()


# -- tracing -----------------------------------------------------------------------------------


def _deberta(problem_type: str | None) -> transformers.PreTrainedModel:
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        problem_type=problem_type,
    )
    return transformers.DebertaV2ForSequenceClassification(config)


@pytest.mark.slow
def test_a_classifier_without_problem_type_is_told_to_set_it(capfd) -> None:
    # Before: the generic "replace data-dependent control flow" hint, after torch printed the
    # partial graph (~27 KB per print, twice per rank) to stderr.
    batch = tiny_batch("bert", 2)
    with pytest.raises(TraceError) as error:
        capture_model(_deberta(None), batch)
    message = str(error.value)
    assert message.startswith("cannot trace DebertaV2ForSequenceClassification: its forward branches on the values")
    assert "modeling_deberta_v2.py" in message and "label_index" in message
    assert 'model.config.problem_type = "single_label_classification"' in message
    assert "def forward" not in capfd.readouterr().err
    capture_model(_deberta("single_label_classification"), batch)  # the fix the message names
