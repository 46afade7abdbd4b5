"""The time one pipeline stage takes for one slice of tokens, straight from the analytical cost model.

`RooflineSliceTime` sums every op's roofline time at a slice's share of the work: the exact latency
the slicing DP takes when no timings were fitted (`hf_ftpipe.costmodel.latency.SliceLatency` fits
its five coefficients to it, or to measurements). Pure Python: no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_ftpipe.costmodel.latency import LatencyKey, LatencySample
from hf_ftpipe.costmodel.op_time import _first_dtype, comm_time_s, compute_time_s, node_costs
from hf_ftpipe.costmodel.profiles import GPUProfile, canonical_dtype

if TYPE_CHECKING:  # only read here; importing hf_ftpipe.graph at runtime pulls in torch
    from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["RooflineSliceTime", "cost_model_slice_time", "weights_dtype"]


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def weights_dtype(graph: CostGraph) -> str:
    """The dtype of the traced model's first weight (float32 when it has none)."""
    weights = [info.dtype for info in graph.params.values() if not info.is_buffer]
    return canonical_dtype(weights[0]) if weights else "float32"


def cost_model_slice_time(
    graph: CostGraph, profile: GPUProfile, *, num_stages: int, hidden_size: int, dtype: str | None = None
) -> RooflineSliceTime:
    """`RooflineSliceTime` of a causal LM split over ``num_stages`` stages (the slicing DP's latency,
    as ``hf-ftpipe slices`` and PipeTrainer's ``token_slices="auto"`` use it).

    Between stages a slice sends one hidden state per token, ``hidden_size`` values of ``dtype``
    (default: the weights' dtype).
    """
    dtype = dtype or weights_dtype(graph)
    return RooflineSliceTime.from_graph(
        graph,
        profile,
        num_stages=num_stages,
        boundary_bytes_per_token=hidden_size * _DTYPE_BYTES.get(dtype, 4),
        dtype=dtype,
    )


@dataclass(frozen=True, kw_only=True)
class RooflineSliceTime:
    """``t(s, c, b)`` straight from the analytical cost model of a traced causal LM: the sum of
    every op's roofline time at the slice's share of the work, not a fitted form.

    ``graph`` is traced at ``input_ids`` of shape ``[B, L]``. An op whose input or output has two
    dimensions of length ``L`` (attention scores, their softmax and mask, the product with the
    values) or that is fused attention does work ``∝ s·(c + s)``; any other op ``∝ s``. Weights are
    read once per slice whatever ``s``, so short slices are memory-bound where long ones compute:
    a kink no smooth form follows, hence this exact sum for the DP. The model's time is split evenly
    over ``num_stages`` (TeraPipe's equal stages); between stages a slice sends
    ``boundary_bytes_per_token`` per token forward and as much back. (If ``L`` equals another
    dimension, such as the hidden size, more ops look quadratic: trace at another length.)
    """

    key: LatencyKey
    profile: GPUProfile
    ops: tuple[tuple[_Op, int], ...]
    """Each distinct op with how many times it occurs (a model's layers repeat the same ops)."""
    traced_batch: int
    boundary_bytes_per_token: float

    @classmethod
    def from_graph(
        cls,
        graph: CostGraph,
        profile: GPUProfile,
        *,
        num_stages: int,
        boundary_bytes_per_token: float,
        dtype: str | None = None,
    ) -> RooflineSliceTime:
        batch, seq_len = _traced_shape(graph)
        ops = _scalable_ops(graph, profile, seq_len, dtype)
        key = LatencyKey(
            model_fingerprint=graph.fingerprint,
            model_class=graph.model_class,
            seq_len=seq_len,
            num_stages=num_stages,
            device=profile.name,
            dtype=dtype or _main_dtype(ops),
        )
        counts = Counter(ops)
        return cls(
            key=key,
            profile=profile,
            ops=tuple(counts.items()),
            traced_batch=batch,
            boundary_bytes_per_token=boundary_bytes_per_token,
        )

    def time_s(self, slice_len: int, context_len: int, batch_size: int = 1) -> float:
        seq_len, ratio = self.key.seq_len, batch_size / self.traced_batch
        compute = sum(n * op.time_s(slice_len, context_len, ratio, seq_len, self.profile) for op, n in self.ops)
        time_s = compute / self.key.num_stages
        if self.key.num_stages > 1:
            time_s += 2 * comm_time_s(batch_size * slice_len * self.boundary_bytes_per_token, self.profile)
        return time_s

    __call__ = time_s

    def samples(self) -> list[LatencySample]:
        """The times on the grid `SliceLatency.fit` takes."""
        seq_len = self.key.seq_len
        points = [(s, c) for s in _grid(seq_len) for c in _grid(seq_len, start=0) if s + c <= seq_len]
        return [LatencySample(s, c, b, self.time_s(s, c, b)) for b in (1, 2) for s, c in points]


def _grid(seq_len: int, start: int = 1) -> list[int]:
    """Lengths to sample: fractions of the sequence, and the short slices the DP's first steps try."""
    points = {max(start, round(seq_len * f)) for f in (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)}
    points |= {p for p in (8, 16, 32) if p < seq_len}
    return sorted(p for p in points if p >= start)


@dataclass(frozen=True)
class _Op:
    """One op's forward work at the traced shape, split into what scales with the slice and what
    does not, and how many forward-sized products its backward does."""

    flops: float
    scaled_bytes: float
    fixed_bytes: float
    quadratic: bool
    passes: int
    dtype: str

    def time_s(self, s: int, c: int, batch_ratio: float, seq_len: int, profile: GPUProfile) -> float:
        share = s * (c + s) / seq_len**2 if self.quadratic else s / seq_len
        share *= batch_ratio
        forward = compute_time_s(self.flops * share, self.fixed_bytes + self.scaled_bytes * share, profile, self.dtype)
        return self.passes * forward


def _scalable_ops(graph: CostGraph, profile: GPUProfile, seq_len: int, dtype: str | None) -> list[_Op]:
    costs = node_costs(graph, profile, dtype)
    nodes = graph.graph.nodes
    ops = []
    for name, attrs in nodes(data=True):
        cost = costs[name]
        passes = 1 + (round(cost.backward_s / cost.forward_s) if cost.forward_s > 0 else 0)
        fixed = float(sum(graph.params[p].bytes for p in attrs.get("params", ()) if p in graph.params))
        shapes = list(attrs.get("output_shapes") or ())
        shapes += [s for u in graph.graph.predecessors(name) for s in (nodes[u].get("output_shapes") or ())]
        quadratic = "scaled_dot_product" in attrs.get("op", "") or any(
            list(shape).count(seq_len) >= 2 for shape in shapes if shape
        )
        ops.append(
            _Op(
                flops=float(attrs["flops"]),
                scaled_bytes=max(0.0, float(attrs["bytes_accessed"]) - fixed),
                fixed_bytes=fixed,
                quadratic=quadratic,
                passes=passes,
                dtype=dtype or _first_dtype(attrs),
            )
        )
    return ops


def _main_dtype(ops: list[_Op]) -> str:
    """The floating dtype most ops compute in (index and mask ops are not what the key means)."""
    floating = [op.dtype for op in ops if op.dtype in ("float32", "float16", "bfloat16", "float64")]
    return max(set(floating), key=floating.count) if floating else "float32"


def _traced_shape(graph: CostGraph) -> tuple[int, int]:
    info = graph.inputs.get("input_ids")
    if info is None or info.shape is None or len(info.shape) != 2:
        raise ValueError(
            f"from_cost_model needs a graph traced with `input_ids` of shape [batch, seq_len]; "
            f"its inputs are {sorted(graph.inputs)}"
        )
    return info.shape[0], info.shape[1]
