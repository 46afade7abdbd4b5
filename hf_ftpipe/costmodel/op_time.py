"""The analytical cost model: roofline time of each op, latency-plus-bandwidth time of each edge.

An op takes as long as the slower of its two limits (the roofline model, Williams et al. 2009):
doing its FLOPs at the device's effective peak, or moving its bytes at the effective memory
bandwidth. A transfer between devices costs a fixed start-up plus its bytes over the link. These
are the per-node and per-edge numbers FTPipe's objective sums per GPU (DESIGN.md, "Cost of a GPU").
Pure arithmetic on plain data: no devices, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_ftpipe.costmodel.profiles import GPUProfile, canonical_dtype
from hf_ftpipe.errors import ProfileError

if TYPE_CHECKING:  # only read here; importing hf_ftpipe.graph at runtime pulls in torch
    from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = [
    "NodeCost",
    "backward_factor",
    "backward_time_s",
    "comm_time_s",
    "compute_time_s",
    "edge_comm_s",
    "node_costs",
]


@dataclass(frozen=True)
class NodeCost:
    """Predicted time of one op on one device, for one micro-batch."""

    forward_s: float
    """Forward time, seconds."""
    backward_s: float
    """Backward time, seconds (0 for ops outside the backward graph)."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def compute_time_s(flops: float, bytes_accessed: float, profile: GPUProfile, dtype: object = "float32") -> float:
    """Roofline time: ``max(flops / effective peak[dtype], bytes / effective memory bandwidth)``.

    The effective rates are the datasheet values times the profile's efficiencies (see
    ``GPUProfile.compute_efficiency``).
    """
    _check_non_negative("flops", flops)
    _check_non_negative("bytes_accessed", bytes_accessed)
    compute_s = flops / profile.effective_flops_per_s(dtype)
    memory_s = bytes_accessed / profile.effective_memory_bandwidth_bytes_per_s
    return max(compute_s, memory_s)


def backward_factor(*, requires_grad: bool, reads_trainable_params: bool, inputs_require_grad: bool = True) -> int:
    """How many forward-sized products the backward of an op does: 0, 1 or 2.

    The backward of ``y = x @ W`` computes ``dx = dy @ W.T`` (needed when ``x`` requires grad) and
    ``dW = x.T @ dy`` (needed when ``W`` is trainable); each is as large as the forward product,
    so an op with trainable parameters costs about 2x its forward, an op without parameters (an
    activation, a residual add) about 1x, and an op whose outputs never reach the loss through a
    trainable parameter costs nothing because autograd never visits it. ``inputs_require_grad``
    drops ``dx`` where the op reads only data (the first projection after a frozen embedding).
    """
    if not requires_grad:
        return 0
    if not reads_trainable_params:
        return 1
    return 1 + int(inputs_require_grad)


def backward_time_s(
    flops: float,
    bytes_accessed: float,
    profile: GPUProfile,
    dtype: object = "float32",
    *,
    requires_grad: bool = True,
    reads_trainable_params: bool = False,
    inputs_require_grad: bool = True,
) -> float:
    """Backward time: ``backward_factor(...)`` times the forward roofline time."""
    factor = backward_factor(
        requires_grad=requires_grad,
        reads_trainable_params=reads_trainable_params,
        inputs_require_grad=inputs_require_grad,
    )
    return factor * compute_time_s(flops, bytes_accessed, profile, dtype)


def comm_time_s(num_bytes: float, profile: GPUProfile) -> float:
    """Time to send ``num_bytes`` from one device to another: latency + bytes / link bandwidth.

    Zero bytes cost nothing: no message is sent.
    """
    _check_non_negative("num_bytes", num_bytes)
    if num_bytes == 0:
        return 0.0
    return profile.link_latency_s + num_bytes / profile.link_bandwidth_bytes_per_s


def node_costs(graph: CostGraph, profile: GPUProfile, dtype: object | None = None) -> dict[str, NodeCost]:
    """Forward and backward time of every node of ``graph`` on one device of ``profile``.

    ``dtype`` (e.g. ``"bfloat16"`` to plan for autocast) overrides each node's own dtype, which is
    its first output dtype (``float32`` for a node without tensor outputs).
    """
    nodes = graph.graph.nodes
    costs: dict[str, NodeCost] = {}
    for name, attrs in nodes(data=True):
        flops = _attr(name, attrs, "flops")
        bytes_accessed = _attr(name, attrs, "bytes_accessed")
        requires_grad = bool(_attr(name, attrs, "requires_grad"))
        node_dtype = dtype if dtype is not None else _first_dtype(attrs)
        forward_s = compute_time_s(flops, bytes_accessed, profile, node_dtype)
        trainable = _reads_trainable_params(graph, name, attrs)
        # Model inputs are not nodes and never require grad, so only producers count here.
        inputs_require_grad = any(nodes[u].get("requires_grad", False) for u in graph.graph.predecessors(name))
        factor = backward_factor(
            requires_grad=requires_grad,
            reads_trainable_params=trainable,
            inputs_require_grad=inputs_require_grad,
        )
        costs[name] = NodeCost(forward_s=forward_s, backward_s=factor * forward_s)
    return costs


def edge_comm_s(graph: CostGraph, profile: GPUProfile) -> dict[tuple[str, str], float]:
    """Transfer time of every edge's tensor (edge attribute ``bytes``), were the edge cut."""
    return {
        (u, v): comm_time_s(_attr(f"{u} -> {v}", attrs, "bytes"), profile)
        for u, v, attrs in graph.graph.edges(data=True)
    }


def _first_dtype(attrs: dict) -> str:
    dtypes = attrs.get("output_dtypes") or ()
    return canonical_dtype(dtypes[0]) if dtypes else "float32"


def _reads_trainable_params(graph: CostGraph, name: str, attrs: dict) -> bool:
    trainable = False
    for param in attrs.get("params", ()):
        info = graph.params.get(param)
        if info is None:
            raise ProfileError(
                f"node {name!r} reads parameter {param!r}, which is not in graph.params "
                f"({len(graph.params)} entries); the CostGraph is inconsistent, "
                "trace the model again"
            )
        trainable = trainable or info.requires_grad
    return trainable


def _attr(where: str, attrs: dict, key: str) -> Any:
    try:
        return attrs[key]
    except KeyError:
        raise ProfileError(
            f"{where!r} has no {key!r} attribute (has {sorted(attrs)}); costs need a CostGraph "
            "built by hf_ftpipe.graph, which sets it"
        ) from None


def _check_non_negative(name: str, value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ProfileError(f"`{name}` must be >= 0, got {value!r}")
