"""Quotient DAG: groups of ops contracted into blocks, kept acyclic by every contraction.

Contracting a set S of a DAG keeps it acyclic iff S is *convex*: no path leaves S and comes
back (for two blocks u → v: no path u → … → v of length ≥ 2). The quotient keeps a topological
order of its blocks, which makes the check local: a path between two members of S can only pass
through blocks positioned between them, so the search never looks past the last member. After a
contraction, the blocks of that window that are reachable from S move behind the new block and
the others in front of it, which is again a topological order.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import networkx as nx

__all__ = ["Quotient"]


class Quotient:
    """Blocks of a DAG's nodes with the induced block graph and a topological order of blocks.

    A block is named by one of its members (its *id*). ``members[b]`` lists the nodes of block
    ``b``; ``succ[b]`` / ``pred[b]`` are its neighbouring blocks; ``position[b]`` its index in
    ``order`` (``None`` entries are blocks contracted away, compacted by ``compact``).
    """

    def __init__(self, dag: nx.DiGraph, order: Iterable[Hashable]) -> None:
        self.order: list[Hashable | None] = list(order)
        self.position = {node: i for i, node in enumerate(self.order)}
        self.members: dict[Hashable, list[Hashable]] = {node: [node] for node in self.order}
        self.block_of = {node: node for node in self.order}
        self.succ: dict[Hashable, set[Hashable]] = {node: set(dag.successors(node)) for node in self.order}
        self.pred: dict[Hashable, set[Hashable]] = {node: set(dag.predecessors(node)) for node in self.order}

    def __len__(self) -> int:
        return len(self.members)

    def blocks(self) -> list[Hashable]:
        """Block ids in topological order."""
        return [b for b in self.order if b is not None]

    def compact(self) -> None:
        """Drop the holes contractions left in ``order`` (positions change, the order does not)."""
        self.order = self.blocks()
        self.position = {b: i for i, b in enumerate(self.order)}

    def contractible(self, blocks: Iterable[Hashable]) -> bool:
        """Whether contracting ``blocks`` into one keeps the block graph acyclic."""
        return self._descendants_in_window(set(blocks)) is not None

    def contract(self, blocks: Iterable[Hashable]) -> Hashable | None:
        """Contract ``blocks`` into one block (id: the earliest) if that keeps the graph acyclic.

        Returns the new block's id, or ``None`` (and changes nothing) when it would make a cycle.
        """
        group = set(blocks)
        if len(group) == 1:
            return next(iter(group))
        after = self._descendants_in_window(group)
        if after is None:
            return None
        # Blocks in topological order, never in set order: ids hash differently in every process
        # (PYTHONHASHSEED), and the order members are joined in shapes every later tie.
        first, *rest = sorted(group, key=self.position.__getitem__)
        last_pos = self.position[rest[-1]]
        window = self.order[self.position[first] : last_pos + 1]
        before = [b for b in window if b is not None and b not in group and b not in after]
        behind = [b for b in window if b is not None and b in after]
        start = self.position[first]
        new_window: list[Hashable | None] = [*before, first, *behind]
        new_window += [None] * (len(window) - len(new_window))
        self.order[start : last_pos + 1] = new_window
        for i, b in enumerate(new_window, start):
            if b is not None:
                self.position[b] = i
        for b in rest:
            del self.position[b]
            nodes = self.members.pop(b)
            self.members[first].extend(nodes)
            for node in nodes:
                self.block_of[node] = first
            for other in self.succ.pop(b):
                self.pred[other].discard(b)
                self.pred[other].add(first)
                self.succ[first].add(other)
            for other in self.pred.pop(b):
                self.succ[other].discard(b)
                self.succ[other].add(first)
                self.pred[first].add(other)
        self.succ[first] -= group
        self.pred[first] -= group
        return first

    def _descendants_in_window(self, group: set[Hashable]) -> set[Hashable] | None:
        """Blocks outside ``group`` reachable from it up to its last member, or ``None`` when
        one of them leads back into ``group`` (the group is not convex)."""
        last = max(self.position[b] for b in group)
        seen: set[Hashable] = set()
        stack = [s for b in group for s in self.succ[b] if s not in group and self.position[s] < last]
        while stack:
            b = stack.pop()
            if b in seen:
                continue
            seen.add(b)
            for s in self.succ[b]:
                if s in group:
                    return None
                if s not in seen and self.position[s] < last:
                    stack.append(s)
        return seen
