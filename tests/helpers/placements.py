"""Plans for runtime tests that do not depend on a partitioner: the engine is tested on its own."""

from __future__ import annotations

from hf_ftpipe.plan import Partition
from hf_ftpipe.plan.atoms import follows_producer


def contiguous_placement(cost_graph, stage_device: list[int]) -> Partition:
    """Equal node counts per stage; an op that follows its producer (the library's rule,
    ``plan.atoms``) joins the latest stage among its producers."""
    order = cost_graph.topological_order()
    num_stages = len(stage_device)
    node_stage = {name: (i * num_stages) // len(order) for i, name in enumerate(order)}
    for name in order:  # producers first, so a follower of a follower lands with the first producer
        if follows_producer(cost_graph, name):
            node_stage[name] = max(node_stage[u] for u in cost_graph.graph.predecessors(name))
    return Partition(node_stage=node_stage, stage_device=stage_device, partitioner="test", key=None)


def logits_apart_placement(cost_graph, stage_device: list[int]) -> dict[str, int]:
    """Op → stage with the model's ``logits`` on another stage than its loss, which reads only a view of
    them: the ops up to the first that reads the logits (in topological order) cut contiguously into all
    stages but the last, the loss's other ops in the last, as a Mixed-Pipe plan may put them
    (``stage_device=[0, 1, 0]``: the logits on rank 1, the loss back on rank 0)."""
    order = cost_graph.topological_order()
    logits = dict(zip(cost_graph.output_names, cost_graph.outputs, strict=False))["logits"]
    cut = min(order.index(reader) for reader in cost_graph.graph.successors(logits)) + 1
    before = len(stage_device) - 1
    node_stage = {name: (i * before) // cut if i < cut else before for i, name in enumerate(order)}
    for name in order:
        if follows_producer(cost_graph, name):
            node_stage[name] = max(node_stage[u] for u in cost_graph.graph.predecessors(name))
    return node_stage
