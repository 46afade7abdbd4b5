"""Measured costs: each block's forward and backward time on a real device, as a validated JSON table.

The roofline (`op_time.node_costs`) prices an op from datasheet peaks; FTPipe profiled on its GPUs
and PipeDream's planner works from measured layer times. A `CostTable` holds the times
``hf_ftpipe.runtime.block_timing.time_blocks`` measured for the blocks of one traced graph (a
layer of a repeated type, or a run of the ops between layers), and hands them out in the form every
consumer already takes, ``Mapping[str, NodeCost]``: a block's measured time split over its ops in
proportion to their roofline times (the split is recorded when the table is made, so the table
alone prices any plan of that graph, as ``hf-ftpipe show --costs`` does). Partitioners, `estimate`
and the simulator take it with no other change.

A table is keyed like a plan (model fingerprint, the graph's digest, input shapes, dtype, device)
and refused for anything else, with the field, the values and the fix. Pure data: no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hf_ftpipe import _strict_json
from hf_ftpipe._cache import cache_root
from hf_ftpipe.costmodel.memory_rules import defers_weight_gradient
from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import CostTableError

if TYPE_CHECKING:  # only read here; importing hf_ftpipe.graph at runtime pulls in torch
    from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "BlockTime", "CostKey", "CostTable", "Timings", "cache_path"]

FORMAT_NAME = "hf_ftpipe.cost_table"
"""Value of the ``"format"`` field: tells a cost table from any other JSON file."""
FORMAT_VERSION = 1
MAX_FILE_BYTES = 64 * 2**20
"""A table holds two shares per op: a T5-3B graph's is a few MB."""
_REPROFILE = "profile the model again for this setup (hf-ftpipe profile MODEL ...) or pass the table made for it"


@dataclass(frozen=True, kw_only=True)
class CostKey:
    """What a table was measured for; it prices only a graph with the same key."""

    model_fingerprint: str
    """``CostGraph.fingerprint``: the model's class, structural config and weight shapes."""
    graph_digest: str
    """``CostGraph.digest``: this exact graph, op by op (node names differ across transformers releases)."""
    model_class: str
    """e.g. ``"GPT2LMHeadModel"``; for messages."""
    input_shapes: dict[str, list[int]]
    """Shape of each tensor input of one micro-batch, as in ``PartitionKey``."""
    dtype: str
    """Compute dtype the blocks ran in, e.g. ``"bfloat16"`` (under autocast when the weights differ)."""
    device: str
    """The device the blocks ran on, e.g. ``"NVIDIA H100 80GB HBM3"`` or ``"cpu"``; for messages."""

    @classmethod
    def of(cls, graph: CostGraph, *, dtype: str, device: str) -> CostKey:
        return cls(
            model_fingerprint=graph.fingerprint,
            graph_digest=graph.digest,
            model_class=graph.model_class,
            input_shapes=graph.input_shapes,
            dtype=dtype,
            device=device,
        )

    def digest(self) -> str:
        """16 hex digits of sha256 over the canonical JSON of the key: the cache file's name."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class BlockTime:
    """One block of the graph and its measured time for one micro-batch."""

    name: str
    """The layer's module path (``"transformer.h.3"``) or, between layers, the first op's scope."""
    nodes: list[str]
    """The block's ops, in execution order."""
    forward_s: float
    backward_s: float
    """Backward time, seconds (0 for a block outside the backward graph)."""
    timed_as: str = ""
    """The block whose timing this one reuses (same ops, shapes and parameters); ``""``: timed itself."""


class _Timed(Protocol):
    name: str
    nodes: Sequence[str]
    forward_s: float
    backward_s: float
    timed_as: str
    weight_s: float
    """The part of ``backward_s`` in the products' weight gradients (a split backward's ``W``); 0: not timed."""


class Timings(Protocol):
    """What ``hf_ftpipe.runtime.block_timing.time_blocks`` returns (plain data: the runtime does not
    import the cost model)."""

    blocks: Sequence[_Timed]
    dtype: str
    device: str
    warmup: int
    repeats: int


@dataclass(frozen=True, kw_only=True)
class CostTable:
    """Measured forward and backward time of every block of one traced graph (see the module docstring)."""

    key: CostKey
    blocks: list[BlockTime]
    shares: dict[str, list[float]]
    """Every op → ``[forward share, backward share]`` of its block's measured time: its share of the
    block's roofline time, so each block's add up to 1; in the backward, the products that defer
    their weight gradients (`defers_weight_gradient`) share twice the block's measured ``W`` where it
    was timed, the other ops the rest (see `from_timings`)."""
    repeats: int
    """Timed runs per block (the median is kept), after ``warmup`` untimed ones."""
    warmup: int
    info: dict[str, str] = field(default_factory=dict)
    """Versions (torch, transformers, hf_ftpipe) and anything else worth reading; never checked."""

    def __post_init__(self) -> None:
        problems = [
            f"field 'blocks[{i}].{name}' must be a finite number ≥ 0, got {value!r}"
            for i, block in enumerate(self.blocks)
            for name, value in (("forward_s", block.forward_s), ("backward_s", block.backward_s))
            if not (math.isfinite(value) and value >= 0)
        ]
        problems += [
            f"field 'shares[{node!r}]' must be two finite numbers in [0, 1], got {share!r}"
            for node, share in self.shares.items()
            if len(share) != 2 or not all(math.isfinite(x) and 0 <= x <= 1 for x in share)
        ]
        if self.repeats < 1 or self.warmup < 0:
            problems.append(f"fields 'repeats' ≥ 1 and 'warmup' ≥ 0, got {self.repeats} and {self.warmup}")
        in_blocks = [n for block in self.blocks for n in block.nodes]
        if len(set(in_blocks)) != len(in_blocks):
            twice = sorted({n for n in in_blocks if in_blocks.count(n) > 1})
            problems.append(f"ops {twice[:5]} are in more than one block")
        if set(in_blocks) != set(self.shares):
            problems.append(
                f"'blocks' and 'shares' name different ops ({len(set(in_blocks) ^ set(self.shares))} differ, "
                f"e.g. {sorted(set(in_blocks) ^ set(self.shares))[:3]})"
            )
        if problems:
            raise CostTableError("; ".join(problems))

    @classmethod
    def from_timings(
        cls, graph: CostGraph, timings: Timings, profile: GPUProfile, info: dict[str, str] | None = None
    ) -> CostTable:
        """The table of ``timings`` of ``graph``'s blocks; each op's share of its block is its share of
        the block's roofline time on ``profile`` (the local device's: only ratios within a block matter),
        equal shares where the roofline gives the block none.

        The backward is shared in two groups where the block's ``W`` was timed (``weight_s``): the
        products that defer their weight gradients take twice ``W`` (a product's backward is two
        equal matrix products, its input's gradient and its weight's: the simulator's ``W`` is half
        of it, `hf_ftpipe.simulator.pipeline_costs`, so it prices the ``W`` measured), the other ops
        the rest, each group by the roofline. The roofline alone gave GPT-2's products on one CPU
        thread half the share they took: it prices a matrix product at a peak the CPU does not reach.
        """
        roofline = node_costs(graph, profile, timings.dtype)
        shares = {}
        for block in timings.blocks:
            forward = math.fsum(roofline[n].forward_s for n in block.nodes)
            backward = _backward_shares(graph, block, {n: roofline[n].backward_s for n in block.nodes})
            for n in block.nodes:
                shares[n] = [roofline[n].forward_s / forward if forward > 0 else 1.0 / len(block.nodes), backward[n]]
        return cls(
            key=CostKey.of(graph, dtype=timings.dtype, device=timings.device),
            blocks=[BlockTime(b.name, list(b.nodes), b.forward_s, b.backward_s, b.timed_as) for b in timings.blocks],
            shares=shares,
            repeats=timings.repeats,
            warmup=timings.warmup,
            info=dict(info or {}),
        )

    @property
    def num_timed(self) -> int:
        """Blocks that were run (the rest reuse a repeat's time)."""
        return sum(1 for block in self.blocks if not block.timed_as)

    def node_costs(self, graph: CostGraph | None = None) -> dict[str, NodeCost]:
        """Every op → its `NodeCost`: its block's measured time times its share. With ``graph``, first
        check that the table was measured for it (`check_graph`)."""
        if graph is not None:
            self.check_graph(graph)
        costs = {}
        for block in self.blocks:
            for n in block.nodes:
                forward_share, backward_share = self.shares[n]
                costs[n] = NodeCost(
                    forward_s=block.forward_s * forward_share, backward_s=block.backward_s * backward_share
                )
        return costs

    def check_graph(self, graph: CostGraph, where: str = "the cost table") -> None:
        """A `CostTableError` unless this table was measured for ``graph`` (fingerprint, ops, shapes)."""
        self.check_key(CostKey.of(graph, dtype=self.key.dtype, device=self.key.device), where)

    def check_key(self, expected: CostKey, where: str = "the cost table") -> None:
        """A `CostTableError` naming each key field that differs from ``expected`` (device and dtype included)."""
        _strict_json.check_key(expected, self.key, where=where, made="measured", error=CostTableError, fix=_REPROFILE)

    def to_dict(self) -> dict[str, object]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **asdict(self)}

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON (see `load`); the folder is created when missing."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _strict_json.write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike, expected_key: CostKey | None = None) -> CostTable:
        """Read a file written by `save`; every defect (and a key other than ``expected_key``) is a
        `CostTableError` naming the file, the field and the fix."""
        return _strict_json.read_versioned(
            path, CostTable, format_name=FORMAT_NAME, format_version=FORMAT_VERSION, what="cost table",
            error=CostTableError, max_bytes=MAX_FILE_BYTES, fix=_REPROFILE, expected_key=expected_key, made="measured",
        )  # fmt: skip


def cache_path(key: CostKey) -> Path:
    """Where the table for ``key`` is cached: ``$HF_HOME/hf_ftpipe/costs/<model class>-<key digest>.json``."""
    model = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.model_class) or "model"
    return cache_root() / "costs" / f"{model}-{key.digest()}.json"


def _backward_shares(graph: CostGraph, block: _Timed, roofline: dict[str, float]) -> dict[str, float]:
    """Each op of ``block`` → its share of the block's backward (see `CostTable.from_timings`): the
    deferring products 2·W / backward of it between them, the others the rest, each by ``roofline``."""
    weight = getattr(block, "weight_s", 0.0)  # timings of a profiler before the split backward: none
    products = [n for n in block.nodes if defers_weight_gradient(graph, n)]
    others = [n for n in block.nodes if n not in set(products)]
    if weight <= 0 or block.backward_s <= 0 or not products or not others:
        return _by(block.nodes, roofline, 1.0)
    products_share = min(1.0, 2 * weight / block.backward_s)
    return {**_by(products, roofline, products_share), **_by(others, roofline, 1.0 - products_share)}


def _by(nodes: Sequence[str], weights: dict[str, float], total: float) -> dict[str, float]:
    """``total`` shared among ``nodes`` in proportion to ``weights`` (equally where they add up to 0)."""
    whole = math.fsum(weights[n] for n in nodes)
    return {n: total * (weights[n] / whole if whole > 0 else 1.0 / len(nodes)) for n in nodes}
