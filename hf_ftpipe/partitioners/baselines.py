"""The partitions a user would otherwise pick: DeepSpeed's 'uniform' and 'parameters' methods.

DeepSpeed's ``PipelineModule(partition_method=...)`` splits a list of layers into contiguous
stages: ``"uniform"`` gives every stage the same number of layers, ``"parameters"`` about the same
number of trainable parameters. Here the "layers" are found in the traced graph:

- ``uniform``: the repeated blocks of the model, found from module scopes without hints: the
  children of a container (``encoder.block``, ``transformer.h``, ``bert.encoder.layer``) indexed
  ``0, 1, ...`` that share one class (``T5Block``, ``GPT2Block``, ``BertLayer``) and number at
  least two. Ops outside the blocks (embeddings, final norms, the head) join the stage of the
  block before them in execution order (the first stage before any block). A model without
  repeated blocks is cut into equal numbers of ops.
- ``params``: cuts along the execution order where the running total of parameter bytes crosses
  k / num_stages of the whole, each parameter counted at its first use (a tied weight once).

Both put stage s on GPU s and are priced by the same cost model as every other partitioner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner, greedy_cuts
from hf_ftpipe.partitioners.fit import check_memory
from hf_ftpipe.partitioners.registry import register_partitioner
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["find_blocks", "partition_params", "partition_uniform"]


@register_partitioner("uniform")
def partition_uniform(
    graph: CostGraph, profile: GPUProfile, num_stages: int | None = None, **options: Unpack[PlanOptions]
) -> Partition:
    """Equal numbers of repeated blocks per stage (DeepSpeed's ``"uniform"``), one stage per GPU.

    Arguments as in ``partition_seq_greedy``. Raises ``PartitionError`` when the plan does not fit
    the usable memory of a GPU.
    """
    planner = ContiguousPlanner.of("uniform", graph, PlanRequest(profile=profile, num_stages=num_stages, **options))
    cuttable = planner.cut_order.cuttable
    block_of = find_blocks(graph)
    first_op: dict[str, int] = {}  # block → position of its first cuttable op
    for i, n in enumerate(cuttable):
        if n in block_of:
            first_op.setdefault(block_of[n], i)
    starts = sorted(first_op.values())
    num_blocks, p = len(starts), planner.num_stages
    if num_blocks >= p:
        # Stage s begins at its first block; DeepSpeed's uniform split of num_blocks items.
        bounds = [0, *(starts[s * num_blocks // p] for s in range(1, p)), len(cuttable)]
    else:
        bounds = [0, *greedy_cuts([1.0] * len(cuttable), p), len(cuttable)]
    return check_memory(planner, planner.partition(bounds))


@register_partitioner("params")
def partition_params(
    graph: CostGraph, profile: GPUProfile, num_stages: int | None = None, **options: Unpack[PlanOptions]
) -> Partition:
    """About equal trainable parameter bytes per stage (DeepSpeed's ``"parameters"``).

    Arguments as in ``partition_seq_greedy``. A graph without trainable parameters is cut into
    equal numbers of ops. Raises ``PartitionError`` when the plan does not fit the usable memory.
    """
    planner = ContiguousPlanner.of("params", graph, PlanRequest(profile=profile, num_stages=num_stages, **options))
    cut_order = planner.cut_order
    position = {n: i for i, n in enumerate(cut_order.cuttable)}
    weights = [0.0] * len(position)
    seen: set[str] = set()
    for n in cut_order.order:
        for name in graph.node(n)["params"]:
            info = graph.params[name]
            if name not in seen and info.requires_grad:
                seen.add(name)
                weights[position[cut_order.anchor[n]]] += info.bytes
    if sum(weights) == 0:
        weights = [1.0] * len(weights)
    bounds = [0, *greedy_cuts(weights, planner.num_stages), len(weights)]
    return check_memory(planner, planner.partition(bounds))


def find_blocks(graph: CostGraph) -> dict[str, str]:
    """Op → the repeated block it belongs to (e.g. ``"encoder.block.3"``), for ops in one.

    A block is a module at an integer index of a container (``<container>.<i>``, the outermost
    such index in the op's scope) whose class is shared by at least one other index of the same
    container. The class is read from ``scope_types``: the module stack holds every called module,
    and a container followed by an index (``ModuleList``) is not called, so it has no entry.
    """
    found: dict[str, tuple[str, str, str]] = {}  # op → (container, index, class)
    for n, attrs in graph.graph.nodes(data=True):
        parts = attrs["scope"].split(".") if attrs["scope"] else []
        index = next((i for i, part in enumerate(parts) if part.isdigit() and i > 0), None)
        if index is None:
            continue
        depth = 0  # the root module is scope_types[0]
        for i in range(index + 1):
            if not (i + 1 < len(parts) and parts[i + 1].isdigit()):
                depth += 1
        types = attrs["scope_types"]
        found[n] = (".".join(parts[:index]), parts[index], types[depth] if depth < len(types) else "")
    indices: dict[tuple[str, str], set[str]] = {}
    for container, index, cls in found.values():
        indices.setdefault((container, cls), set()).add(index)
    return {
        n: f"{container}.{index}" for n, (container, index, cls) in found.items() if len(indices[container, cls]) >= 2
    }
