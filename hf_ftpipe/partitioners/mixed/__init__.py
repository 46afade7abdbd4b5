"""Mixed-Pipe: FTPipe's partitioner that may put several non-adjacent stages on one GPU.

FTPipe (Eliad et al., ATC'21, "Mixed-pipe high level partitioning algorithm")::

    1. Coarsening: create L pipeline stages (L > P) from the N nodes      → coarsen.py
    2. Initial assignment: stages to P GPUs under memory, balancing load  → assign.py
    3. Uncoarsening, refinement: shift work across stages while the
       throughput objective or I/O improves                              → refine.py

Several block counts (L = 2P, 3P, 4P), a contiguous start over the blocks, and the best
contiguous plan (``seq-dp``) are each refined the same way; the plan with the lowest predicted
step time that fits memory wins. A plan's stage graph is a DAG numbered in topological order,
and every GPU runs at least one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hf_ftpipe._units import format_bytes
from hf_ftpipe.costmodel.op_time import comm_time_s
from hf_ftpipe.costmodel.prediction import Prediction
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.fit import FitAdvice
from hf_ftpipe.partitioners.mixed.assign import assign_blocks, contiguous_blocks, form_stages
from hf_ftpipe.partitioners.mixed.coarsen import coarsen
from hf_ftpipe.partitioners.mixed.memory import BlockMemory
from hf_ftpipe.partitioners.mixed.objective import IncrementalCost
from hf_ftpipe.partitioners.mixed.refine import refine
from hf_ftpipe.partitioners.registry import register_partitioner
from hf_ftpipe.partitioners.seq_dp import partition_seq_dp
from hf_ftpipe.plan.partition import Partition, PartitionKey
from hf_ftpipe.plan.request import PlanOptions, PlanRequest

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["partition_mixed"]

NAME = "mixed"
MAX_TRIALS = 75_000
"""Moves refinement may try over all candidates together, about 100 µs each on T5-3B: some 10 s
at most. A count, not a wall-clock deadline, so that the plan does not depend on how loaded the
machine is."""
_CALIBRATION_ROUNDS = 4


@register_partitioner(NAME)
def partition_mixed(
    graph: CostGraph, profile: GPUProfile, num_stages: int | None = None, **options: Unpack[PlanOptions]
) -> Partition:
    """Partition ``graph`` onto ``profile.count`` GPUs, several stages per GPU where that balances.

    Args:
        num_stages (`int`, *optional*): a hint: one more block count L to try besides 2P, 3P
            and 4P (P = ``profile.count``). Mixed-Pipe chooses the number of stages itself, at
            least P; the plan may have more or fewer stages than the hint.
        options: the fields of `PlanRequest`, as for every partitioner; each GPU may use
            ``profile.memory_bytes × (1 − memory.headroom)``.

    Raises:
        PlanDoesNotFitError: when no plan fits memory; its advice says the memory per GPU and the
            number of GPUs that would fit.
    """
    request = PlanRequest(profile=profile, num_stages=num_stages, **options)
    if request.placement != "chain":
        raise PartitionError(
            f"the mixed partitioner chooses its own placement of stages on GPUs; it cannot be asked for "
            f"placement={request.placement!r}. Use a contiguous partitioner (seq-dp) for a V placement"
        )
    if request.heterogeneous:  # its objective and memory model hold one GPU profile
        kinds = sorted({g.name for g in request.gpu_profiles or ()})
        raise PartitionError(
            f"the mixed partitioner balances stages for one kind of GPU, but `gpu_profiles` mixes {kinds}; "
            "use seq-dp or seq-greedy for GPUs of several kinds (auto compares them and reports mixed as not run)"
        )
    num_gpus = profile.count
    request.stages_or(None)  # a hint, but a well-formed one
    key = request.key_for(graph)
    search = _MixedSearch(graph, request)
    num_atoms = len(search.coarse.atoms) if num_gpus > 1 else 1
    if num_atoms < num_gpus:
        raise PartitionError(
            f"the model has {num_atoms} indivisible groups of ops, fewer than the {num_gpus} GPUs "
            f"of profile {profile.name!r}; use a profile with count ≤ {num_atoms}"
        )

    best: _Plan | None = None
    tightest: _Plan | None = None
    candidates = sorted(search.coarse.levels.items(), key=lambda item: item[0])
    starts = [(blocks, "balanced") for _, blocks in candidates] + [(candidates[-1][1], "contiguous"), ([], "seq-dp")]
    trials = 0  # moves refinement tried so far; what a candidate leaves goes to the next ones
    for i, (blocks, start) in enumerate(starts):
        plan = search.initial_plan(blocks, start) if start != "seq-dp" else search.seq_dp_plan()
        if plan is None:
            continue
        plan, tried = search.refined(plan, max_trials=(MAX_TRIALS - trials) // (len(starts) - i))
        trials += tried
        if not plan.fits:
            if tightest is None or plan.peak_memory < tightest.peak_memory:
                tightest = plan
        elif best is None or (plan.step_time_s, plan.num_stages) < (best.step_time_s, best.num_stages):
            best = plan
    if best is None:
        raise search.infeasible(tightest, key)
    return Partition(
        node_stage=best.node_stage,
        stage_device=best.stage_device,
        partitioner=NAME,
        key=key,
        predicted=best.predicted,
    )


@dataclass
class _Plan:
    atom_stage: list[int]
    stage_device: list[int]
    node_stage: dict[str, int]
    predicted: Prediction
    limit: int

    @property
    def step_time_s(self) -> float:
        return self.predicted.step_time_s

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def peak_memory(self) -> int:
        return max(g.memory_bytes for g in self.predicted.gpus)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.limit


class _MixedSearch:
    """The search over candidate plans, and what every candidate shares: costs, sizes, the
    coarsening, the memory limit."""

    def __init__(self, graph: CostGraph, request: PlanRequest) -> None:
        profile, memory = request.profile, request.memory
        self.graph, self.request, self.profile, self.memory = graph, request, profile, memory
        self.costs = request.node_costs(graph)
        # Recomputation runs each forward a second time before its backward (as `estimate` counts).
        again = 1.0 if memory.recompute else 0.0
        self.weight = {n: c.total_s + again * c.forward_s for n, c in self.costs.items()}
        self.limit = request.usable_bytes
        num_gpus = profile.count
        total = sum(self.weight.values())
        out_comm = {n: comm_time_s(a["output_bytes"], profile) for n, a in graph.graph.nodes(data=True)}
        counts = [k * num_gpus for k in (2, 3, 4)]
        self.coarse = coarsen(graph, self.weight, out_comm, counts, cap=total / num_gpus / 2)
        self.atom_of = {n: a for a, nodes in enumerate(self.coarse.atoms) for n in nodes}
        # what BlockMemory and IncrementalCost price memory with, besides `memory`
        self.memory_args = {
            "schedule": request.schedule,
            "optimizer": request.optimizer,
            "num_microbatches": request.num_microbatches,
        }

    def initial_plan(self, blocks: list[list[str]], start: str) -> _Plan | None:
        """Assign ``blocks``, form stages, estimate; repeat with each block charged at the stage
        it landed in and budgets tightened where the estimate exceeded the proxy, until the plan
        fits memory or the rounds run out (the last plan is returned)."""
        num_gpus = self.profile.count
        if len(blocks) < num_gpus:
            return None
        block_cost = [sum(self.weight[n] for n in b) for b in blocks]
        block_pred = self._block_predecessors(blocks)
        memory_of = BlockMemory(self.graph, blocks, memory=self.memory, **self.memory_args)
        total, before = sum(block_cost), 0.0
        guess = []
        for cost in block_cost:  # before any plan: stage by the share of compute before the block
            guess.append(int(num_gpus * (before + cost / 2) / total) if total > 0 else 0)
            before += cost
        # Stages and their GPUs are unknown until blocks have GPUs: charge each block as the
        # stage its compute share puts it in of a contiguous plan, stage g on GPU g. A plan with
        # more stages than GPUs holds more micro-batches at its early stages (`in_flight` counts
        # stages); calibration below charges the stages and GPUs the blocks actually got.
        memory_of.place(guess, range(num_gpus))
        budget = [float(self.limit)] * num_gpus
        plan = None
        for _ in range(_CALIBRATION_ROUNDS):
            if start == "contiguous":
                block_gpu = contiguous_blocks(block_cost, num_gpus)
            else:
                block_gpu = assign_blocks(block_cost, num_gpus, memory_of, budget)
            if block_gpu is None or len(set(block_gpu)) < num_gpus:
                return plan
            block_stage, stage_device = form_stages(block_gpu, block_pred)
            atom_stage = [0] * len(self.coarse.atoms)
            for b, nodes in enumerate(blocks):
                for n in nodes:
                    atom_stage[self.atom_of[n]] = block_stage[b]
            plan = self._plan(atom_stage, stage_device)
            if plan.fits or start == "contiguous":
                return plan
            memory_of.place(block_stage, stage_device)
            for g, gpu in enumerate(plan.predicted.gpus):
                proxy = memory_of(g, [b for b, d in enumerate(block_gpu) if d == g])
                if gpu.memory_bytes > self.limit:  # the proxy was optimistic here: tighten it
                    budget[g] = min(budget[g], proxy * self.limit / gpu.memory_bytes) * 0.98
        return plan

    def seq_dp_plan(self) -> _Plan | None:
        """The best contiguous plan that fits (``seq-dp``), as a start: refining it can only
        make it better, so Mixed-Pipe is never worse than Seq-Pipe on the same objective."""
        try:
            partition = partition_seq_dp(self.graph, self.profile, **replace(self.request, key=None).options())
        except PartitionError:
            return None
        atom_stage = [partition.node_stage[nodes[0]] for nodes in self.coarse.atoms]
        return self._plan(atom_stage, list(partition.stage_device))

    def refined(self, plan: _Plan, max_trials: int) -> tuple[_Plan, int]:
        """``plan`` refined, trying at most ``max_trials`` moves; if it does not fit, refinement
        first moves ops off the full GPUs. Returns (plan, moves tried).

        The plan is the refined one when the estimate confirms it (it fits and is no slower, or it
        needs less memory than an unfitting ``plan``), else ``plan`` itself.
        """
        state = IncrementalCost(
            self.graph, self.profile, self.coarse.atoms, list(plan.atom_stage), plan.stage_device, self.weight,
            memory=self.memory, limit=[float(self.limit)] * self.profile.count, **self.memory_args,
        )  # fmt: skip
        moved, tried = refine(state, max_trials)
        if moved == 0:
            return plan, tried
        better = self._plan(*_drop_empty_stages(state.atom_stage, plan.stage_device))
        if plan.fits:
            return (better if better.fits and better.step_time_s <= plan.step_time_s else plan), tried
        return (better if better.peak_memory < plan.peak_memory else plan), tried

    def infeasible(self, tightest: _Plan | None, key: PartitionKey) -> PlanDoesNotFitError:
        """The error when no plan fits: the least memory a plan found needs; what would fit is the advice's."""
        usable = (
            f"the {format_bytes(self.limit)} usable per GPU ({format_bytes(self.profile.memory_bytes)} less "
            f"{self.memory.headroom * 100:g}% headroom)"
        )
        plans = []
        if tightest is None:
            reason = f"mixed: found no plan of {self.profile.count} GPUs that fits {usable}"
        else:
            reason = (
                f"mixed: no plan it found fits {usable}: the leanest needs {format_bytes(tightest.peak_memory)} on "
                "its fullest GPU"
            )
            plan = Partition(
                node_stage=tightest.node_stage, stage_device=tightest.stage_device, partitioner=NAME, key=key,
                predicted=tightest.predicted,
            )  # fmt: skip
            plans.append((NAME, plan))
        return PlanDoesNotFitError(reason, FitAdvice(graph=self.graph, request=self.request, plans=tuple(plans)))

    # -- helpers ---------------------------------------------------------------------------------

    def _plan(self, atom_stage: Sequence[int], stage_device: list[int]) -> _Plan:
        node_stage = {n: atom_stage[self.atom_of[n]] for n in self.graph.topological_order()}
        predicted = self.request.estimate(self.graph, node_stage, stage_device, self.costs)
        return _Plan(list(atom_stage), list(stage_device), node_stage, predicted, self.limit)

    def _block_predecessors(self, blocks: list[list[str]]) -> list[set[int]]:
        block_of = {n: b for b, nodes in enumerate(blocks) for n in nodes}
        g = self.graph.graph
        return [{block_of[u] for n in nodes for u in g.predecessors(n)} - {b} for b, nodes in enumerate(blocks)]


def _drop_empty_stages(atom_stage: Sequence[int], stage_device: Sequence[int]) -> tuple[list[int], list[int]]:
    used = sorted(set(atom_stage))
    number = {s: i for i, s in enumerate(used)}
    return [number[s] for s in atom_stage], [stage_device[s] for s in used]
