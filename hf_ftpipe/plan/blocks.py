"""The blocks a model is profiled in: one per layer of a repeated stack, one per run of ops between layers.

A transformer is a few stacks of equal layers (``transformer.h.0`` … ``h.47``; T5's
``encoder.block.*`` and ``decoder.block.*``) with a few ops around them (embeddings, the head, the
loss). Timing each op alone on a GPU measures mostly launch overhead; timing a whole layer measures
what a stage runs. And equal layers take equal time, so a profile times one layer of each kind and
reuses it (`Block.signature`): a 48-layer GPT2-XL is timed as 3 blocks (the ops before the first
layer, one layer, the ops after the last), not 50.

A layer is the module path up to the first index of a container that holds at least two indexed
children in the graph (``transformer.h.3`` in ``transformer.h.3.attn``). Blocks follow the
execution order, and ops that must stay beside their producer (`plan.atoms`) join its block.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.atoms import follows_producer

__all__ = ["Block", "blocks_of"]


@dataclass(frozen=True)
class Block:
    """A contiguous run of ops in execution order."""

    name: str
    """The layer's module path, or (between layers) the first op's scope (``"<top>"`` for the top module)."""
    nodes: tuple[str, ...]
    signature: str
    """Equal for blocks that do the same work: their ops, the shapes and dtypes of what they compute
    and read, and the shapes of the parameters they read, position by position."""


def blocks_of(graph: CostGraph) -> list[Block]:
    """The blocks of ``graph`` in execution order (see the module docstring); every op is in one."""
    order = graph.topological_order()
    stacks = _stacks(graph)
    run_of: dict[str, int] = {}
    runs: list[tuple[str, list[str]]] = []  # (layer path or "", ops)
    for n in order:
        if follows_producer(graph, n):  # producers come first in execution order
            run_of[n] = max(run_of[u] for u in graph.graph.predecessors(n))
        else:
            layer = _layer(graph.node(n)["scope"], stacks) or ""
            if not runs or runs[-1][0] != layer:
                runs.append((layer, []))
            run_of[n] = len(runs) - 1
        runs[run_of[n]][1].append(n)
    blocks = []
    seen: dict[str, int] = defaultdict(int)
    for layer, nodes in runs:
        name = layer or (graph.node(nodes[0])["scope"] or "<top>")
        seen[name] += 1
        if seen[name] > 1:  # a layer whose ops the execution order splits: its pieces are told apart
            name = f"{name}#{seen[name]}"
        blocks.append(Block(name, tuple(nodes), _signature(graph, nodes)))
    return blocks


def _stacks(graph: CostGraph) -> set[str]:
    """Module paths with at least two indexed children among the graph's scopes (``transformer.h``)."""
    children: dict[str, set[str]] = defaultdict(set)
    for _, scope in graph.graph.nodes(data="scope"):
        parts = (scope or "").split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                children[".".join(parts[:i])].add(part)
    return {path for path, indices in children.items() if len(indices) >= 2}


def _layer(scope: str, stacks: set[str]) -> str | None:
    parts = (scope or "").split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and ".".join(parts[:i]) in stacks:
            return ".".join(parts[: i + 1])
    return None


def _signature(graph: CostGraph, nodes: list[str]) -> str:
    inside = set(nodes)
    position = {n: i for i, n in enumerate(nodes)}
    parts = []
    for n in nodes:
        attrs = graph.node(n)
        reads = tuple(
            ("in", position[u]) if u in inside else ("out", *_value(graph, u)) for u in graph.graph.predecessors(n)
        )
        params = tuple(
            (graph.params[p].shape, graph.params[p].dtype, graph.params[p].requires_grad) for p in attrs["params"]
        )
        parts.append(
            (attrs["op"], attrs["output_shapes"], attrs["output_dtypes"], attrs["requires_grad"], reads, params,
             tuple(attrs["batch_inputs"]))
        )  # fmt: skip
    return repr(parts)


def _value(graph: CostGraph, node: str) -> tuple[object, ...]:
    attrs = graph.node(node)
    return attrs["output_shapes"], attrs["output_dtypes"], attrs["requires_grad"]
