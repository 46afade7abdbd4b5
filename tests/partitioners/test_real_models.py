"""Partitions of real (tiny) transformers models: made, saved, and refused for another model."""

import functools
from pathlib import Path

import pytest

from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.errors import PartitionFormatError
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition, PartitionKey, validate_partition

from tiny_captures import tiny_graph


@functools.cache
def make(kind: str) -> tuple:
    """The tiny ``kind``'s graph (`tiny_captures`) planned, once per session (the tests only read them)."""
    graph = tiny_graph(kind)
    partition = partition_seq_greedy(graph, get_profile("cpu", count=2), num_microbatches=2, microbatch_size=2)
    return graph, partition


def test_seq_greedy_plan_of_a_real_model_validates_and_round_trips(tmp_path: Path) -> None:
    graph, partition = make("t5")
    validate_partition(partition, graph)
    path = tmp_path / "plan.json"
    partition.to_json(path)
    loaded = Partition.from_json(path, expected_key=partition.key)
    assert loaded.node_stage == partition.node_stage and loaded.stage_device == [0, 1]
    loaded.check_matches(graph)


def test_plan_made_for_another_model_is_refused_with_the_field_named(tmp_path: Path) -> None:
    _, gpt2_partition = make("gpt2")
    t5_graph, t5_partition = make("t5")
    path = tmp_path / "gpt2-plan.json"
    gpt2_partition.to_json(path)
    with pytest.raises(PartitionFormatError) as error:
        Partition.from_json(path, expected_key=t5_partition.key)
    assert "model_fingerprint" in str(error.value) and str(path) in str(error.value)
    with pytest.raises(PartitionFormatError, match="are in no stage"):
        Partition.from_json(path).check_matches(t5_graph, source=str(path))


def test_plan_for_other_input_shapes_is_refused(tmp_path: Path) -> None:
    graph, partition = make("gpt2")
    longer = tiny_graph("gpt2", batch_size=4)
    expected = PartitionKey.from_graph(
        longer, dtype=partition.key.dtype, schedule="gpipe", num_microbatches=2, gpu_profile="cpu", num_gpus=2
    )
    path = tmp_path / "plan.json"
    partition.to_json(path)
    with pytest.raises(PartitionFormatError, match="input_shapes"):
        Partition.from_json(path, expected_key=expected)


def test_truncated_plan_file_is_refused(tmp_path: Path) -> None:
    _, partition = make("gpt2")
    path = tmp_path / "plan.json"
    partition.to_json(path)
    path.write_text(path.read_text()[:200])
    with pytest.raises(PartitionFormatError, match=str(path)):
        Partition.from_json(path)
