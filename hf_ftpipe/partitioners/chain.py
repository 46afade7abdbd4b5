"""Seq-dp's chain: the execution order cut into blocks, and every figure of a candidate stage [a, b).

The tables of step 2 of ``seq_dp``'s algorithm and the dynamic program of step 3 over them. What
they say contiguous splits can do within a GPU's memory is ``split_fit``'s.

Above ``contiguous`` and below ``split_fit``, ``fit`` and the partitioners: it imports no partitioner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hf_ftpipe.costmodel.memory_rules import (
    StageRules,
    operand_bytes,
    optimizer_state_bytes,
    saved_bytes,
    stage_rules,
    weight_gradient_bytes,
    weight_versions_of,
    weights_only_w_computes,
)
from hf_ftpipe.costmodel.op_time import NodeCost
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.partitioners.contiguous import ContiguousPlanner, greedy_cuts
from hf_ftpipe.schedules.rules import Moments, stage_moments

__all__ = ["Chain"]

SEQ_DP = "seq-dp"
"""The partitioner whose chain this is: ``contiguous_fit``'s figures hold for it."""


@dataclass
class _Tables:
    """Figures of every candidate stage [a, b) of blocks, as (B + 1) × (B + 1) arrays."""

    cost_s: np.ndarray
    weights: np.ndarray
    """Distinct parameter and buffer bytes (one weight version), frozen parameters left out."""
    frozen: np.ndarray
    """Distinct frozen parameter bytes: one version under every schedule (`weight_versions_of`)."""
    grads: np.ndarray
    """Gradient bytes of the distinct trainable parameters."""
    state: np.ndarray
    """Optimizer state of the distinct trainable parameters."""
    saved: np.ndarray
    """Activation bytes of one micro-batch."""
    inputs: np.ndarray
    """Bytes of the values the stage reads from earlier stages (kept under recomputation)."""
    kept: np.ndarray
    """Bytes of the values that leave the stage (read later, or outputs of the model)."""
    weight_kept: np.ndarray
    """What a split backward keeps of one micro-batch from B to W (`memory_rules.weight_gradient_bytes`)."""
    deferred: np.ndarray
    """Gradients only the stage's ``W`` creates, absent before its first ``W`` of a step (none
    with gradient accumulation: `StageMemory.deferred_gradients`)."""
    largest_operand: np.ndarray
    """The largest ``operand_bytes`` of the stage's ops."""


class Chain:
    """The coarsened execution order and the tables of its candidate stages."""

    def __init__(self, planner: ContiguousPlanner, max_blocks: int, starts: list[int] | None = None) -> None:
        self.request = request = planner.request
        graph, costs, cut_order = planner.graph, planner.costs, planner.cut_order
        options = request.memory
        item = {n: i for i, n in enumerate(cut_order.cuttable)}
        pos = {n: item[cut_order.anchor[n]] for n in cut_order.order}
        forward_again = 1.0 if options.recompute else 0.0

        def compute_of(costs: dict[str, NodeCost]) -> np.ndarray:
            compute = np.zeros(len(item))
            for n in cut_order.order:
                compute[pos[n]] += costs[n].total_s + forward_again * costs[n].forward_s
            return compute

        compute = compute_of(costs)

        # Blocks of about equal compute; every op alone when there are few.
        if starts is not None:
            self.starts = starts
        elif len(item) <= max_blocks:
            self.starts = list(range(len(item) + 1))
        else:
            weights = compute.tolist() if compute.sum() > 0 else [1.0] * len(item)
            self.starts = [0, *greedy_cuts(weights, max_blocks), len(item)]
        num_blocks = len(self.starts) - 1
        block_of_item = np.repeat(np.arange(num_blocks), np.diff(self.starts))
        block = {n: int(block_of_item[pos[n]]) for n in cut_order.order}
        self.num_blocks = num_blocks
        self._walks: dict[int, list[Moments] | None] = {}

        saved = np.zeros(num_blocks)
        weight_kept = np.zeros(num_blocks)
        operand = np.zeros(num_blocks)
        for n in cut_order.order:
            saved[block[n]] += saved_bytes(graph, n)
            weight_kept[block[n]] += weight_gradient_bytes(graph, [n])
            operand[block[n]] = max(operand[block[n]], operand_bytes(graph, n))
        saved_prefix = np.concatenate([[0.0], np.cumsum(saved)])
        weight_kept_prefix = np.concatenate([[0.0], np.cumsum(weight_kept)])
        largest_operand = np.zeros((num_blocks + 1, num_blocks + 1))
        for a in range(num_blocks):
            largest_operand[a, a + 1 :] = np.maximum.accumulate(operand[a:])

        out_bytes, grad_bytes, in_bytes = _Rectangles(num_blocks), _Rectangles(num_blocks), _Rectangles(num_blocks)
        kept = _Rectangles(num_blocks)
        model_outputs = set(graph.outputs)
        for u in cut_order.order:
            p = block[u]
            readers = sorted({block[v] for v in graph.graph.successors(u)} - {p})
            readers = [c for c in readers if c > p]
            size = graph.node(u)["output_bytes"]
            if u in model_outputs:  # kept by every stage that holds it
                kept.add(0, p, p + 1, num_blocks, size)
            elif readers:
                kept.add(0, p, p + 1, readers[-1], size)
            if not readers:
                continue
            out_bytes.add(0, p, p + 1, readers[-1], size)  # leaves every [a, b) with a ≤ p < b ≤ q
            if graph.node(u)["requires_grad"]:
                grad_bytes.add(0, p, p + 1, readers[-1], size)
            previous = p
            for c in readers:  # [a, b) with a > p reads it when its first reader ≥ a is < b
                in_bytes.add(previous + 1, c, c + 1, num_blocks, size)
                previous = c

        uses: dict[str, set[int]] = {}
        for n in cut_order.order:
            for name in graph.node(n)["params"]:
                uses.setdefault(name, set()).add(block[n])
        weights_t, grads_t, state_t = _Rectangles(num_blocks), _Rectangles(num_blocks), _Rectangles(num_blocks)
        frozen_t, deferred_t = _Rectangles(num_blocks), _Rectangles(num_blocks)
        only_w = weights_only_w_computes(graph) if options.gradient_accumulation_steps == 1 else set()
        for name, blocks in uses.items():
            info = graph.params[name]
            if name in only_w:  # the stage holds every reader
                deferred_t.add(0, min(blocks), max(blocks) + 1, num_blocks, info.bytes)
            state = optimizer_state_bytes(request.optimizer, info.shape, info.bytes)
            previous = -1
            versioned = weight_versions_of(info.requires_grad, info.is_buffer, 2) == 2  # frozen: one copy
            for x in sorted(blocks):  # [a, b) holds it when its first use ≥ a is < b
                (weights_t if versioned else frozen_t).add(previous + 1, x, x + 1, num_blocks, info.bytes)
                if info.requires_grad:
                    grads_t.add(previous + 1, x, x + 1, num_blocks, info.bytes)
                    state_t.add(previous + 1, x, x + 1, num_blocks, state)
                previous = x

        out_s, grad_s = (_comm_s(r.table(), request.profile) for r in (out_bytes, grad_bytes))

        def cost_table(compute: np.ndarray) -> np.ndarray:
            prefix = np.concatenate([[0.0], np.cumsum(np.bincount(block_of_item, compute, num_blocks))])
            compute_s = prefix[None, :] - prefix[:, None]
            return compute_s + np.maximum(0.0, out_s - compute_s) + np.maximum(0.0, grad_s - compute_s)

        # GPUs of several kinds: a table per kind (GPUs of one kind share their costs' dict)
        by_kind: dict[int, np.ndarray] = {}
        for gpu_costs in planner.gpu_costs or ():
            if id(gpu_costs) not in by_kind:
                by_kind[id(gpu_costs)] = cost_table(compute_of(gpu_costs))
        self.gpu_cost_s = [by_kind[id(c)] for c in planner.gpu_costs] if planner.gpu_costs else None
        """With GPUs of several kinds, `_Tables.cost_s` on each GPU; else None."""
        self.tables = _Tables(
            cost_s=cost_table(compute),
            weights=weights_t.table(),
            frozen=frozen_t.table(),
            grads=grads_t.table(),
            state=state_t.table(),
            saved=saved_prefix[None, :] - saved_prefix[:, None],
            inputs=in_bytes.table(),
            kept=kept.table(),
            weight_kept=weight_kept_prefix[None, :] - weight_kept_prefix[:, None],
            deferred=deferred_t.table(),
            largest_operand=largest_operand,
        )

    def rules(self, depth: int, num_stages: int | None = None) -> StageRules:
        """What the schedule makes a stage ``depth`` stages from the end of a contiguous pipeline keep
        (the last stage has depth 1): in a chain of stages, one per GPU, nothing else matters but,
        for a split backward's W (`StageRules.awaiting_weights`), the number of stages, when given
        (else taken as ``depth``, which counts fewer)."""
        request = self.request
        num_stages = depth if num_stages is None else num_stages
        return stage_rules(
            request.schedule,
            num_stages - depth,
            range(num_stages),  # contiguous: stage s runs on GPU s
            request.num_microbatches,
            gradient_accumulation_steps=request.memory.gradient_accumulation_steps,
            recompute=request.memory.recompute,
        )

    def memory(self, stage_index: int, num_stages: int, b: int) -> np.ndarray:
        """Bytes of the stages [a, b) for every a < b as stage ``stage_index`` of ``num_stages``,
        each at its busiest moment of the schedule's order where the order is fixed by the plan
        (`stage_moments`, on the request's placement: a V's two stages on a GPU, each priced on
        its own, sum to at least what the estimate's walk gives that GPU)."""
        moments = self._moments(num_stages)
        at = (slice(None, b), b)
        rules = self.rules(num_stages - stage_index, num_stages)
        return self._memory(rules, at, None if moments is None else moments[stage_index])

    def _moments(self, num_stages: int) -> list[Moments] | None:
        """`stage_moments` of the plan's own placement, ``num_stages`` stages (one walk per count)."""
        if num_stages not in self._walks:
            request = self.request
            stage_device = request.stage_devices(num_stages)
            self._walks[num_stages] = stage_moments(request.schedule, stage_device, request.num_microbatches)
        return self._walks[num_stages]

    def memory_table(self, depth: int) -> np.ndarray:
        """Bytes of every stage [a, b) (entry [a, b], meaningful for a < b) at ``depth`` from the end,
        by the per-stage rules (the fit advice's figure for any number of stages; `memory` walks)."""
        return self._memory(self.rules(depth), (slice(None), slice(None)))

    def _memory(self, rules: StageRules, at: tuple, moments: Moments | None = None) -> np.ndarray:
        t = self.tables
        recompute = self.request.memory.recompute
        grads, saved = t.grads[at], t.saved[at]
        per_microbatch = t.kept[at] + (t.inputs[at] if recompute else saved)
        # memory_rules.backward_bytes, for every candidate at once
        created = 0.0 if rules.persist else np.maximum(0.0, grads - saved)
        backward = (saved if recompute else 0.0) + 2 * t.largest_operand[at] + created
        params = t.weights[at] * rules.versions + t.frozen[at] + t.state[at] + (grads if rules.persist else 0.0)
        weight_kept = t.weight_kept[at]
        if moments is None:
            return params + per_microbatch * rules.in_flight + weight_kept * rules.awaiting_weights + backward
        # The walk (`StageMemory.of_gpu`): what it holds at each moment, a backward's work on the
        # moment it starts from. Under recomputation W's inputs outweigh what a micro-batch keeps.
        figures = np.stack([per_microbatch, weight_kept, -t.deferred[at]])  # [figure, *candidates]
        held, before_backward = (np.array(m, dtype=np.float64).reshape(-1, 3) for m in moments)  # [moment, count]
        peak = np.tensordot(held, figures, axes=1).max(axis=0)
        if len(before_backward):
            peak = np.maximum(peak, np.tensordot(before_backward, figures, axes=1).max(axis=0) + backward)
        return params + peak

    def piece_memory(self, depth: int) -> np.ndarray:
        """Bytes of each single-block stage [k, k + 1) at ``depth`` from the end (per-stage rules)."""
        blocks = np.arange(self.num_blocks)
        return self._memory(self.rules(depth), (blocks, blocks + 1))

    def fewest_stages(self, capacity: float) -> int | None:
        """The fewest stages of a split that fits ``capacity`` (None: no number of stages fits).

        Exact on the chain, without assuming that more stages need less each (under 1F1B the first
        stages of a longer pipeline hold more micro-batches): a stage's memory depends only on its
        blocks and its depth from the end, so the block positions from which the rest of the chain
        splits into d fitting stages follow from those for d − 1, one depth at a time. d stages
        fit exactly when ``solve(d, capacity)`` finds a split.

        Where the schedule's order prices a stage at its busiest moment (`memory`: zb-h1's split
        backward) rather than by its depth, the rules are a guess that errs either way: zb-h1 keeps
        W's inputs beside the activations in flight, which they leave out (GPT2-XL, 8 GiB GPUs,
        recomputed: 6 by the rules, 8 by the walk), and sums the busiest of each where the walk
        finds them apart. Then ``solve`` decides: from the guess down while one fewer fits, else
        up (from 1 when the rules found no count). A stage's moments depend only on its distances
        from the two ends, each counted up to M, so past 2M + 1 stages cutting a middle stage in two
        leaves every other stage as it was: the counts there are searched by halves, once the split
        into one block a stage says any fits (exact unless the only cuts bring a wider value across).
        """
        guess = self._fewest_by_rules(capacity)
        if self._moments(1) is None:  # priced by depth alone: the rules are exact
            return guess

        def fits(count: int) -> bool:
            return self.solve(count, capacity) is not None

        if guess is not None and fits(guess):
            while guess > 1 and fits(guess - 1):
                guess -= 1
            return guess
        start = 1 if guess is None else guess + 1
        scanned = min(self.num_blocks, max(start, 2 * self.request.num_microbatches + 1))
        first = next((d for d in range(start, scanned + 1) if fits(d)), None)
        if first is not None or scanned == self.num_blocks or not fits(self.num_blocks):
            return first
        low, high = scanned, self.num_blocks  # low does not fit, high does
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle, high)
        return high

    def _fewest_by_rules(self, capacity: float) -> int | None:
        """`fewest_stages` by the per-stage rules (`memory_table`)."""
        num_blocks = self.num_blocks
        ahead = np.triu(np.ones((num_blocks + 1, num_blocks + 1), dtype=bool), k=1)  # stages [a, b), a < b
        reach = np.zeros(num_blocks + 1, dtype=bool)
        reach[num_blocks] = True  # where the stages found so far begin
        rules, fits = None, ahead
        for depth in range(1, num_blocks + 1):
            if self.rules(depth) != rules:  # the rules stop changing once the depth reaches M
                rules = self.rules(depth)
                fits = ahead & (self.memory_table(depth) <= capacity)
            reach = fits[:, reach].any(axis=1)
            if reach[0]:
                return depth
            if not reach.any():
                return None
        return None

    def solve(self, num_stages: int, capacity: float | Sequence[float], *, by_memory: bool = False) -> list[int] | None:
        """Block boundaries ``[0, ..., B]`` of the best split, or None when nothing fits.

        ``capacity``: one for every stage, or one per stage (GPUs of several kinds); with GPUs of
        several kinds each stage is timed on its own GPU (stage s on GPU s).
        ``by_memory``: minimise the largest stage memory instead, ignoring ``capacity``.
        """
        capacities = [capacity] * num_stages if isinstance(capacity, int | float) else list(capacity)
        stage_cost_s = [self.tables.cost_s] * num_stages
        if self.gpu_cost_s is not None and num_stages <= len(self.gpu_cost_s):
            stage_cost_s = self.gpu_cost_s[:num_stages]
        num_blocks = self.num_blocks
        best = np.full((num_stages + 1, num_blocks + 1), np.inf)
        best[0, 0] = 0.0
        choice = np.zeros((num_stages + 1, num_blocks + 1), dtype=np.int64)
        for k in range(1, num_stages + 1):
            # stage k − 1 ends at b; k − 1 stages before it need ≥ k − 1 blocks, the rest ≥ 1 each
            for b in range(k, num_blocks - (num_stages - k) + 1):
                mem = self.memory(k - 1, num_stages, b)
                if by_memory:
                    value = np.maximum(best[k - 1, :b], mem)
                else:
                    value = np.maximum(best[k - 1, :b], stage_cost_s[k - 1][:b, b])
                    value[mem > capacities[k - 1]] = np.inf
                a = int(np.argmin(value))
                best[k, b], choice[k, b] = value[a], a
        if not np.isfinite(best[num_stages, num_blocks]):
            return None
        cuts = [num_blocks]
        for k in range(num_stages, 0, -1):
            cuts.append(int(choice[k, cuts[-1]]))
        self.optimum = float(best[num_stages, num_blocks])
        return cuts[::-1]


class _Rectangles:
    """Sums of values over rectangles a0 ≤ a ≤ a1, b0 ≤ b ≤ b1 of a (B + 1) × (B + 1) table,
    accumulated as 2-D differences and summed once."""

    def __init__(self, num_blocks: int) -> None:
        self.size = num_blocks + 1
        self.entries: list[tuple[int, int, int, int, int]] = []

    def add(self, a0: int, a1: int, b0: int, b1: int, value: int) -> None:
        if a0 <= a1 and b0 <= b1 and value:
            self.entries.append((a0, a1, b0, b1, value))

    def table(self) -> np.ndarray:
        diff = np.zeros((self.size + 1, self.size + 1), dtype=np.int64)
        if self.entries:
            a0, a1, b0, b1, v = (np.array(column, dtype=np.int64) for column in zip(*self.entries))
            np.add.at(diff, (a0, b0), v)
            np.add.at(diff, (a0, b1 + 1), -v)
            np.add.at(diff, (a1 + 1, b0), -v)
            np.add.at(diff, (a1 + 1, b1 + 1), v)
        return diff.cumsum(axis=0).cumsum(axis=1)[: self.size, : self.size]


def _comm_s(num_bytes: np.ndarray, profile: GPUProfile) -> np.ndarray:
    """``comm_time_s`` of every entry: one message, nothing for zero bytes."""
    return np.where(num_bytes > 0, profile.link_latency_s + num_bytes / profile.link_bandwidth_bytes_per_s, 0.0)
