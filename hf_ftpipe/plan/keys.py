"""The key a partitioner records: built from its request, or checked against the one it was given."""

from __future__ import annotations

from hf_ftpipe.costmodel.profiles import GPUProfile, canonical_dtype
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.partition import PartitionKey


def resolve_key(
    graph: CostGraph,
    profile: GPUProfile,
    key: PartitionKey | None,
    *,
    schedule: str,
    num_microbatches: int,
    dtype: str | None,
) -> PartitionKey:
    """``key`` if it agrees with the request, else a `PartitionError`; a new key when ``key`` is None."""
    if key is None:
        return PartitionKey.from_graph(
            graph,
            dtype=canonical_dtype(dtype) if dtype is not None else params_dtype(graph),
            schedule=schedule,
            num_microbatches=num_microbatches,
            gpu_profile=profile.name,
            num_gpus=profile.count,
        )
    expected = {"schedule": schedule, "num_microbatches": num_microbatches, "num_gpus": profile.count}
    wrong = [f"{k}={getattr(key, k)!r} (argument: {v!r})" for k, v in expected.items() if getattr(key, k) != v]
    if wrong:
        raise PartitionError(
            f"`key` disagrees with the arguments: {', '.join(wrong)}; pass matching arguments or no key"
        )
    return key


def params_dtype(graph: CostGraph) -> str:
    """The dtype holding the most parameter bytes (``float32`` for a graph without parameters)."""
    by_dtype: dict[str, int] = {}
    for info in graph.params.values():
        name = canonical_dtype(info.dtype)
        by_dtype[name] = by_dtype.get(name, 0) + info.bytes
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "float32"
