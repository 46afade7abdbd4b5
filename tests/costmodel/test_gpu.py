"""GPUProfile: datasheet built-ins, name lookup, JSON round trip, validation, detection."""

import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.costmodel import (
    BUILTIN_PROFILES,
    GPUProfile,
    canonical_dtype,
    detect_profile,
    get_profile,
    list_profiles,
    match_device_name,
)
from hf_ftpipe.errors import ProfileError

GiB = 2**30

# name: (memory GiB, fp32 FLOP/s, fp16 FLOP/s, memory B/s, link B/s) — REFERENCE.md, "GPUs".
DATASHEET = {
    "rtx2080ti": (11, 13.4e12, 108e12, 616e9, 12e9),
    "v100-16gb": (16, 15.7e12, 125e12, 900e9, 150e9),
    "v100-32gb": (32, 15.7e12, 125e12, 900e9, 150e9),
    "a100-40gb": (40, 19.5e12, 312e12, 1.555e12, 300e9),
    "a100-80gb": (80, 19.5e12, 312e12, 2.039e12, 300e9),
    "h100": (80, 67e12, 990e12, 3.35e12, 450e9),
    "l4": (24, 30e12, 121e12, 300e9, 24e9),
    "rtx3090": (24, 35.6e12, 71e12, 936e9, 24e9),
    "rtx4090": (24, 82.6e12, 165e12, 1.008e12, 24e9),
}


def small_profile(**overrides) -> dict:
    data = {
        "name": "toy",
        "count": 2,
        "memory_bytes": 8 * GiB,
        "peak_flops": {"float32": 10e12, "float16": 40e12},
        "memory_bandwidth_bytes_per_s": 500e9,
        "link_bandwidth_bytes_per_s": 16e9,
        "link_latency_s": 1e-5,
    }
    data.update(overrides)
    return data


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_builtin_matches_datasheet(name):
    memory_gib, fp32, fp16, memory_bw, link_bw = DATASHEET[name]
    profile = BUILTIN_PROFILES[name]
    assert profile.name == name
    assert profile.count == 1
    assert profile.memory_bytes == memory_gib * GiB
    assert profile.peak_flops["float32"] == fp32
    assert profile.peak_flops["float16"] == fp16
    assert profile.memory_bandwidth_bytes_per_s == memory_bw
    assert profile.link_bandwidth_bytes_per_s == link_bw


def test_bf16_runs_at_fp32_rate_on_gpus_without_bf16_units():
    for name in ("rtx2080ti", "v100-16gb", "v100-32gb"):
        assert BUILTIN_PROFILES[name].flops_per_s("bfloat16") == DATASHEET[name][1]
    assert BUILTIN_PROFILES["h100"].flops_per_s("torch.bfloat16") == 990e12


def test_list_profiles_has_every_builtin_and_cpu():
    names = [p.name for p in list_profiles()]
    assert set(DATASHEET) | {"cpu"} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("RTX 2080 Ti", "rtx2080ti"),
        ("A100-80GB", "a100-80gb"),
        ("a100_40gb", "a100-40gb"),
        ("H100", "h100"),
        ("NVIDIA L4", "l4"),
        ("GeForce RTX 4090", "rtx4090"),
        ("CPU", "cpu"),
    ],
)
def test_get_profile_accepts_spellings(spec, expected):
    assert get_profile(spec) == BUILTIN_PROFILES[expected]


def test_get_profile_count_overrides_without_touching_builtin():
    profile = get_profile("v100-32gb", count=8)
    assert profile.count == 8
    assert BUILTIN_PROFILES["v100-32gb"].count == 1
    assert profile.with_count(1) == BUILTIN_PROFILES["v100-32gb"]


def test_unknown_name_lists_valid_names():
    with pytest.raises(ProfileError) as info:
        get_profile("tpu-v5")
    message = str(info.value)
    assert "'tpu-v5'" in message
    for name in ("rtx2080ti", "a100-80gb", "h100", "cpu", "auto"):
        assert name in message


def test_dict_round_trip():
    profile = BUILTIN_PROFILES["a100-80gb"].with_count(4)
    assert GPUProfile.from_dict(profile.to_dict()) == profile
    assert get_profile(profile.to_dict()) == profile


def test_json_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    profile = GPUProfile.from_dict(small_profile(compute_efficiency=0.5))
    profile.to_json(path)
    assert json.loads(path.read_text())["format_version"] == 1
    assert GPUProfile.from_json(path) == profile
    assert get_profile(path) == profile
    assert get_profile(str(path), count=3) == profile.with_count(3)


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 1024),
    memory_bytes=st.integers(1, 2**50),
    fp32=st.floats(1e6, 1e18),
    bandwidth=st.floats(1e6, 1e15),
    latency=st.floats(0, 1),
)
def test_dict_round_trip_any_valid_values(count, memory_bytes, fp32, bandwidth, latency):
    profile = GPUProfile.from_dict(
        small_profile(
            count=count,
            memory_bytes=memory_bytes,
            peak_flops={"float32": fp32},
            memory_bandwidth_bytes_per_s=bandwidth,
            link_latency_s=latency,
        )
    )
    assert GPUProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_whole_float_memory_is_accepted_from_json():
    assert GPUProfile.from_dict(small_profile(memory_bytes=1.1e10)).memory_bytes == 11_000_000_000


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",')
    with pytest.raises(ProfileError, match="not valid JSON") as info:
        GPUProfile.from_json(path)
    assert "broken.json" in str(info.value)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ProfileError, match="cannot read GPU profile file .*nope.json"):
        get_profile(tmp_path / "nope.json")


def test_unknown_key_names_it_and_the_valid_keys():
    with pytest.raises(ProfileError) as info:
        GPUProfile.from_dict(small_profile(memory_gb=16))
    message = str(info.value)
    assert "'memory_gb'" in message and "memory_bytes" in message


def test_missing_key_is_named():
    data = small_profile()
    del data["link_latency_s"]
    with pytest.raises(ProfileError, match="missing the keys \\['link_latency_s'\\]"):
        GPUProfile.from_dict(data)


def test_negative_memory_names_field_and_value(tmp_path):
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(small_profile(memory_bytes=-1)))
    with pytest.raises(ProfileError) as info:
        get_profile(path)
    message = str(info.value)
    assert "`memory_bytes`" in message and "-1" in message and "neg.json" in message


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ({"count": "4"}, ["`count`", "'4'", "integer"]),
        ({"count": True}, ["`count`", "True"]),
        ({"count": 0}, ["`count`", "0", "positive"]),
        ({"memory_bandwidth_bytes_per_s": 0}, ["`memory_bandwidth_bytes_per_s`", "> 0"]),
        ({"link_latency_s": -1e-6}, ["`link_latency_s`", "-1e-06"]),
        ({"link_bandwidth_bytes_per_s": float("inf")}, ["`link_bandwidth_bytes_per_s`", "inf"]),
        ({"peak_flops": {"float16": 1e12}}, ["'float32'", "peak_flops"]),
        ({"peak_flops": {"float32": 1e12, "int8": 1e15}}, ["'int8'", "float16", "bfloat16"]),
        ({"peak_flops": {"float32": -5.0}}, ["peak_flops['float32']", "-5.0"]),
        ({"peak_flops": [1e12]}, ["`peak_flops`", "list"]),
        ({"compute_efficiency": 1.5}, ["`compute_efficiency`", "1.5", "(0, 1]"]),
        ({"name": ""}, ["`name`"]),
    ],
)
def test_invalid_values_are_named(overrides, needles):
    with pytest.raises(ProfileError) as info:
        GPUProfile.from_dict(small_profile(**overrides))
    for needle in needles:
        assert needle in str(info.value)


def test_foreign_format_version_is_rejected(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"format_version": 2, **small_profile()}))
    with pytest.raises(ProfileError, match="format_version 2"):
        GPUProfile.from_json(path)


def test_non_object_json_is_rejected(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="must be a JSON object, got list"):
        get_profile(path)


def test_peak_fallbacks():
    profile = GPUProfile.from_dict(small_profile())  # no bfloat16 entry
    assert profile.flops_per_s("bfloat16") == 40e12  # falls back to fp16
    assert profile.flops_per_s("torch.int64") == 10e12  # not listed: fp32
    fp32_only = GPUProfile.from_dict(small_profile(peak_flops={"float32": 3e12}))
    assert fp32_only.flops_per_s("float16") == fp32_only.flops_per_s("bfloat16") == 3e12
    assert profile.effective_flops_per_s("float16") == 40e12 * profile.compute_efficiency


def test_profile_owns_its_peak_dict():
    peaks = {"float32": 1e12}
    profile = GPUProfile.from_dict(small_profile(peak_flops=peaks))
    peaks["float32"] = 2e12
    assert profile.peak_flops["float32"] == 1e12


@pytest.mark.parametrize(
    "raw, expected",
    [
        (torch.float32, "float32"),
        ("torch.bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("float", "float32"),
        ("torch.int64", "int64"),
    ],
)
def test_canonical_dtype(raw, expected):
    assert canonical_dtype(raw) == expected


def test_detect_without_cuda_is_cpu():
    assert not torch.cuda.is_available()
    assert detect_profile() == BUILTIN_PROFILES["cpu"]
    assert detect_profile(4).count == 4
    assert get_profile("auto", count=2) == BUILTIN_PROFILES["cpu"].with_count(2)


@pytest.mark.parametrize(
    "device_name, memory_gib, expected",
    [
        ("NVIDIA A100-SXM4-80GB", 80, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
        ("Tesla V100-SXM2-16GB", 15.8, "v100-16gb"),
        ("NVIDIA H100 80GB HBM3", 79.2, "h100"),
        ("NVIDIA GeForce RTX 2080 Ti", 10.7, "rtx2080ti"),
        ("NVIDIA L4", 22, "l4"),
        ("NVIDIA L40S", 45, None),
        ("NVIDIA GeForce RTX 2080", 8, None),
    ],
)
def test_match_device_name(device_name, memory_gib, expected):
    match = match_device_name(device_name, int(memory_gib * GiB))
    assert (match.name if match else None) == expected


class _Props:
    def __init__(self, total_memory):
        self.total_memory = total_memory


def _fake_cuda(monkeypatch, names, memory):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: _Props(memory))


def test_detect_known_gpu_keeps_measured_memory_and_count(monkeypatch):
    memory = 85_029_158_912  # what torch reports on an H100 80GB HBM3
    _fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 2, memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = detect_profile()
    h100 = BUILTIN_PROFILES["h100"]
    assert (profile.name, profile.count, profile.memory_bytes) == ("h100", 2, memory)
    assert profile.peak_flops == h100.peak_flops
    assert profile.link_bandwidth_bytes_per_s == h100.link_bandwidth_bytes_per_s


def test_detect_unknown_gpu_warns_and_is_conservative(monkeypatch):
    _fake_cuda(monkeypatch, ["NVIDIA RTX A6000"], 48 * GiB)
    with pytest.warns(UserWarning, match="no built-in GPU profile matches 'NVIDIA RTX A6000'"):
        profile = detect_profile()
    assert profile.name == "generic-rtxa6000"
    assert profile.memory_bytes == 48 * GiB and profile.count == 1
    slowest_fp32 = min(p.peak_flops["float32"] for p in list_profiles() if p.name != "cpu")
    assert profile.peak_flops["float32"] <= slowest_fp32
