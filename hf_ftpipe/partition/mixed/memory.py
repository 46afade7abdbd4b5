"""A quick memory model of blocks on a GPU, for assignment: `estimate`'s terms, per block.

`estimate` needs finished stages; assignment has only blocks. Each block is charged as if it were
a stage at its likely stage index (from where it fell in the last plan, or from its share of
the compute before it): weights × the versions the schedule keeps there, gradients, optimizer
state, and activations — every micro-batch in flight, or with recomputation the inputs of each
in-flight micro-batch plus one micro-batch's saved tensors. A weight read by several blocks of a
GPU is counted once, with the most versions any of them keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partition.estimate import MemoryOptions, in_flight, optimizer_state_bytes, saved_bytes, weight_versions

__all__ = ["BlockMemory"]


class BlockMemory:
    """``memory_of(gpu, blocks)``: predicted bytes of a GPU holding ``blocks`` (indices)."""

    def __init__(
        self,
        graph: CostGraph,
        blocks: Sequence[Sequence[str]],
        *,
        schedule: str,
        optimizer: str,
        num_microbatches: int,
        memory: MemoryOptions,
    ) -> None:
        self.graph = graph
        self.schedule, self.num_microbatches, self.memory = schedule, num_microbatches, memory
        block_of = {n: b for b, nodes in enumerate(blocks) for n in nodes}
        g = graph.graph
        self.params = [graph.params_of(nodes) for nodes in blocks]
        self.saved = [sum(saved_bytes(graph, n) for n in nodes) for nodes in blocks]
        self.inputs = [
            sum(g.nodes[u]["output_bytes"] for u in {u for n in nodes for u in g.predecessors(n) if block_of[u] != b})
            for b, nodes in enumerate(blocks)
        ]
        self.fixed = {}  # gradient + optimizer state, once per parameter
        for name, info in graph.params.items():
            self.fixed[name] = (
                info.bytes + optimizer_state_bytes(optimizer, info.shape, info.bytes) if info.requires_grad else 0
            )
        self.versions = [1] * len(blocks)
        self.activations = list(self.saved)
        self.scale = [1.0]

    def place(self, stage_of_block: Sequence[int], num_stages: int) -> None:
        """Charge each block as stage ``stage_of_block[b]`` of ``num_stages``."""
        m, options = self.num_microbatches, self.memory
        for b, s in enumerate(stage_of_block):
            s = min(max(s, 0), num_stages - 1)
            held = in_flight(self.schedule, s, num_stages, m)
            self.versions[b] = weight_versions(
                self.schedule,
                s,
                num_stages,
                num_microbatches=m,
                gradient_accumulation_steps=options.gradient_accumulation_steps,
            )
            if options.recompute:
                self.activations[b] = self.saved[b] + self.inputs[b] * held
            else:
                self.activations[b] = self.saved[b] * held

    def __call__(self, gpu: int, blocks: Sequence[int]) -> float:
        versions: dict[str, int] = {}
        for b in blocks:
            for name in self.params[b]:
                if versions.get(name, 0) < self.versions[b]:
                    versions[name] = self.versions[b]
        params = self.graph.params
        weights = sum(params[p].bytes * v + self.fixed[p] for p, v in versions.items())
        return weights + sum(self.activations[b] for b in blocks)
