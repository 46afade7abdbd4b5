"""FTPipe's objective kept up to date move by move, so refinement never re-estimates a whole plan.

Mirrors `estimate.estimate` (DESIGN.md, "Cost of a GPU"): a GPU's compute C_g, the forward
messages its stages send to stages on other GPUs and the gradients that come back, one message
per stage pair holding each producer's output once, so ``cost_g = C_g + max(0, F_g − C_g) +
max(0, B_g − C_g)``. Moving one atom only touches the messages of its ops and of their
producers, which are subtracted, moved and added back.

Memory follows `estimate` too (the terms of `memory_rules`), for the stage numbering refinement
keeps: each weight once per GPU with the most versions any of the GPU's stages that read it keeps,
plus its optimizer state and, where it persists for one of them, its gradient; each stage's saved
activations (with recomputation its inputs) and the values that leave it, times its micro-batches
in flight (one per stage from it to the end, as `in_flight`); and, once per GPU, what its largest
backward adds: the working tensors, the saved activations it recomputes, the gradients that do not
persist. Per stage the values that leave it, its gradient bytes and its largest operand are kept
up to date move by move like the rest.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from hf_ftpipe.costmodel.estimate import MemoryOptions, gpu_cost_s
from hf_ftpipe.costmodel.memory_rules import (
    backward_bytes,
    largest_operand_bytes,
    optimizer_state_bytes,
    saved_bytes,
    stage_rules,
    weight_versions_of,
)
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["IncrementalCost"]


class IncrementalCost:
    """Per-GPU compute, communication and memory proxy of an atom → stage → GPU plan."""

    def __init__(
        self,
        graph: CostGraph,
        profile: GPUProfile,
        atoms: Sequence[Sequence[str]],
        atom_stage: list[int],
        stage_device: Sequence[int],
        weight: Mapping[str, float],
        *,
        schedule: str,
        optimizer: str,
        num_microbatches: int,
        memory: MemoryOptions,
        limit: Sequence[float],
    ) -> None:
        self.graph, self.profile, self.atoms = graph, profile, atoms
        self.atom_stage, self.stage_device = atom_stage, list(stage_device)
        self.atom_of = {n: a for a, nodes in enumerate(atoms) for n in nodes}
        self.limit = list(limit)
        num_gpus, num_stages = max(self.stage_device) + 1, len(self.stage_device)
        self.stages_of = [[s for s, d in enumerate(self.stage_device) if d == g] for g in range(num_gpus)]
        # Counted once, over all stages: a stage that refinement empties still adds to the depth
        # of the stages before it until the plan is rebuilt without it, which can only lower the
        # estimate's figure.
        rules = [
            stage_rules(
                schedule,
                s,
                self.stage_device,
                num_microbatches,
                gradient_accumulation_steps=memory.gradient_accumulation_steps,
                recompute=memory.recompute,
            )
            for s in range(num_stages)
        ]
        self.versions = [r.versions for r in rules]
        self.persist = [r.persist for r in rules]
        self.held = [r.in_flight for r in rules]
        self.recompute = memory.recompute
        self.state = {
            name: optimizer_state_bytes(optimizer, info.shape, info.bytes) if info.requires_grad else 0
            for name, info in graph.params.items()
        }
        self.outputs = set(graph.outputs)
        self.compute = [0.0] * num_gpus
        self.fwd = [0.0] * num_gpus
        self.bwd = [0.0] * num_gpus
        self.weights = [0] * num_gpus  # weights × versions + optimizer state + persisting gradients
        self.saved = [0] * num_stages
        self.inputs = [0] * num_stages
        self.kept = [0] * num_stages  # bytes of values that leave the stage, per micro-batch
        self.grads = [0] * num_stages  # gradient bytes of the stage's distinct trainable parameters
        self.operands: list[dict[int, int]] = [defaultdict(int) for _ in range(num_stages)]  # size → atoms
        self._largest: list[int | None] = [None] * num_stages
        self.atom_weight = [sum(weight[n] for n in nodes) for nodes in atoms]
        self.atom_saved = [sum(saved_bytes(graph, n) for n in nodes) for nodes in atoms]
        self.atom_params = [graph.params_of(nodes) for nodes in atoms]
        self.atom_operand = [largest_operand_bytes(graph, nodes) for nodes in atoms]
        self.atoms_of_gpu: list[set[int]] = [set() for _ in range(num_gpus)]
        self.param_count: list[dict[str, int]] = [defaultdict(int) for _ in range(num_stages)]
        self.pair_fwd: dict[tuple[int, int], int] = defaultdict(int)
        self.pair_grad: dict[tuple[int, int], int] = defaultdict(int)
        self._link = (profile.link_latency_s, profile.link_bandwidth_bytes_per_s)
        self._channels = ((self.pair_fwd, self.fwd), (self.pair_grad, self.bwd))
        self._memory: list[float | None] = [None] * num_gpus  # memory(g), until a move touches g
        self._index_graph(graph, atoms)
        for a in range(len(atoms)):
            self._place(a, +1)
        for node in graph.graph:
            self._producer(node, +1)

    def _index_graph(self, graph: CostGraph, atoms: Sequence[Sequence[str]]) -> None:
        """What a move reads of the graph, looked up once: refinement tries some 10⁵ moves, and
        networkx's views cost more than the arithmetic they feed."""
        g, atom_of = graph.graph, self.atom_of
        # per op: its atom, its output's bytes, whether it carries a gradient, the atoms reading it (first
        # reader first, so that the set of their stages is built in the order the edges give)
        self._producer_of = {
            u: (
                atom_of[u],
                attrs["output_bytes"],
                attrs["requires_grad"],
                tuple(dict.fromkeys(atom_of[v] for v in g.successors(u))),
                u in self.outputs,
            )
            for u, attrs in g.nodes(data=True)
        }
        # per atom: the ops whose messages its move changes, those of no bytes left out (an ordered
        # set: floating-point sums must not depend on PYTHONHASHSEED), and the other atoms it
        # reads from and is read by
        self._producers = [
            tuple(
                u
                for u in dict.fromkeys([*(u for n in nodes for u in g.predecessors(n)), *nodes])
                if self._producer_of[u][1]
            )
            for nodes in atoms
        ]
        self._reads = [{atom_of[u] for n in nodes for u in g.predecessors(n)} - {a} for a, nodes in enumerate(atoms)]
        self._read_by = [{atom_of[v] for n in nodes for v in g.successors(n)} - {a} for a, nodes in enumerate(atoms)]

    # -- queries ---------------------------------------------------------------------------------

    def gpu_of_atom(self, a: int) -> int:
        return self.stage_device[self.atom_stage[a]]

    def costs(self) -> list[float]:
        return [gpu_cost_s(c, f, b) for c, f, b in zip(self.compute, self.fwd, self.bwd)]

    def key(self) -> tuple[float, float, float, float]:
        """What refinement minimises: memory over the limits, the worst GPU, the spread of the
        GPU costs, all communication."""
        costs = self.costs()
        return self.overflow(), max(costs), sum(c * c for c in costs), sum(self.fwd) + sum(self.bwd)

    def memory(self, g: int) -> float:
        cached = self._memory[g]
        if cached is None:
            cached = self._memory[g] = self._memory_of(g)
        return cached

    def _memory_of(self, g: int) -> float:
        stages = self.stages_of[g]
        per_microbatch = self.inputs if self.recompute else self.saved
        held = sum((self.kept[s] + per_microbatch[s]) * self.held[s] for s in stages)
        backward = 0  # one backward at a time: the largest
        for s in stages:
            backward = max(
                backward,
                backward_bytes(
                    persist=self.persist[s],
                    largest_operand=self._largest_operand(s),
                    gradients=self.grads[s],
                    saved=self.saved[s],
                    recomputed=self.saved[s] if self.recompute else 0,
                ),
            )
        return self.weights[g] + held + backward

    def _largest_operand(self, s: int) -> int:
        if self._largest[s] is None:
            self._largest[s] = max(self.operands[s], default=0)
        return self._largest[s]

    def overflow(self) -> float:
        """Bytes by which GPUs exceed their ``limit``, summed (0 for a plan that fits)."""
        return sum(max(0.0, self.memory(g) - self.limit[g]) for g in range(len(self.limit)))

    def stage_range(self, a: int) -> tuple[int, int]:
        """Stages ``a`` may move to while the numbering stays topological: [last producer
        stage, first consumer stage]."""
        atom_stage, lo, hi = self.atom_stage, 0, len(self.stage_device) - 1
        for b in self._reads[a]:
            if atom_stage[b] > lo:
                lo = atom_stage[b]
        for b in self._read_by[a]:
            if atom_stage[b] < hi:
                hi = atom_stage[b]
        return lo, hi

    # -- the move --------------------------------------------------------------------------------

    def move(self, a: int, stage: int) -> None:
        """Put atom ``a`` in ``stage``; a second ``move`` back undoes it exactly."""
        producers = self._producers[a]
        for u in producers:
            self._producer(u, -1)
        self._place(a, -1)
        self.atom_stage[a] = stage
        self._place(a, +1)
        for u in producers:
            self._producer(u, +1)

    def _place(self, a: int, sign: int) -> None:
        s = self.atom_stage[a]
        d = self.stage_device[s]
        self._memory[d] = None
        self.compute[d] += sign * self.atom_weight[a]
        self.saved[s] += sign * self.atom_saved[a]
        if sign > 0:
            self.atoms_of_gpu[d].add(a)
        else:
            self.atoms_of_gpu[d].discard(a)
        operands = self.operands[s]
        operands[self.atom_operand[a]] += sign
        if not operands[self.atom_operand[a]]:
            del operands[self.atom_operand[a]]
        self._largest[s] = None
        counts = self.param_count[s]
        for p in self.atom_params[a]:
            before = self._param_bytes(d, p)
            counts[p] += sign
            self.weights[d] += self._param_bytes(d, p) - before
            info = self.graph.params[p]
            # the stage's first reader of p came, or its last one left
            if info.requires_grad and counts[p] == (1 if sign > 0 else 0):
                self.grads[s] += sign * info.bytes

    def _param_bytes(self, g: int, p: str) -> int:
        readers = [s for s in self.stages_of[g] if self.param_count[s][p] > 0]
        if not readers:
            return 0
        info = self.graph.params[p]
        gradient = info.bytes if info.requires_grad and any(self.persist[s] for s in readers) else 0
        versions = weight_versions_of(info.requires_grad, info.is_buffer, max(self.versions[s] for s in readers))
        return info.bytes * versions + self.state[p] + gradient

    def _producer(self, u: str, sign: int) -> None:
        atom, size, requires_grad, readers, is_output = self._producer_of[u]
        if size == 0:
            return
        atom_stage, stage_device, stale = self.atom_stage, self.stage_device, self._memory
        s = atom_stage[atom]
        d = stage_device[s]
        if len(readers) == 1:  # most values: one reader, no set to build
            t = atom_stage[readers[0]]
            targets: Collection[int] = () if t == s else (t,)
        else:  # the sums below follow the set's order: build it exactly as ever
            targets = {atom_stage[b] for b in readers} - {s}
        if targets or is_output:
            self.kept[s] += sign * size
            stale[d] = None
        if not targets:
            return
        latency, bandwidth = self._link
        # (pairs, per GPU): the forward message, and the gradient coming back for a trainable value
        channels = self._channels if requires_grad else self._channels[:1]
        change = sign * size
        for t in targets:
            self.inputs[t] += change
            stale[stage_device[t]] = None
            if stage_device[t] != d:
                for pairs, per_gpu in channels:
                    # comm_time_s inlined: this runs for every edge of every tried move.
                    before = pairs[s, t]
                    after = before + change
                    pairs[s, t] = after
                    delta = ((latency + after / bandwidth) if after else 0.0) - (
                        (latency + before / bandwidth) if before else 0.0
                    )
                    per_gpu[d] += delta
