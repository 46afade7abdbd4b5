"""Mixed-Pipe step 2: blocks to GPUs balancing compute under memory, then blocks to stages.

FTPipe (ATC'21, "Initial Assignment: assign stages to P GPUs (s.t. memory constraint hold)
while optimizing load balance"). Here:

1. Heaviest block first, each to the least-loaded GPU whose memory still fits (LPT).
2. Improve: move one block off the worst GPU, or swap a block of it with a lighter one of
   another GPU, while the worst load drops (or stays and the loads spread less).
3. Stages: walk the blocks in topological order; a block joins a stage of its GPU (latest first)
   unless that closes a cycle in the stage graph, else it opens a new stage. The stages are then
   numbered in a topological order of the stage graph, which the runtime requires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

__all__ = ["assign_blocks", "contiguous_blocks", "form_stages"]

MemoryOf = Callable[[int, Sequence[int]], float]
"""(gpu, block indices) → predicted memory bytes of the GPU holding those blocks."""


def assign_blocks(
    block_cost: Sequence[float], num_gpus: int, memory_of: MemoryOf, budget: Sequence[float]
) -> list[int] | None:
    """Block index → GPU, or ``None`` when some block fits no GPU's ``budget``."""
    on: list[list[int]] = [[] for _ in range(num_gpus)]
    load = [0.0] * num_gpus
    for b in sorted(range(len(block_cost)), key=lambda b: -block_cost[b]):
        for g in sorted(range(num_gpus), key=lambda g: (load[g], g)):
            if memory_of(g, [*on[g], b]) <= budget[g]:
                on[g].append(b)
                load[g] += block_cost[b]
                break
        else:
            return None
    _improve(block_cost, on, load, memory_of, budget)
    gpu = [0] * len(block_cost)
    for g, blocks in enumerate(on):
        for b in blocks:
            gpu[b] = g
    return gpu


def contiguous_blocks(block_cost: Sequence[float], num_gpus: int) -> list[int]:
    """Block index → GPU for contiguous runs of blocks of about equal cost (Seq-Pipe's shape)."""
    total, gpu, running = sum(block_cost), [], 0.0
    for cost in block_cost:
        gpu.append(min(num_gpus - 1, int((running + cost / 2) * num_gpus / total)) if total > 0 else 0)
        running += cost
    return gpu


def _improve(
    cost: Sequence[float], on: list[list[int]], load: list[float], memory_of: MemoryOf, budget: Sequence[float]
) -> None:
    def key(loads: list[float]) -> tuple[float, float]:
        return max(loads), sum(x * x for x in loads)

    for _ in range(20 * len(cost)):
        worst = max(range(len(load)), key=load.__getitem__)
        current = key(load)
        improving = []
        for h in range(len(load)):
            if h == worst:
                continue
            for b, d in [(b, None) for b in on[worst]] + [(b, d) for b in on[worst] for d in on[h]]:
                delta = cost[b] - (cost[d] if d is not None else 0.0)
                trial = list(load)
                trial[worst] -= delta
                trial[h] += delta
                if delta > 0 and key(trial) < current:
                    improving.append((key(trial), h, b, d, trial))
        for _, h, b, d, trial in sorted(improving, key=lambda option: option[0]):
            new_worst = [x for x in on[worst] if x != b] + ([d] if d is not None else [])
            new_h = [x for x in on[h] if x != d] + [b]
            if new_worst and memory_of(worst, new_worst) <= budget[worst] and memory_of(h, new_h) <= budget[h]:
                on[worst], on[h], load[:] = new_worst, new_h, trial
                break
        else:
            return


def form_stages(block_gpu: Sequence[int], block_pred: Sequence[set[int]]) -> tuple[list[int], list[int]]:
    """(block → stage, stage → GPU) with stages numbered topologically.

    ``block_pred[b]`` are the producer blocks of ``b``; block indices are a topological order.
    """
    stages = nx.DiGraph()
    stage_gpu: list[int] = []
    block_stage: list[int] = []
    stages_of: dict[int, list[int]] = {}
    for b, g in enumerate(block_gpu):
        producers = {block_stage[p] for p in block_pred[b]}
        chosen = None
        for x in reversed(stages_of.get(g, [])):
            if not any(t != x and nx.has_path(stages, x, t) for t in producers):
                chosen = x
                break
        if chosen is None:
            chosen = len(stage_gpu)
            stage_gpu.append(g)
            stages.add_node(chosen)
            stages_of.setdefault(g, []).append(chosen)
        block_stage.append(chosen)
        stages.add_edges_from((t, chosen) for t in producers if t != chosen)
    first_block = {}
    for b, s in enumerate(block_stage):
        first_block.setdefault(s, b)
    order = list(nx.lexicographical_topological_sort(stages, key=first_block.__getitem__))
    number = {s: i for i, s in enumerate(order)}
    return [number[s] for s in block_stage], [stage_gpu[s] for s in order]
