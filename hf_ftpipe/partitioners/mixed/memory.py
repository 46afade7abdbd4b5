"""A quick memory model of blocks on a GPU, for assignment: `estimate`'s terms, per block.

`estimate` needs finished stages; assignment has only blocks. Each block is charged as if it were
the stage it fell in in the last plan, with that plan's stage → GPU map; before any plan, as
stage g of a contiguous plan with one stage per GPU, g from its share of the compute before it.
The charge follows `memory_rules`: weights × the versions the schedule keeps there, optimizer
state, gradients where they persist, what the block keeps per micro-batch (saved activations, or
with recomputation its inputs, and the values that leave it) × the micro-batches in flight, and
once per GPU what its largest backward adds (blocks charged as the same stage add up there). A
weight read by several blocks of a GPU is counted once, with the most versions any of them keeps.
When every block is a whole stage this is `estimate`'s figure exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.costmodel import memory_rules
from hf_ftpipe.costmodel.estimate import MemoryOptions
from hf_ftpipe.graph.cost_graph import CostGraph

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
        self.saved = [sum(memory_rules.saved_bytes(graph, n) for n in nodes) for nodes in blocks]
        inputs = [
            sum(g.nodes[u]["output_bytes"] for u in {u for n in nodes for u in g.predecessors(n) if block_of[u] != b})
            for b, nodes in enumerate(blocks)
        ]
        kept = [memory_rules.kept_output_bytes(graph, nodes, block_of) for nodes in blocks]
        self.per_microbatch = [k + (i if memory.recompute else s) for k, i, s in zip(kept, inputs, self.saved)]
        """What a block keeps per micro-batch in flight."""
        self.operand = [memory_rules.largest_operand_bytes(graph, nodes) for nodes in blocks]
        self.state = {}  # optimizer state, once per parameter
        for name, info in graph.params.items():
            self.state[name] = (
                memory_rules.optimizer_state_bytes(optimizer, info.shape, info.bytes) if info.requires_grad else 0
            )
        # Until `place`: every block its own stage, one micro-batch, one weight version, gradients kept.
        self.stage = list(range(len(blocks)))
        self.versions = [1] * len(blocks)
        self.persist = [True] * len(blocks)
        self.held = list(self.per_microbatch)

    def place(self, stage_of_block: Sequence[int], stage_device: Sequence[int]) -> None:
        """Charge each block as stage ``stage_of_block[b]`` of a plan with ``stage_device``
        (stage index → GPU index)."""
        for b, s in enumerate(stage_of_block):
            s = min(max(s, 0), len(stage_device) - 1)
            rules = memory_rules.stage_rules(
                self.schedule,
                s,
                stage_device,
                self.num_microbatches,
                gradient_accumulation_steps=self.memory.gradient_accumulation_steps,
                recompute=self.memory.recompute,
            )
            self.stage[b] = s
            self.versions[b], self.persist[b] = rules.versions, rules.persist
            self.held[b] = self.per_microbatch[b] * rules.in_flight

    def __call__(self, gpu: int, blocks: Sequence[int]) -> float:
        params = self.graph.params
        versions: dict[str, int] = {}
        persist: dict[str, bool] = {}
        stages: dict[int, tuple[int, int, set[str]]] = {}  # stage → saved, largest operand, params
        for b in blocks:
            for name in self.params[b]:
                if versions.get(name, 0) < self.versions[b]:
                    versions[name] = self.versions[b]
                persist[name] = persist.get(name, False) or self.persist[b]
            saved, operand, names = stages.get(self.stage[b], (0, 0, set()))
            stages[self.stage[b]] = (saved + self.saved[b], max(operand, self.operand[b]), names | self.params[b])
        weights = sum(
            params[p].bytes * memory_rules.weight_versions_of(params[p].requires_grad, params[p].is_buffer, v)
            + self.state[p]
            + (params[p].bytes if persist[p] and params[p].requires_grad else 0)
            for p, v in versions.items()
        )
        persist_of_stage = {self.stage[b]: self.persist[b] for b in blocks}
        backward = max(
            (
                memory_rules.backward_bytes(
                    persist=persist_of_stage[s],
                    largest_operand=operand,
                    gradients=sum(params[p].bytes for p in names if params[p].requires_grad),
                    saved=saved,
                    recomputed=saved if self.memory.recompute else 0,
                )
                for s, (saved, operand, names) in stages.items()
            ),
            default=0,
        )
        return weights + sum(self.held[b] for b in blocks) + backward
