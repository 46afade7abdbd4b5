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

__all__ = ["Block", "blocks_of", "layer_stages", "signature_of"]


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
        blocks.append(Block(name, tuple(nodes), signature_of(graph, nodes)))
    return blocks


def layer_stages(graph: CostGraph, num_stages: int) -> dict[str, int] | None:
    """Every op → its stage in a split of the layers into ``num_stages`` runs of equal counts (the
    first ones one more where they do not divide), the ops before the first layer on the first
    stage and those after the last on the last: TeraPipe's equal stages, whose middle ones do the
    same work. ``None`` when there are fewer layers than stages (or no repeated layers)."""
    blocks = blocks_of(graph)
    stacks = _stacks(graph)
    layers = [i for i, b in enumerate(blocks) if _layer(graph.node(b.nodes[0])["scope"], stacks)]
    if len(layers) < num_stages:
        return None
    per_stage, extra = divmod(len(layers), num_stages)
    first_of_stage = []
    position = 0
    for s in range(num_stages):
        first_of_stage.append(layers[position])
        position += per_stage + (s < extra)
    node_stage = {}
    stage = 0
    for i, block in enumerate(blocks):
        while stage + 1 < num_stages and i >= first_of_stage[stage + 1]:
            stage += 1
        for n in block.nodes:
            node_stage[n] = stage
    return node_stage


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


def signature_of(graph: CostGraph, nodes: list[str] | tuple[str, ...]) -> str:
    """Equal for op lists that do the same work (see `Block.signature`)."""
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
