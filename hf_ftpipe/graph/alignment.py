"""Matching the ops of two captures of one model: the same op of the same module, in program order.

Two graphs of one model differ in a few ops and in the exporter's names without differing in what
the model computes: an export at another sequence length drops shape-dependent no-ops (the
``contiguous`` of a one-token slice), and another transformers release adds, reorders or renames
an op inside a layer. Names shift with the exporter's counters, so ops are matched by (ATen
target, module scope) along the program: the longest common subsequence that `difflib` finds.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["OpRow", "match_ops", "op_rows"]

OpRow = tuple[str, str, str]
"""(node name, ATen target, module scope)."""


def op_rows(graph: CostGraph) -> list[OpRow]:
    """Every op of ``graph`` as (name, target, scope), in the order the program runs them."""
    return [(n, graph.node(n)["op"], graph.node(n)["scope"]) for n in graph.topological_order()]


def match_ops(rows: Sequence[OpRow], onto: Sequence[OpRow]) -> dict[str, str]:
    """Name of an op of ``rows`` → the name of the same op of ``onto``, for the ops both programs
    run in the same order; ops of either that the other lacks are left out."""
    matcher = difflib.SequenceMatcher(
        None, [(op, scope) for _, op, scope in rows], [(op, scope) for _, op, scope in onto], autojunk=False
    )
    matched: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            matched[rows[block.a + i][0]] = onto[block.b + i][0]
    return matched
