"""Plans for runtime tests that do not depend on a partitioner: the engine is tested on its own."""

from __future__ import annotations

from hf_ftpipe.plan import Partition


def contiguous_placement(cost_graph, stage_device: list[int]) -> Partition:
    """Equal node counts per stage, getitem nodes kept with their producer."""
    order = cost_graph.topological_order()
    num_stages = len(stage_device)
    node_stage = {name: (i * num_stages) // len(order) for i, name in enumerate(order)}
    for name in order:
        if "getitem" in cost_graph.node(name)["op"]:
            node_stage[name] = node_stage[next(iter(cost_graph.graph.predecessors(name)))]
    return Partition(node_stage=node_stage, stage_device=stage_device, partitioner="test", key=None)
