"""Ops that never begin a stage of their own: each one shares a producer's stage.

Two kinds, the same for every partitioner and for the runtime:

- a part of a multi-output op (``getitem`` of ``split``): a tuple is never sent between stages,
  its parts are, so the runtime needs the getitems beside their producer (the validator refuses a
  plan that separates them);
- a side-effect op (no FLOPs, no output, no consumer, e.g. ``aten._assert_tensor_metadata``): it
  checks a value where that value is, and costs nothing to keep there.

Such an op joins the latest stage among its producers, which keeps the numbering topological.
"""

from __future__ import annotations

from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["follows_producer", "is_side_effect", "is_tuple_part"]


def follows_producer(graph: CostGraph, node: str) -> bool:
    """An op that must share its producer's stage: a part of a multi-output op, or a side effect."""
    return is_tuple_part(graph, node) or (is_side_effect(graph, node) and graph.graph.in_degree(node) > 0)


def is_tuple_part(graph: CostGraph, node: str) -> bool:
    """``node`` takes apart the tuple of its one producer, a multi-output op."""
    producers = list(graph.graph.predecessors(node))
    return len(producers) == 1 and len(graph.node(producers[0])["output_shapes"]) > 1


def is_side_effect(graph: CostGraph, node: str) -> bool:
    """``node`` computes nothing that anyone reads: no FLOPs, no output, no consumer, not a model output."""
    attrs, g = graph.node(node), graph.graph
    return attrs["flops"] == 0 and attrs["output_bytes"] == 0 and g.out_degree(node) == 0 and node not in graph.outputs
