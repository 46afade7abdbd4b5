"""Quotient: contractions that would close a cycle are refused, the block order stays topological."""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ftpipe.partitioners.mixed.quotient import Quotient


def block_graph(q: Quotient) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(q.blocks())
    graph.add_edges_from((b, s) for b in q.blocks() for s in q.succ[b])
    return graph


def test_contracting_around_a_detour_is_refused() -> None:
    dag = nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])
    q = Quotient(dag, ["a", "b", "c"])
    assert not q.contractible({"a", "c"})
    assert q.contract({"a", "c"}) is None
    assert len(q) == 3
    assert q.contract({"a", "b"}) == "a"
    assert q.members["a"] == ["a", "b"]
    assert q.succ["a"] == {"c"} and q.pred["c"] == {"a"}


def test_unrelated_blocks_in_between_move_out_of_the_way() -> None:
    # a → c, b independent and between them in the order; b's consumer d comes after c
    dag = nx.DiGraph([("a", "c"), ("b", "d"), ("c", "d")])
    q = Quotient(dag, ["a", "b", "c", "d"])
    assert q.contract({"a", "c"}) == "a"
    order = q.blocks()
    assert order.index("b") < order.index("d") and order.index("a") < order.index("d")


@st.composite
def dags(draw):
    n = draw(st.integers(2, 14))
    edges = [(i, j) for i in range(n) for j in range(i + 1, n) if draw(st.booleans()) and draw(st.booleans())]
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20))
    return n, edges, pairs


@settings(max_examples=60, deadline=None)
@given(dags())
def test_random_contractions_keep_the_block_graph_acyclic_and_ordered(case) -> None:
    n, edges, pairs = case
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    dag.add_edges_from(edges)
    q = Quotient(dag, range(n))
    for u, v in pairs:
        a, b = q.block_of[u], q.block_of[v]
        if a == b:
            continue
        blocks = block_graph(q)
        merged = nx.contracted_nodes(blocks, a, b, self_loops=False)
        expected_ok = nx.is_directed_acyclic_graph(merged)
        assert (q.contract({a, b}) is not None) == expected_ok
        blocks = block_graph(q)
        assert nx.is_directed_acyclic_graph(blocks)
        position = {block: i for i, block in enumerate(q.blocks())}
        assert all(position[x] < position[y] for x, y in blocks.edges)
        # the block graph is exactly the quotient of the op graph
        quotient_edges = {(q.block_of[x], q.block_of[y]) for x, y in edges if q.block_of[x] != q.block_of[y]}
        assert set(blocks.edges) == quotient_edges
