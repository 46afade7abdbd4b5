"""Partition: which stage runs each op and which GPU runs each stage, as plain JSON-ready data.

A Partition is what partitioners return, what the PartitionStore caches and shares, and what the
runtime builds its stages from. It holds no model: only node names, indices, predicted costs and
the ``PartitionKey`` that says which model and setup it was planned for.

On disk (``to_json``)::

    {"format": "hf_ftpipe.partition", "format_version": 2,
     "partitioner": "seq-greedy", "key": {...}, "stage_device": [0, 1],
     "node_stage": {"linear": 0, "relu": 1, ...}, "predicted": {...} | null,
     "anchors": {...} | null, "versions": {"hf_ftpipe": ..., "torch": ..., "transformers": ...},
     "created_at": "2025-..." | null}

The key finds a plan by what it depends on (the model's class, structural config and weights,
the input shapes, the setup); ``anchors`` records the exact graph it was made on, so that a plan
made under another transformers release is re-anchored onto this one (`plan.reanchor`).

Loading checks everything (``from_json``): a file may come from another hf_ftpipe, another model
or the Hub, and a wrong plan must fail with a sentence, not deep inside the runtime. JSON only,
never pickle.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from hf_ftpipe.costmodel.prediction import Prediction
from hf_ftpipe.errors import PartitionFormatError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan._json import build, json_type, read_json
from hf_ftpipe.plan.anchors import GraphAnchors
from hf_ftpipe.plan.validate import index_problems

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Partition",
    "PartitionKey",
    "user_file_fix",
    "with_fix",
]

FORMAT_NAME = "hf_ftpipe.partition"
"""Value of the ``"format"`` field: tells a partition file from any other JSON file."""
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = (2,)
_GRAPH_KEYED_VERSION = 1
"""Files of format_version 1 keyed plans by a hash over every traced op, which changes with
transformers releases; they cannot be told apart from plans for another model, so they are refused
with the way to write them again."""


@dataclass(frozen=True, kw_only=True)
class PartitionKey:
    """What a partition was planned for. Two runs with equal keys can share one partition."""

    model_fingerprint: str
    """``CostGraph.fingerprint``: the model's class, structural config and weights' names and shapes
    (not the traced ops, which change across transformers releases: see ``Partition.anchors``)."""
    model_class: str
    """e.g. ``"T5ForConditionalGeneration"``; for messages and Hub listings."""
    input_shapes: dict[str, list[int]]
    """Shape of each tensor input of ONE micro-batch, e.g. ``{"input_ids": [8, 512]}``."""
    dtype: str
    """Compute dtype the costs were taken for, e.g. ``"bfloat16"``."""
    schedule: str
    """Pipeline schedule: ``"gpipe"``, ``"1f1b"``, ``"async"`` or ``"2bw"``."""
    num_microbatches: int
    gpu_profile: str
    """``GPUProfile.name``."""
    num_gpus: int
    """GPUs available to the plan (a plan may use fewer)."""

    # The dict field makes the generated hash fail; hash the canonical form instead.
    def __hash__(self) -> int:
        return hash(self.digest())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """16 hex digits of sha256 over the canonical JSON of the key: a stable cache file name."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @classmethod
    def from_graph(
        cls,
        graph: CostGraph,
        *,
        dtype: str,
        schedule: str,
        num_microbatches: int,
        gpu_profile: str,
        num_gpus: int,
    ) -> PartitionKey:
        """The key of ``graph`` (fingerprint, class, tensor input shapes) planned for this setup."""
        return cls(
            model_fingerprint=graph.fingerprint,
            model_class=graph.model_class,
            input_shapes=graph.input_shapes,
            dtype=dtype,
            schedule=schedule,
            num_microbatches=num_microbatches,
            gpu_profile=gpu_profile,
            num_gpus=num_gpus,
        )


def collect_versions() -> dict[str, str]:
    """Versions of hf_ftpipe, torch and (when installed) transformers, for the file's record."""
    versions: dict[str, str] = {}
    for package in ("hf_ftpipe", "torch", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            if package == "hf_ftpipe":
                import hf_ftpipe

                versions[package] = getattr(hf_ftpipe, "__version__", "unknown")
    return versions


@dataclass(kw_only=True)
class Partition:
    """A pipeline plan: op → stage, stage → GPU, and what the cost model predicts for it.

    Stage indices are a topological order of the stage graph (stage i only sends to stages > i);
    several stages may share a GPU, also non-adjacent ones (Mixed-Pipe). ``validate_partition``
    checks a plan against its graph.
    """

    node_stage: dict[str, int]
    """Every CostGraph node → its stage index (partitioners insert in execution order)."""
    stage_device: list[int]
    """Stage index → GPU (rank) index."""
    partitioner: str
    """Which algorithm made the plan, e.g. ``"seq-greedy"``."""
    key: PartitionKey
    predicted: Prediction | None = None
    anchors: GraphAnchors | None = None
    """The exact graph the plan was made on (``GraphAnchors.of``), recorded by every registered
    partitioner; None in a plan built by hand, which then serves only a graph with its op names."""
    versions: dict[str, str] = field(default_factory=collect_versions)
    format_version: int = FORMAT_VERSION
    created_at: str | None = None
    """ISO 8601 time of creation, when the partitioner records it."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def num_devices(self) -> int:
        """GPUs the plan uses: one more than the highest device index."""
        return max(self.stage_device, default=-1) + 1

    def stages_on(self, device: int) -> list[int]:
        """Stage indices that ``device`` runs, ascending."""
        return [s for s, d in enumerate(self.stage_device) if d == device]

    def nodes_of(self, stage: int) -> list[str]:
        """Nodes of ``stage``, in ``node_stage`` order."""
        return [node for node, s in self.node_stage.items() if s == stage]

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "partitioner": self.partitioner,
            "key": self.key.to_dict(),
            "stage_device": list(self.stage_device),
            "node_stage": dict(self.node_stage),
            "predicted": asdict(self.predicted) if self.predicted is not None else None,
            "anchors": asdict(self.anchors) if self.anchors is not None else None,
            "versions": dict(self.versions),
            "created_at": self.created_at,
        }

    def to_text(self) -> str:
        """The plan as JSON text: indented to read and diff, but for ``anchors``, whose long lists are
        written on one line at the end (a line per item would double a file's lines for nothing)."""
        data = self.to_dict()
        anchors = data.pop("anchors")
        text = json.dumps(data, indent=1, allow_nan=False)
        return f'{text[:-2]},\n "anchors": {json.dumps(anchors, separators=(",", ":"))}\n}}\n'

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` atomically (a reader never sees half a file)."""
        path = os.fspath(path)
        text = self.to_text()
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def from_dict(cls, data: object, *, source: str = "partition data") -> Partition:
        """Build a plan from parsed JSON, checking every field; errors begin with ``source``."""
        try:
            return _parse_partition(data)
        except PartitionFormatError as e:
            raise PartitionFormatError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike, expected_key: PartitionKey | None = None) -> Partition:
        """Read a plan written by ``to_json``; with ``expected_key``, refuse a plan for another
        model or setup (see ``check_key``)."""
        path = os.fspath(path)
        data = read_json(path)
        partition = cls.from_dict(data, source=path)
        if expected_key is not None:
            partition.check_key(expected_key, source=path)
        return partition

    # -- checks against the run ----------------------------------------------------------------

    def check_key(self, expected: PartitionKey, *, source: str = "partition") -> None:
        """Raise ``PartitionFormatError`` naming every field where the plan's key differs."""
        diffs = []
        for f in fields(PartitionKey):
            got, want = getattr(self.key, f.name), getattr(expected, f.name)
            if got != want:
                diffs.append(f"  {f.name}: file has {got!r}, expected {want!r}")
        if diffs:
            if self.key.num_gpus != expected.num_gpus:
                diffs.append(
                    f"To run this plan as it is, launch one process per GPU it was made for: "
                    f"`accelerate launch --num_processes {self.key.num_gpus} ...`."
                )
            raise PartitionFormatError(
                f"{source}: this partition was planned for another model or setup:\n" + "\n".join(diffs)
            )

    def check_matches(self, graph: CostGraph, *, source: str = "partition") -> None:
        """Raise ``PartitionFormatError`` if the plan's nodes are not exactly ``graph``'s nodes."""
        planned, traced = set(self.node_stage), set(graph.graph.nodes)
        if planned == traced:
            return
        missing = sorted(traced - planned)
        extra = sorted(planned - traced)
        lines = [f"{source}: the partition does not fit this model's graph ({len(traced)} ops):"]
        if missing:
            lines.append(f"  {len(missing)} ops of the model are in no stage, e.g. {missing[:5]}")
        if extra:
            lines.append(f"  {len(extra)} ops of the partition are not in the model, e.g. {extra[:5]}")
        lines.append("It was made for another model (or another version of it).")
        raise PartitionFormatError("\n".join(lines))


# -- what to do about a bad file ----------------------------------------------------------------


@contextmanager
def with_fix(fix: str) -> Iterator[None]:
    """Add ``fix`` to a `PartitionFormatError` raised inside the block.

    Reading and checking a plan (`Partition.from_json`, `check_key`, `check_matches`) says what is
    wrong with it; what to do depends on where the file came from, which only the caller knows: a
    cached file is deleted and recomputed, a file the user named is fixed or written again.
    """
    try:
        yield
    except PartitionFormatError as error:
        message = str(error)
        joined = f"{message}\n{fix}" if "\n" in message else f"{message.rstrip('.')}. {fix}"
        raise PartitionFormatError(joined) from error


def user_file_fix(path: str) -> str:
    """The advice for a bad plan file the user named (``partition_file``, ``hf-ftpipe show FILE``):
    deleting it, as for a cached file, would only lose it."""
    return f"Fix {path}, or write it again with `hf-ftpipe partition MODEL --gpus N ... -o {path}`."


# -- loading ----------------------------------------------------------------------------------


def _parse_partition(data: object) -> Partition:
    if not isinstance(data, dict):
        raise PartitionFormatError(f"not a partition file: expected a JSON object, got {json_type(data)}")
    if data.get("format") != FORMAT_NAME:
        found = f"is {data['format']!r}" if "format" in data else "is missing"
        raise PartitionFormatError(
            f"not a partition file: field 'format' {found}, expected {FORMAT_NAME!r} (is this some other JSON file?)"
        )
    version = data.get("format_version", MISSING)
    if version is MISSING:
        raise PartitionFormatError("missing field 'format_version'")
    if isinstance(version, bool) or not isinstance(version, int):
        raise PartitionFormatError(f"field 'format_version' should be int, got {json_type(version)} {version!r}")
    if version == _GRAPH_KEYED_VERSION:
        raise PartitionFormatError(
            "format_version 1 is not supported: such plans were keyed by the exact traced graph, which changes "
            "with transformers releases, and do not record the graph they were made on; hf_ftpipe now keys plans "
            "by the model's structure (format_version 2). Make the plan again"
        )
    if version not in SUPPORTED_FORMAT_VERSIONS:
        newer = version > max(SUPPORTED_FORMAT_VERSIONS)
        raise PartitionFormatError(
            f"format_version {version} is not supported; this hf_ftpipe reads versions "
            f"{list(SUPPORTED_FORMAT_VERSIONS)}. "
            + (
                "The file was written by a newer hf_ftpipe: upgrade (pip install -U hf_ftpipe)."
                if newer
                else "The file was written by an older hf_ftpipe."
            )
        )
    body = {k: v for k, v in data.items() if k != "format"}
    partition = build(Partition, body, "")
    _check_consistency(partition)
    return partition


def _check_consistency(p: Partition) -> None:
    """What a file can be checked for without the model's graph: the validator's index checks, and
    the key and prediction agreeing with the plan's size."""
    problems = index_problems(p)
    if p.anchors is not None:
        problems += p.anchors.problems()
        if not problems and set(p.anchors.nodes) != set(p.node_stage):
            problems.append("'anchors.nodes' and 'node_stage' name different ops; both list every op of the plan")
    for name in ("num_microbatches", "num_gpus"):
        if getattr(p.key, name) < 1:
            problems.append(f"field 'key.{name}' must be ≥ 1, got {getattr(p.key, name)}")
    if p.predicted is not None and not problems:
        if len(p.predicted.stages) != p.num_stages:
            problems.append(
                f"field 'predicted.stages' has {len(p.predicted.stages)} entries, expected one per stage "
                f"({p.num_stages})"
            )
        if len(p.predicted.gpus) != p.num_devices:
            problems.append(
                f"field 'predicted.gpus' has {len(p.predicted.gpus)} entries, expected one per GPU used "
                f"({p.num_devices})"
            )
    if problems:
        raise PartitionFormatError("; ".join(problems))
