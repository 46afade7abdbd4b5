"""GPUProfile: the few numbers of a device that the roofline cost model and the partitioner need.

A profile is plain data (JSON on disk) so that a partition can name the hardware it was planned
for and be shared: two users with the same model and the same profile get the same plan. The
built-ins carry datasheet values (see ``REFERENCE.md``, "GPUs"); measure when a device is at hand
and save the result with ``to_json``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Literal, get_args

from hf_ftpipe._json_depth import check_json_depth
from hf_ftpipe._strict_json import write_json
from hf_ftpipe._units import GiB
from hf_ftpipe.costmodel.checks import check_float, check_int, check_str
from hf_ftpipe.errors import ProfileError

__all__ = [
    "BUILTIN_PROFILES",
    "DType",
    "GPUProfile",
    "canonical_dtype",
    "detect_profile",
    "get_profile",
    "list_profiles",
    "match_device_name",
    "mixes_kinds",
    "profile_for_device",
]

DType = Literal["float32", "float16", "bfloat16"]
"""The dtypes a profile lists a peak for; every other dtype is costed at the ``float32`` peak."""

_DTYPES: tuple[str, ...] = get_args(DType)
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# A missing half-precision peak falls back along this chain (the next-slower kind of unit).
_FALLBACK = {"bfloat16": "float16", "float16": "float32"}
_JSON_VERSION = 1


def canonical_dtype(dtype: object) -> str:
    """``torch.float32``, ``"torch.float32"``, ``"fp32"`` → ``"float32"``; others pass through.

    Graph nodes store dtypes as ``str(torch.dtype)``; profiles key peaks by the bare name.
    """
    name = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True, kw_only=True)
class GPUProfile:
    """Per-device speeds and sizes of a set of identical devices, for the analytical cost model."""

    name: str
    """Profile name, e.g. ``"a100-80gb"``. Part of a partition's key: keep it stable."""
    count: int
    """Number of devices (pipeline ranks) available."""
    memory_bytes: int
    """Memory of ONE device in bytes. Built-ins use the capacity on the box read as GiB (as
    ``nvidia-smi`` reports it); leave headroom for the CUDA context when planning."""
    peak_flops: dict[str, float]
    """Peak FLOP/s of one device per dtype (keys among ``"float32"``, ``"float16"``,
    ``"bfloat16"``; ``"float32"`` is required). Dense tensor-core peaks, never sparse ones. A
    missing ``"bfloat16"`` uses the ``"float16"`` peak and a missing ``"float16"`` the
    ``"float32"`` one; GPUs without bf16 units (Turing, Volta) list bf16 at the fp32 peak."""
    memory_bandwidth_bytes_per_s: float
    """Device-memory bandwidth of one device (datasheet), bytes per second."""
    link_bandwidth_bytes_per_s: float
    """Bandwidth achieved per direction between two devices (PCIe, NVLink), bytes per second."""
    link_latency_s: float
    """Fixed cost of one point-to-point transfer (NCCL send/recv start-up), seconds."""
    compute_efficiency: float = 0.8
    """Fraction of ``peak_flops`` that large matrix products reach. Datasheet peaks are never
    achieved; 0.8 is what a bf16 matmul reached on the H100 lent to this project (~798 of 989
    TFLOP/s). It scales compute against communication, so it decides which transfers are hidden."""
    memory_efficiency: float = 0.9
    """Fraction of ``memory_bandwidth_bytes_per_s`` that streaming kernels reach (a device copy
    reached ~3.0 of 3.35 TB/s on the same H100)."""

    def __post_init__(self) -> None:
        check_str("name", self.name)
        check_int("count", self.count)
        check_int("memory_bytes", self.memory_bytes)
        if not isinstance(self.peak_flops, dict):
            raise ProfileError(
                f"`peak_flops` must be a dict of dtype name to FLOP/s, got "
                f"{type(self.peak_flops).__name__} {self.peak_flops!r}; write e.g. "
                '{"float32": 19.5e12, "float16": 312e12}'
            )
        unknown = sorted(set(self.peak_flops) - set(_DTYPES))
        if unknown:
            raise ProfileError(f"`peak_flops` has unknown dtype keys {unknown}; use only {list(_DTYPES)}")
        if "float32" not in self.peak_flops:
            raise ProfileError(
                f"`peak_flops` of profile {self.name!r} has no 'float32' entry "
                f"(got keys {sorted(self.peak_flops)}); add the fp32 peak, "
                "other dtypes fall back to it"
            )
        for key, value in self.peak_flops.items():
            check_float(f"peak_flops[{key!r}]", value)
        # Own a copy: the dataclass is frozen, a caller's dict must not change it afterwards.
        object.__setattr__(self, "peak_flops", {k: float(v) for k, v in self.peak_flops.items()})
        check_float("memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s)
        check_float("link_bandwidth_bytes_per_s", self.link_bandwidth_bytes_per_s)
        check_float("link_latency_s", self.link_latency_s, allow_zero=True)
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            check_float(name, value)
            if value > 1:
                raise ProfileError(
                    f"`{name}` is a fraction of the peak and must be in (0, 1], got {value!r}; "
                    "put the measured speed in the peak field instead"
                )

    def flops_per_s(self, dtype: object = "float32") -> float:
        """Peak FLOP/s for ``dtype``, falling back bf16 → fp16 → fp32 (other dtypes: fp32)."""
        key = canonical_dtype(dtype)
        if key not in _DTYPES:
            key = "float32"
        while key not in self.peak_flops:
            key = _FALLBACK[key]
        return self.peak_flops[key]

    def effective_flops_per_s(self, dtype: object = "float32") -> float:
        """FLOP/s the cost model assumes: the peak for ``dtype`` times ``compute_efficiency``."""
        return self.flops_per_s(dtype) * self.compute_efficiency

    @property
    def effective_memory_bandwidth_bytes_per_s(self) -> float:
        """Memory bandwidth the cost model assumes: the peak times ``memory_efficiency``."""
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency

    def with_count(self, count: int) -> GPUProfile:
        """The same device, ``count`` of them."""
        return replace(self, count=count)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; ``GPUProfile.from_dict(p.to_dict()) == p``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPUProfile:
        """Build and validate a profile from plain data (e.g. a parsed JSON file)."""
        if not isinstance(data, dict):
            raise ProfileError(
                f"a GPU profile must be a JSON object, got {type(data).__name__}; "
                f"see GPUProfile.to_dict() for the layout"
            )
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ProfileError(f"unknown GPU profile keys {unknown}; valid keys are {sorted(known)}")
        required = [name for name, f in known.items() if f.default is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ProfileError(f"GPU profile is missing the keys {missing}; all of {required} are required")
        values = dict(data)
        for name in ("count", "memory_bytes"):
            # JSON writers may emit 1.1e10 for an integer; accept a whole float.
            value = values[name]
            if isinstance(value, float) and value.is_integer():
                values[name] = int(value)
        return cls(**values)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (with a format version) to ``path``."""
        data = {"format_version": _JSON_VERSION, **self.to_dict()}
        write_json(path, data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GPUProfile:
        """Read a profile written by ``to_json`` (or by hand)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            check_json_depth(text, f"GPU profile file {os.fspath(path)!r}", ProfileError)
            data = json.loads(text)
        except OSError as e:
            raise ProfileError(f"cannot read GPU profile file {os.fspath(path)!r}: {e}") from e
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"GPU profile file {os.fspath(path)!r} is not valid JSON ({e}); "
                "write it with GPUProfile.to_json or fix the syntax"
            ) from e
        if isinstance(data, dict):
            version = data.pop("format_version", _JSON_VERSION)
            if version != _JSON_VERSION:
                raise ProfileError(
                    f"GPU profile file {os.fspath(path)!r} has format_version {version!r}, this "
                    f"hf_ftpipe reads version {_JSON_VERSION}; upgrade hf_ftpipe or "
                    "rewrite the file"
                )
        try:
            return cls.from_dict(data)
        except ProfileError as e:
            raise ProfileError(f"in GPU profile file {os.fspath(path)!r}: {e}") from e


def mixes_kinds(gpus: Sequence[GPUProfile] | None) -> bool:
    """Whether ``gpus`` (one profile per GPU, or ``None`` for GPUs all alike) holds more than one kind."""
    return gpus is not None and any(gpu != gpus[0] for gpu in gpus)


def _gpu(
    name: str, gib: int, fp32: float, fp16: float, bf16: float, mem_bw: float, link_bw: float, latency_s: float
) -> GPUProfile:
    return GPUProfile(
        name=name,
        count=1,
        memory_bytes=gib * GiB,
        peak_flops={"float32": fp32, "float16": fp16, "bfloat16": bf16},
        memory_bandwidth_bytes_per_s=mem_bw,
        link_bandwidth_bytes_per_s=link_bw,
        link_latency_s=latency_s,
    )


# Links: PCIe 3.0 x16 ~12 GB/s achieved per direction, PCIe 4.0 ~24; NVLink per direction.
# Latencies are the rough start-up of an NCCL send/recv: ~20 us over PCIe, ~10 us over NVLink.
_PCIE3, _PCIE4, _PCIE_LAT, _NVL_LAT = 12e9, 24e9, 20e-6, 10e-6

BUILTIN_PROFILES: dict[str, GPUProfile] = {
    p.name: p
    for p in (
        # Turing and Volta have no bf16 units: bf16 runs at the fp32 rate, not the fp16 one.
        _gpu("rtx2080ti", 11, 13.4e12, 108e12, 13.4e12, 616e9, _PCIE3, _PCIE_LAT),
        _gpu("v100-16gb", 16, 15.7e12, 125e12, 15.7e12, 900e9, 150e9, _NVL_LAT),
        _gpu("v100-32gb", 32, 15.7e12, 125e12, 15.7e12, 900e9, 150e9, _NVL_LAT),
        # fp32, not TF32 (156): PyTorch leaves TF32 matmul off by default.
        _gpu("a100-40gb", 40, 19.5e12, 312e12, 312e12, 1.555e12, 300e9, _NVL_LAT),
        _gpu("a100-80gb", 80, 19.5e12, 312e12, 312e12, 2.039e12, 300e9, _NVL_LAT),
        _gpu("h100", 80, 67e12, 990e12, 990e12, 3.35e12, 450e9, _NVL_LAT),
        _gpu("h200", 141, 67e12, 990e12, 990e12, 4.8e12, 450e9, _NVL_LAT),
        _gpu("l4", 24, 30e12, 121e12, 121e12, 300e9, _PCIE4, _PCIE_LAT),
        # GeForce: no NVLink assumed (the 3090 bridge is rare; the 4090 has none).
        _gpu("rtx3090", 24, 35.6e12, 71e12, 71e12, 936e9, _PCIE4, _PCIE_LAT),
        _gpu("rtx4090", 24, 82.6e12, 165e12, 165e12, 1.008e12, _PCIE4, _PCIE_LAT),
        # A modest host (8 cores with AVX2 FMA); fixed so that CPU plans are reproducible.
        # Without AMX, half precision is slower than fp32. Link: gloo over loopback TCP.
        GPUProfile(
            name="cpu",
            count=1,
            memory_bytes=16 * GiB,
            peak_flops={"float32": 0.5e12, "float16": 0.1e12, "bfloat16": 0.25e12},
            memory_bandwidth_bytes_per_s=20e9,
            link_bandwidth_bytes_per_s=5e9,
            link_latency_s=50e-6,
        ),
    )
}

# An unknown CUDA device: the slowest numbers of the table, so a plan errs on the safe side.
_GENERIC = _gpu("generic-cuda", 8, 13.4e12, 71e12, 71e12, 300e9, _PCIE3, _PCIE_LAT)

# How torch.cuda.get_device_name() spells each family ("NVIDIA A100-SXM4-80GB",
# "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 2080 Ti", "NVIDIA L4"), after _words().
_FAMILIES: dict[str, str] = {
    "rtx2080ti": r"\brtx 2080 ti\b",
    "v100-16gb": r"\bv100\b",
    "v100-32gb": r"\bv100\b",
    "a100-40gb": r"\ba100\b",
    "a100-80gb": r"\ba100\b",
    "h100": r"\bh100\b",
    "h200": r"\bh200\b",
    "l4": r"\bl4\b",
    "rtx3090": r"\brtx 3090\b",
    "rtx4090": r"\brtx 4090\b",
}


def _words(name: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", name.lower()))


def _key(name: str) -> str:
    """``"NVIDIA GeForce RTX 2080 Ti"`` → ``"rtx2080ti"``; ``"A100-80GB"`` → ``"a10080gb"``."""
    words = [w for w in _words(name).split() if w not in ("nvidia", "geforce", "tesla")]
    return "".join(words)


def list_profiles() -> list[GPUProfile]:
    """The built-in profiles, in table order."""
    return list(BUILTIN_PROFILES.values())


def get_profile(spec: str | os.PathLike | dict[str, Any] | GPUProfile, count: int | None = None) -> GPUProfile:
    """Resolve ``spec`` to a profile, with ``count`` devices when given.

    ``spec`` is a built-in name (any case and spacing: ``"RTX 2080 Ti"``, ``"A100-80GB"``),
    ``"auto"`` (see ``detect_profile``), a path to a JSON file, a dict, or a profile.
    """
    if isinstance(spec, GPUProfile):
        profile = spec
    elif isinstance(spec, dict):
        profile = GPUProfile.from_dict(spec)
    elif isinstance(spec, str) and spec.strip().lower() == "auto":
        return detect_profile(count)
    elif isinstance(spec, os.PathLike) or (isinstance(spec, str) and (spec.endswith(".json") or os.path.isfile(spec))):
        profile = GPUProfile.from_json(spec)
    elif isinstance(spec, str):
        by_key = {_key(name): p for name, p in BUILTIN_PROFILES.items()}
        if _key(spec) not in by_key:
            raise ProfileError(
                f"unknown GPU profile {spec!r}; use one of {sorted(BUILTIN_PROFILES)}, "
                "'auto', or a path to a JSON profile file"
            )
        profile = by_key[_key(spec)]
    else:
        raise ProfileError(
            f"`spec` must be a profile name, 'auto', a JSON path, a dict or a GPUProfile, got {type(spec).__name__}"
        )
    return profile if count is None else profile.with_count(count)


def match_device_name(device_name: str, memory_bytes: int) -> GPUProfile | None:
    """The built-in for a CUDA device name; the memory variant nearest ``memory_bytes`` wins."""
    words = _words(device_name)
    candidates = [BUILTIN_PROFILES[name] for name, pattern in _FAMILIES.items() if re.search(pattern, words)]
    if not candidates:
        return None
    return min(candidates, key=lambda p: abs(p.memory_bytes - memory_bytes))


def detect_profile(count: int | None = None) -> GPUProfile:
    """Profile of the visible devices: speeds of the matching built-in, measured memory and count.

    Without CUDA this is the ``cpu`` profile with ``count`` devices (1 by default): CPU ranks run
    the same plan over gloo. Mixed GPUs are planned as the first one with the smallest memory.
    """
    import torch  # late: the rest of the module is plain data and should import instantly

    if not torch.cuda.is_available():
        return BUILTIN_PROFILES["cpu"].with_count(count or 1)
    num_devices = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(num_devices)]
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(num_devices))
    if len(set(names)) > 1:
        warnings.warn(
            f"devices differ ({sorted(set(names))}); planning for {names[0]!r} with the smallest "
            f"memory ({memory} bytes). Pass a JSON profile to plan for something else.",
            stacklevel=2,
        )
    base = profile_for_device(names[0], memory)
    return base.with_count(count or num_devices)


def profile_for_device(device_name: str, memory_bytes: int) -> GPUProfile:
    """One device's profile from its CUDA name (``torch.cuda.get_device_name``) and memory: the
    matching built-in's speeds with the measured memory, else conservative generic speeds (warned)."""
    base = match_device_name(device_name, memory_bytes)
    if base is None:
        warnings.warn(
            f"no built-in GPU profile matches {device_name!r}; using conservative generic speeds "
            f"(fp32 {_GENERIC.peak_flops['float32']:.3g} FLOP/s, PCIe 3.0 links). "
            "For a better plan "
            "write a profile with GPUProfile.to_json and pass its path.",
            stacklevel=3,
        )
        base = replace(_GENERIC, name=f"generic-{_key(device_name) or 'cuda'}")
    return replace(base, count=1, memory_bytes=memory_bytes)
