"""What a plan records of the graph it was made on: enough to re-anchor it onto another release's graph.

A plan's key names the model by its structure (`graph.fingerprint`), which stays the same when a
new transformers traces the model into a slightly different graph: an op added, renamed or
reordered inside a layer. The plan's ``node_stage`` then names ops the new graph does not have,
or not in the same places. `GraphAnchors` keeps, beside the plan, the exact graph's digest (to
tell at once whether the plan is exact for a graph) and each op's ATen target and module scope
in program order, which is what `plan.reanchor` aligns with the new graph's.

On disk, inside the plan file (names and scopes stored once, ops refer to them by index)::

    "anchors": {"digest": "3e5890f17c5955c4", "nodes": ["embedding", "linear", ...],
                "op_index": [0, 1, ...], "scope_index": [0, 2, ...],
                "ops": ["aten.embedding.default", ...], "scopes": ["transformer.wte", ...]}
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["GraphAnchors"]


@dataclass(frozen=True, kw_only=True)
class GraphAnchors:
    """The graph a plan was made on, as plain JSON-ready lists (see the module docstring)."""

    digest: str
    """``CostGraph.digest`` of the graph: equal digests mean the plan is exact for a graph."""
    nodes: list[str]
    """Every op, in the order the exported program runs them."""
    op_index: list[int]
    """For each op of ``nodes``, its ATen target's index in ``ops``."""
    scope_index: list[int]
    """For each op of ``nodes``, its module scope's index in ``scopes``."""
    ops: list[str]
    scopes: list[str]

    @classmethod
    def of(cls, graph: CostGraph) -> GraphAnchors:
        nodes = graph.topological_order()
        ops: dict[str, int] = {}
        scopes: dict[str, int] = {}
        op_index = [ops.setdefault(graph.node(n)["op"], len(ops)) for n in nodes]
        scope_index = [scopes.setdefault(graph.node(n)["scope"], len(scopes)) for n in nodes]
        return cls(
            digest=graph.digest,
            nodes=nodes,
            op_index=op_index,
            scope_index=scope_index,
            ops=list(ops),
            scopes=list(scopes),
        )

    def rows(self) -> Iterator[tuple[str, str, str]]:
        """(node, op, scope) for every op, in program order."""
        for node, op, scope in zip(self.nodes, self.op_index, self.scope_index):
            yield node, self.ops[op], self.scopes[scope]

    def problems(self) -> list[str]:
        """What makes the record inconsistent in itself (a hand-edited or damaged file)."""
        problems = []
        count = len(self.nodes)
        if len(self.op_index) != count or len(self.scope_index) != count:
            problems.append(
                f"'anchors' lists {count} nodes but {len(self.op_index)} op indices and {len(self.scope_index)} "
                "scope indices; expected one of each per node"
            )
        if len(set(self.nodes)) != count:
            problems.append("'anchors.nodes' names an op twice")
        for field_name, indices, table in (
            ("op_index", self.op_index, self.ops),
            ("scope_index", self.scope_index, self.scopes),
        ):
            bad = [i for i in indices if not 0 <= i < len(table)]
            if bad:
                problems.append(f"'anchors.{field_name}' has indices outside 0..{len(table) - 1}, e.g. {bad[:3]}")
        return problems
