"""Mixed-Pipe step 1: coarsen thousands of ops into a few dozen blocks, never making a cycle.

FTPipe (Eliad et al., ATC'21, "Mixed-Pipe: coarsening") creates L > P blocks from N nodes by edge
contraction: "merge zero weight nodes", the "CCO property" ("starting from smallest node, merge
until CCO"), "coarsen by type" and "coarsen around centers". Here, in that order:

1. **Atoms** — what must never be split: an op that follows its producer (``plan.atoms``: a
   ``getitem`` of a multi-output op, a side effect such as ``_assert_tensor_metadata``) joins its
   latest producer.
2. **Zero cost** — an op that costs (almost) nothing joins a producer, or a consumer.
3. **By type** — module instances of a *repeated* class (``T5Block``, ``GPT2Block``: a class
   name with several instances in ``scope_types``, found from the trace, never named by the user)
   become one block each when they cost at most ``cap``; larger ones are opened and their
   children tried, down to leaf modules.
4. **CCO** — a block whose compute is shorter than the transfer of its outputs ("computation
   overlaps communication" fails) merges with the producer it reads most from, until it holds.
5. **Around centers** — the lightest block joins its lightest neighbour until L blocks remain:
   the heavy blocks act as centers that the light ones gather around, and blocks stay even.

Every contraction goes through `Quotient.contract`, which refuses one that would close a cycle.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.mixed.quotient import Quotient
from hf_ftpipe.plan.atoms import follows_producer

__all__ = ["Coarsening", "atoms_of", "coarsen"]


@dataclass
class Coarsening:
    """The result of coarsening: atoms (indivisible) and blocks per requested block count."""

    atoms: list[list[str]]
    """Groups of ops that always share a stage, in topological order."""
    levels: dict[int, list[list[str]]]
    """Requested L → the blocks (lists of ops) in a topological order of the block graph; a level
    has more blocks than asked when contraction stalled (every further merge made a cycle)."""


def atoms_of(graph: CostGraph, quotient: Quotient | None = None) -> Quotient:
    """A quotient of ``graph`` whose blocks are its atoms (step 1)."""
    g = graph.graph
    q = quotient or Quotient(g, graph.topological_order())
    for node in graph.topological_order():
        if follows_producer(graph, node):  # a tuple part has one producer, the latest
            latest = max(g.predecessors(node), key=lambda u: g.nodes[u]["order"])
            q.contract({q.block_of[latest], q.block_of[node]})
    return q


def coarsen(
    graph: CostGraph,
    weight: Mapping[str, float],
    out_comm_s: Mapping[str, float],
    block_counts: Sequence[int],
    cap: float,
) -> Coarsening:
    """Coarsen ``graph`` to each of ``block_counts`` blocks (steps 1–5 of the module docstring).

    Args:
        weight: op → forward + backward seconds.
        out_comm_s: op → seconds to send its output to another GPU.
        cap: the most compute a block made in steps 2–4 may hold (a fraction of the ideal load
            of a GPU, so that assignment still has pieces to balance with).
    """
    q = atoms_of(graph)
    q.compact()
    atoms = [list(q.members[b]) for b in q.blocks()]
    cost = {b: sum(weight[n] for n in q.members[b]) for b in q.blocks()}
    merger = _Merger(graph, q, cost, out_comm_s)

    total = sum(cost.values())
    negligible = 1e-6 * total / max(len(cost), 1)
    for b in list(q.blocks()):
        if b in q.members and cost[b] <= negligible:
            merger.absorb(b, limit=cap, prefer="pred")
    _merge_repeated_modules(graph, merger, weight, cap)
    _merge_until_cco(merger, cap)
    q.compact()

    levels: dict[int, list[list[str]]] = {}
    for count in sorted(set(block_counts), reverse=True):
        _grow_to(merger, count)
        q.compact()
        levels[count] = [list(q.members[b]) for b in q.blocks()]
    return Coarsening(atoms=atoms, levels=levels)


class _Merger:
    """Contractions on a quotient that keep each block's compute up to date."""

    def __init__(self, graph: CostGraph, q: Quotient, cost: dict, out_comm_s: Mapping[str, float]) -> None:
        self.graph, self.q, self.cost, self.out_comm_s = graph, q, cost, out_comm_s

    def contract(self, blocks: Iterable) -> object | None:
        blocks = self.ordered(blocks)
        total = sum(self.cost[b] for b in blocks)
        new = self.q.contract(blocks)
        if new is not None:
            for b in blocks:
                if b != new:
                    del self.cost[b]
            self.cost[new] = total
        return new

    def ordered(self, blocks: Iterable) -> list:
        """``blocks`` in topological order: ties are broken by position, never by set order,
        which changes with PYTHONHASHSEED."""
        return sorted(set(blocks), key=self.q.position.__getitem__)

    def absorb(self, b: object, *, limit: float, prefer: str = "traffic") -> object | None:
        """Merge block ``b`` into one neighbour (the one it exchanges most bytes with, or a
        producer first with ``prefer="pred"``; the earliest on a tie) without passing ``limit``;
        the new id or None."""
        q = self.q
        neighbours = [n for n in self.ordered((*q.pred[b], *q.succ[b])) if self.cost[n] + self.cost[b] <= limit]
        traffic = self.traffic(b)
        if prefer == "pred":
            neighbours.sort(key=lambda n: (n not in q.pred[b], -traffic.get(n, 0)))
        else:
            neighbours.sort(key=lambda n: -traffic.get(n, 0))
        for n in neighbours:
            new = self.contract({b, n})
            if new is not None:
                return new
        return None

    def traffic(self, b: object) -> dict[object, float]:
        """Neighbouring block → bytes exchanged with ``b`` (each output once per block)."""
        q, g = self.q, self.graph.graph
        volume: dict[object, float] = defaultdict(float)
        for node in q.members[b]:
            size = g.nodes[node]["output_bytes"]
            for other in {q.block_of[v] for v in g.successors(node)} - {b}:
                volume[other] += size
            for u in g.predecessors(node):
                other = q.block_of[u]
                if other != b:
                    volume[other] += g.nodes[u]["output_bytes"] / max(1, g.out_degree(u))
        return volume

    def out_comm(self, b: object) -> float:
        q, g = self.q, self.graph.graph
        return sum(
            self.out_comm_s[node] for node in q.members[b] if any(q.block_of[v] != b for v in g.successors(node))
        )


def _merge_repeated_modules(graph: CostGraph, merger: _Merger, weight: Mapping[str, float], cap: float) -> None:
    """Step 3: contract whole module instances of repeated classes that fit ``cap``."""
    modules: dict[str, list[str]] = defaultdict(list)
    class_of: dict[str, str | None] = {}
    for node, attrs in graph.graph.nodes(data=True):
        for path, cls in _module_prefixes(attrs["scope"], attrs["scope_types"]):
            modules[path].append(node)
            class_of.setdefault(path, cls)
    instances: dict[str | None, int] = defaultdict(int)
    for cls in class_of.values():
        instances[cls] += 1
    children: dict[str, list[str]] = defaultdict(list)
    for path in modules:
        if path:
            children[_parent(path, modules)].append(path)

    def repeated(path: str) -> bool:
        cls = class_of[path]
        if cls is None:  # no class names to go by: items of a ModuleList are the repeats
            return path.rsplit(".", 1)[-1].isdigit()
        return instances[cls] > 1

    module_cost = {path: sum(weight[n] for n in nodes) for path, nodes in modules.items()}
    stack = [""]
    while stack:
        path = stack.pop()
        if path and module_cost[path] <= cap and (repeated(path) or not children[path]):
            blocks = merger.ordered(merger.q.block_of[n] for n in modules[path])
            if sum(merger.cost[b] for b in blocks) <= cap and merger.contract(blocks) is not None:
                continue
        stack.extend(children[path])


def _merge_until_cco(merger: _Merger, cap: float) -> None:
    """Step 4: smallest block first, merge with a producer until compute ≥ its outgoing transfer."""
    q, cost = merger.q, merger.cost
    heap = [(cost[b], i, b) for i, b in enumerate(q.blocks())]
    heapq.heapify(heap)
    counter = len(heap)
    while heap:
        c, _, b = heapq.heappop(heap)
        if b not in q.members or cost[b] != c or merger.out_comm(b) <= cost[b]:
            continue
        new = merger.absorb(b, limit=max(cap, 2 * cost[b]), prefer="pred")
        if new is not None:
            counter += 1
            heapq.heappush(heap, (cost[new], counter, new))


def _grow_to(merger: _Merger, count: int) -> None:
    """Step 5: the lightest block joins its lightest neighbour until ``count`` blocks remain."""
    q, cost = merger.q, merger.cost
    heap = [(cost[b], i, b) for i, b in enumerate(q.blocks())]
    heapq.heapify(heap)
    counter = len(heap)
    while len(q) > count and heap:
        c, _, b = heapq.heappop(heap)
        if b not in q.members or cost[b] != c:
            continue
        traffic = merger.traffic(b)
        for n in sorted(merger.ordered((*q.pred[b], *q.succ[b])), key=lambda n: (cost[n], -traffic.get(n, 0))):
            new = merger.contract({b, n})
            if new is not None:
                counter += 1
                heapq.heappush(heap, (cost[new], counter, new))
                break


def _module_prefixes(scope: str, scope_types: Sequence[str]) -> list[tuple[str, str | None]]:
    """(module path, class name) of every module enclosing an op, outermost first, root excluded.

    ``scope_types`` names the module stack but skips containers (``ModuleList``): a path
    component followed by an index is such a container. When the two do not line up (a
    ``ModuleDict``), the class names are left out (``None``).
    """
    if not scope:
        return []
    parts = scope.split(".")
    paths = [".".join(parts[: i + 1]) for i in range(len(parts)) if i + 1 == len(parts) or not parts[i + 1].isdigit()]
    classes: Sequence[str | None] = scope_types[1:]
    if len(classes) != len(paths):
        classes = [None] * len(paths)
    return list(zip(paths, classes))


def _parent(path: str, modules: Mapping[str, object]) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return ""
