"""Partition JSON: round trips, and every way a file can be wrong fails with a sentence."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from hf_ftpipe.errors import PartitionFormatError
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition, PartitionKey
from hf_ftpipe.plan import _json as json_module

from toy_graphs import UNIT, chain


def _plan() -> Partition:
    graph = chain([3, 1, 4, 1, 5, 9])
    return partition_seq_greedy(graph, UNIT, 3, num_microbatches=4, microbatch_size=2)


def _write(tmp_path, data) -> str:
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _load_error(tmp_path, data, **kwargs) -> str:
    path = _write(tmp_path, data)
    with pytest.raises(PartitionFormatError) as info:
        Partition.from_json(path, **kwargs)
    message = str(info.value)
    assert message.startswith(path), message
    return message


def test_key_digest_is_stable_short_hex_and_changes_with_any_field():
    key = _plan().key
    assert key.digest() == PartitionKey(**key.to_dict()).digest()
    assert re.fullmatch("[0-9a-f]{16}", key.digest()), key.digest()  # a file name on every OS
    assert replace(key, num_microbatches=8).digest() != key.digest()
    assert replace(key, input_shapes={"input_ids": [2, 9]}).digest() != key.digest()
    assert len({key, PartitionKey(**key.to_dict())}) == 1  # hashable despite the dict field


def test_json_round_trip_is_equal(tmp_path):
    partition = _plan()
    path = tmp_path / "p.json"
    partition.to_json(path)
    assert Partition.from_json(path, expected_key=partition.key) == partition
    assert Partition.from_dict(json.loads(json.dumps(partition.to_dict()))) == partition
    assert json.loads(path.read_text())["format"] == "hf_ftpipe.partition"


def test_properties():
    partition = _plan()
    assert (partition.num_stages, partition.num_devices) == (3, 3)
    assert partition.stages_on(1) == [1]
    assert sum(len(partition.nodes_of(s)) for s in range(3)) == 6
    assert "torch" in partition.versions and "hf_ftpipe" in partition.versions
    mixed = replace(partition, stage_device=[0, 1, 0])
    assert mixed.num_devices == 2 and mixed.stages_on(0) == [0, 2]


def test_truncated_file(tmp_path):
    text = json.dumps(_plan().to_dict(), indent=1)
    message = _load_error(tmp_path, text[: len(text) // 2])
    assert "not valid JSON" in message and "truncated" in message


def test_empty_file(tmp_path):
    assert "truncated" in _load_error(tmp_path, "")


def test_not_json(tmp_path):
    message = _load_error(tmp_path, "node_stage: {a: 1}\nmore text")
    assert "not valid JSON" in message and "line 1" in message


def test_not_utf8(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PartitionFormatError, match="UTF-8"):
        Partition.from_json(path)


def test_not_an_object(tmp_path):
    assert "expected a JSON object, got array" in _load_error(tmp_path, [1, 2])


def test_foreign_json(tmp_path):
    message = _load_error(tmp_path, {"model_type": "t5", "d_model": 512})
    assert "not a partition file" in message and "'format' is missing" in message
    message = _load_error(tmp_path, {"format": "hf_ftpipe.gpu_profile"})
    assert "'hf_ftpipe.gpu_profile'" in message


@pytest.mark.parametrize(
    "path, field",
    [
        (("partitioner",), "'partitioner'"),
        (("key", "dtype"), "'key.dtype'"),
        (("format_version",), "'format_version'"),
    ],
)
def test_missing_field(tmp_path, path, field):
    data = _plan().to_dict()
    target = data
    for name in path[:-1]:
        target = target[name]
    del target[path[-1]]
    assert f"missing field {field}" in _load_error(tmp_path, data)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda d: d.update(stage_device="0,1,2"),
            "field 'stage_device' should be list[int], got string '0,1,2'",
        ),
        (
            lambda d: d["stage_device"].__setitem__(1, 1.0),
            "field 'stage_device[1]' should be int, got float 1.0",
        ),
        (
            lambda d: d["node_stage"].__setitem__("n2", "1"),
            "field 'node_stage['n2']' should be int, got string '1'",
        ),
        (
            lambda d: d["node_stage"].__setitem__("n2", True),
            "field 'node_stage['n2']' should be int, got bool",
        ),
        (
            lambda d: d["key"].__setitem__("num_microbatches", "4"),
            "field 'key.num_microbatches' should be int",
        ),
        (lambda d: d.update(key=[1]), "field 'key' should be an object, got array"),
        (
            lambda d: d["predicted"]["stages"][0].__setitem__("forward_s", None),
            "'predicted.stages[0].forward_s' should be float, got null",
        ),
        (lambda d: d.update(format_version="1"), "'format_version' should be int, got string"),
    ],
)
def test_wrong_type(tmp_path, edit, expected):
    data = _plan().to_dict()
    edit(data)
    assert expected in _load_error(tmp_path, data)


def test_int_is_accepted_for_float(tmp_path):
    data = _plan().to_dict()
    data["predicted"]["step_time_s"] = 3
    assert Partition.from_json(_write(tmp_path, data)).predicted.step_time_s == 3.0


def test_unknown_field(tmp_path):
    data = _plan().to_dict()
    data["key"]["seed"] = 0
    assert "unknown fields ['key.seed']" in _load_error(tmp_path, data)


def test_future_format_version(tmp_path):
    data = _plan().to_dict()
    data["format_version"] = 3
    message = _load_error(tmp_path, data)
    assert "format_version 3" in message and "[2]" in message
    assert "newer hf_ftpipe" in message and "upgrade" in message


def test_graph_keyed_format_version_1_says_to_make_the_plan_again(tmp_path):
    data = _plan().to_dict()
    data["format_version"] = 1
    del data["anchors"]
    message = _load_error(tmp_path, data)
    assert "format_version 1 is not supported" in message and "exact traced graph" in message
    assert "Make the plan again" in message


def test_stage_index_out_of_range(tmp_path):
    data = _plan().to_dict()
    data["node_stage"]["n0"] = 3
    message = _load_error(tmp_path, data)
    assert "'node_stage'" in message and "0..2" in message and "'n0': 3" in message


def test_device_beyond_num_gpus(tmp_path):
    data = _plan().to_dict()
    data["stage_device"][2] = 7
    assert "outside 0..3" in _load_error(tmp_path, data)


def test_predicted_must_match_stage_count(tmp_path):
    data = _plan().to_dict()
    data["predicted"]["stages"].pop()
    assert "'predicted.stages' has 2 entries" in _load_error(tmp_path, data)


def test_duplicate_keys_and_nan(tmp_path):
    assert "repeats the keys ['a']" in _load_error(tmp_path, '{"a": 1, "a": 2}')
    text = json.dumps(_plan().to_dict()).replace('"step_time_s": ', '"step_time_s": NaN, "x": ', 1)
    assert "NaN" in _load_error(tmp_path, text)


def test_file_too_large(tmp_path, monkeypatch):
    monkeypatch.setattr(json_module, "MAX_FILE_BYTES", 100)
    assert "more than the 100 bytes" in _load_error(tmp_path, _plan().to_dict())


def test_missing_file(tmp_path):
    with pytest.raises(PartitionFormatError, match="cannot read"):
        Partition.from_json(tmp_path / "absent.json")


def test_key_mismatch_names_each_field(tmp_path):
    partition = _plan()
    path = tmp_path / "p.json"
    partition.to_json(path)
    expected = replace(partition.key, model_fingerprint="other", num_microbatches=8)
    with pytest.raises(PartitionFormatError) as info:
        Partition.from_json(path, expected_key=expected)
    message = str(info.value)
    assert message.startswith(str(path))
    assert "model_fingerprint: file has 'toy-fingerprint', expected 'other'" in message
    assert "num_microbatches: file has 4, expected 8" in message
    assert "dtype" not in message
    # What to do depends on where the file came from: the caller adds it (see `with_fix`).
    assert "Delete the file" not in message and "partition_file" not in message


def test_check_matches_another_graph():
    partition = _plan()
    partition.check_matches(chain([1] * 6))  # same node names
    other = chain([1] * 9)
    with pytest.raises(PartitionFormatError) as info:
        partition.check_matches(other, source="cache/x.json")
    message = str(info.value)
    assert message.startswith("cache/x.json")
    assert "3 ops of the model are in no stage" in message and "'n6'" in message
    with pytest.raises(PartitionFormatError, match=r"2 ops of the partition are not in .*'n4'"):
        partition.check_matches(chain([1] * 4))
