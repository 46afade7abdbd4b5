"""Keep in-place updates whole: each tensor mutated in place becomes one node with all its readers.

Exported training graphs keep a few in-place ops, such as T5's and BART's ``_shift_right``, which
writes into a fresh tensor through slices (``copy_``, ``masked_fill_``). The graph then carries
the update as a side effect: later readers name the tensor, not the op that changed it. Values
that cross a stage boundary are snapshots, so a partition that cut between a mutation and the
readers of the tensor would compute with stale data. Fusing every mutated tensor, its views,
the mutations and their readers into one submodule turns the side effect into plain data flow
that any partition can cut around.
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, insert_subgm

__all__ = ["fuse_mutations"]


def fuse_mutations(graph_module: fx.GraphModule) -> int:
    """Fuse each in-place-mutated tensor's region of ``graph_module`` into a submodule; returns how many."""
    clusters = _merge_overlapping([_region_of(node) for node in graph_module.graph.nodes if _mutates(node)])
    if not clusters:
        return 0
    while True:  # hulls of merged clusters may take in more nodes: repeat until nothing changes
        convex = _merge_overlapping([_convex_hull(cluster) for cluster in clusters])
        if convex == clusters:
            break
        clusters = convex
    order = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    for index, cluster in enumerate(clusters):
        # Program order, not a data-flow sort: a reader must stay after the mutation it observes.
        nodes = sorted(cluster, key=order.__getitem__)
        region, inputs, outputs = fuse_as_graphmodule(graph_module, nodes, f"inplace_{index}")
        insert_subgm(graph_module, region, inputs, outputs, nodes[-1])
        erase_nodes(graph_module, nodes)
    stable_topological_sort(graph_module)
    graph_module.graph.lint()
    for name, module in graph_module.named_children():
        if name.startswith("inplace_") and isinstance(module, fx.GraphModule):
            ops = sorted({str(n.target).split(".")[1] for n in module.graph.nodes if _mutates(n)})
            module.op = f"inplace({', '.join(ops)})"  # what the CostGraph shows as the node's op
    graph_module.recompile()
    return len(clusters)


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _region_of(mutation: fx.Node) -> set[fx.Node]:
    """The mutated tensor's base, every view of it, and every node reading any of them."""
    base = mutation.args[0]
    while isinstance(base, fx.Node) and (_is_view(base) or _mutates(base)) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    aliases: set[fx.Node] = set()
    frontier = [base]
    while frontier:
        node = frontier.pop()
        if node in aliases:
            continue
        aliases.add(node)
        frontier.extend(user for user in node.users if _is_view(user) or _mutates(user))
    region = set(aliases)
    for alias in aliases:
        region.update(alias.users)
    return {n for n in region if n.op in ("call_function", "call_module")}


def _convex_hull(cluster: set[fx.Node]) -> set[fx.Node]:
    """Add every node on a path between two members, so fusing cannot create a cycle."""
    order = {node: i for i, node in enumerate(next(iter(cluster)).graph.nodes)}
    last = max(order[n] for n in cluster)
    # Nodes reachable from the cluster, within the cluster's span of the execution order.
    reach: set[fx.Node] = set()
    frontier = list(cluster)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in reach and order.get(user, last + 1) <= last:
                reach.add(user)
                frontier.append(user)
    # ... of which those that lead back into the cluster.
    hull = set(cluster)
    for node in sorted(reach, key=order.__getitem__, reverse=True):
        if node.op in ("call_function", "call_module") and any(user in hull for user in node.users):
            hull.add(node)
    return hull


def _merge_overlapping(clusters: list[set[fx.Node]]) -> list[set[fx.Node]]:
    merged: list[set[fx.Node]] = []
    for cluster in clusters:
        overlapping = [m for m in merged if m & cluster]
        for m in overlapping:
            merged.remove(m)
            cluster = cluster | m
        merged.append(cluster)
    return merged
