"""A quick memory model of blocks on a GPU, for assignment: `estimate`'s terms, per block.

`estimate` needs finished stages; assignment has only blocks. Each block is charged as if it were
the stage it fell in in the last plan, with that plan's stage → GPU map; before any plan, as
stage g of a contiguous plan with one stage per GPU, g from its share of the compute before it.
The charge: weights × the versions the schedule keeps there, gradients, optimizer state, and
activations — every micro-batch in flight (`estimate.in_flight`: one per stage from the block's
stage to the end), or with recomputation the inputs of each in-flight micro-batch, plus once per
GPU the saved tensors of one micro-batch of its largest stage (blocks charged as the same stage
add up). A weight read by several blocks of a GPU is counted once, with the most versions any of
them keeps. When every block is a whole stage this is `estimate`'s figure exactly.
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
        # Until `place`: every block its own stage, one micro-batch, one weight version.
        self.recompute = memory.recompute
        self.stage = list(range(len(blocks)))
        self.versions = [1] * len(blocks)
        self.held = list(self.inputs if memory.recompute else self.saved)

    def place(self, stage_of_block: Sequence[int], stage_device: Sequence[int]) -> None:
        """Charge each block as stage ``stage_of_block[b]`` of a plan with ``stage_device``
        (stage index → GPU index)."""
        m, options = self.num_microbatches, self.memory
        for b, s in enumerate(stage_of_block):
            s = min(max(s, 0), len(stage_device) - 1)
            self.stage[b] = s
            held = in_flight(self.schedule, s, stage_device, m)
            self.versions[b] = weight_versions(
                self.schedule,
                s,
                stage_device,
                num_microbatches=m,
                gradient_accumulation_steps=options.gradient_accumulation_steps,
            )
            self.held[b] = (self.inputs[b] if options.recompute else self.saved[b]) * held

    def __call__(self, gpu: int, blocks: Sequence[int]) -> float:
        versions: dict[str, int] = {}
        for b in blocks:
            for name in self.params[b]:
                if versions.get(name, 0) < self.versions[b]:
                    versions[name] = self.versions[b]
        params = self.graph.params
        weights = sum(params[p].bytes * v + self.fixed[p] for p, v in versions.items())
        activations = sum(self.held[b] for b in blocks)
        if self.recompute and blocks:  # the GPU recomputes one stage at a time: the largest counts
            per_stage: dict[int, int] = {}
            for b in blocks:
                per_stage[self.stage[b]] = per_stage.get(self.stage[b], 0) + self.saved[b]
            activations += max(per_stage.values())
        return weights + activations
