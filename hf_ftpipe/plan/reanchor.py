"""Re-anchoring: a plan made on one release's graph of a model, placed onto this release's graph.

A new transformers release traces the same model (same class, config and weights, so the same
key) into a slightly different graph: an op added, reordered or renamed inside a layer. The plan
is still right for the model, only its op names are stale. `fit_to_graph` keeps it:

1. exact: the plan records this graph's digest (``Partition.anchors``): used as it is;
2. else re-anchored, op by op (`reanchor`):
   - an op matched to the plan's (the same target of the same module, in program order,
     `graph.alignment`) keeps its stage;
   - an unmatched op goes where its module's ops went, when they all went to one stage (the
     nearest enclosing module the plan knows decides);
   - any other op follows its producers (the latest of their stages), as atoms do
     (`plan.atoms`), or, with no producer, its first consumer;
   - then no op may run before a producer: an op is moved to its producers' latest stage where a
     reordered graph would otherwise send a value backwards;
3. checked: the model is the same (fingerprint), most ops matched, every stage keeps an op,
   and the cost model's step time of the re-anchored plan is within `REANCHOR_TOLERANCE` of the
   plan's own prediction. Otherwise a `PartitionError` says why, and the caller plans afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_ftpipe.costmodel.estimate import MemoryOptions, estimate
from hf_ftpipe.costmodel.prediction import Prediction
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.errors import PartitionError, PartitionFormatError, ProfileError
from hf_ftpipe.graph.alignment import match_ops, op_rows
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.anchors import GraphAnchors
from hf_ftpipe.plan.atoms import follows_producer
from hf_ftpipe.plan.partition import Partition, collect_versions
from hf_ftpipe.plan.validate import check_stages

__all__ = ["MIN_MATCHED_FRACTION", "REANCHOR_TOLERANCE", "Reanchored", "fit_to_graph", "reanchor"]

REANCHOR_TOLERANCE = 0.02
"""Largest relative change of the predicted step time that a re-anchored plan may show against the
plan's own prediction: more means the graph changed in what it costs, not only in its names."""
MIN_MATCHED_FRACTION = 0.8
"""Fewest of the graph's ops that must match the plan's one to one: a release changes a few ops
per layer at most; a graph that matches less is another model or a rewrite of it."""


@dataclass(frozen=True, kw_only=True)
class Reanchored:
    """A plan placed onto another graph of its model, and what that took."""

    partition: Partition
    """The plan on the new graph: its ops, its anchors, and the cost model's prediction on it."""
    matched: int
    """Ops matched one to one to the plan's (same target, same module, in program order)."""
    by_module: int
    """Ops without a match placed with their module's ops."""
    by_producer: int
    """Ops without a match placed after their producers (or before their first consumer)."""
    moved: int
    """Ops put on a later stage than the rules above gave, so that no stage feeds an earlier one."""
    dropped: int
    """Ops of the plan that the new graph does not have."""
    new_scopes: tuple[str, ...]
    """Modules of the unmatched ops, a few, for the message."""
    made_under: str
    """The transformers version the plan was made under ("unknown" if it does not say)."""
    step_time_s: float | None
    """The plan's own predicted step time, when it has a prediction."""
    torch_made_under: str = "unknown"
    """The torch version it was made under: torch releases also export some ops differently."""

    def describe(self) -> str:
        """One line: versions, what matched and what moved, and the predicted step times."""
        total = self.matched + self.by_module + self.by_producer
        parts = [f"{self.matched} of {total} ops matched"]
        if self.by_module:
            parts.append(f"{self.by_module} placed with their module")
        if self.by_producer:
            parts.append(f"{self.by_producer} after their producers")
        if self.dropped:
            parts.append(f"{self.dropped} of the plan's gone")
        if self.moved:
            parts.append(f"{self.moved} moved to a later stage")
        where = f" (in {', '.join(self.new_scopes)})" if self.new_scopes else ""
        versions = collect_versions()
        made, here = f"transformers {self.made_under}", f"transformers {versions.get('transformers', 'unknown')}"
        torch_now = versions.get("torch", "unknown")
        if self.torch_made_under not in ("unknown", torch_now):
            made, here = f"{made}, torch {self.torch_made_under}", f"{here}, torch {torch_now}"
        line = f"made under {made}, re-anchored onto this graph ({here}): "
        line += ", ".join(parts) + where
        predicted = self.partition.predicted
        if self.step_time_s is not None and predicted is not None:
            now_ms, own_ms = predicted.step_time_s * 1e3, self.step_time_s * 1e3
            line += f"; predicted step {now_ms:.4g} ms (the plan's own: {own_ms:.4g} ms)"
        return line


def fit_to_graph(
    partition: Partition, graph: CostGraph, profile: GPUProfile | None = None, *, source: str = "partition"
) -> tuple[Partition, Reanchored | None]:
    """``partition`` for ``graph``: itself when it was made on this exact graph (or records no graph
    and names its ops), else re-anchored onto it (`reanchor`).

    ``profile`` prices the re-anchored plan (the GPUs it was made for; by default the built-in
    profile its key names). Raises an error beginning with ``source`` when the plan serves
    neither way (a `PartitionFormatError`: the plan is foreign to this graph); the caller then plans
    afresh (or, for a file the user named, says to fix it).
    """
    anchors = partition.anchors
    if anchors is None or anchors.digest == graph.digest:
        partition.check_matches(graph, source=source)
        return partition, None
    try:
        reanchored = reanchor(partition, graph, profile)
    except PartitionError as error:
        why = f"{source}: made on another graph of this model and cannot be re-anchored: {error}"
        raise PartitionFormatError(why) from error
    return reanchored.partition, reanchored


def reanchor(partition: Partition, graph: CostGraph, profile: GPUProfile | None = None) -> Reanchored:
    """Place ``partition``, made on another graph of the same model, onto ``graph`` (module docstring)."""
    anchors = partition.anchors
    if anchors is None:
        raise PartitionError("the plan does not record the graph it was made on (no 'anchors')")
    if partition.key.model_fingerprint != graph.fingerprint:
        raise PartitionError(
            f"it was made for another model: fingerprint {partition.key.model_fingerprint!r}, this model's is "
            f"{graph.fingerprint!r} (class, structural config or weights differ)"
        )
    old_rows, new_rows = list(anchors.rows()), op_rows(graph)
    to_new = match_ops(old_rows, new_rows)
    if len(to_new) < MIN_MATCHED_FRACTION * len(new_rows):
        raise PartitionError(
            f"only {len(to_new)} of the graph's {len(new_rows)} ops match the plan's ({len(old_rows)} ops), fewer "
            f"than the {MIN_MATCHED_FRACTION:.0%} a release of the same model keeps"
        )
    placement = _Placement(partition, graph, old_rows, to_new)
    node_stage = placement.node_stage()
    empty = sorted(set(range(partition.num_stages)) - set(node_stage.values()))
    if empty:
        raise PartitionError(f"stages {empty} would hold no op on this graph")
    check_stages(graph, node_stage)
    predicted = _predict(partition, graph, node_stage, profile)
    if predicted is not None and partition.predicted is not None:
        before, after = partition.predicted.step_time_s, predicted.step_time_s
        if before > 0 and abs(after - before) > REANCHOR_TOLERANCE * before:
            raise PartitionError(
                f"the cost model predicts {after * 1e3:.4g} ms per micro-batch for it on this graph against the "
                f"plan's own {before * 1e3:.4g} ms ({(after - before) / before:+.1%}, more than the "
                f"±{REANCHOR_TOLERANCE:.0%} a re-anchored plan may differ)"
            )
    placed = replace(
        partition,
        node_stage=node_stage,
        predicted=predicted,
        anchors=GraphAnchors.of(graph),
        versions=collect_versions(),
    )
    return Reanchored(
        partition=placed,
        matched=len(to_new),
        by_module=placement.by_module,
        by_producer=placement.by_producer,
        moved=placement.moved,
        dropped=len(old_rows) - len(to_new),
        new_scopes=tuple(sorted(placement.unmatched_scopes)[:3]),
        made_under=partition.versions.get("transformers", "unknown"),
        torch_made_under=partition.versions.get("torch", "unknown"),
        step_time_s=partition.predicted.step_time_s if partition.predicted is not None else None,
    )


class _Placement:
    """The new graph's op → stage, by the rules of the module docstring, with counts of each rule."""

    def __init__(self, partition: Partition, graph: CostGraph, old_rows: list, to_new: dict[str, str]) -> None:
        self.graph = graph
        self.stage_of_old = {new: partition.node_stage[old] for old, new in to_new.items()}
        self.module_stages: dict[str, set[int]] = {}
        for node, _, scope in old_rows:
            self.module_stages.setdefault(scope, set()).add(partition.node_stage[node])
        self.by_module = self.by_producer = self.moved = 0
        self.unmatched_scopes: set[str] = set()
        self.placed_by_rule: set[str] = set()
        """Ops placed by match or by module: the ones a move to a later stage counts."""

    def node_stage(self) -> dict[str, int]:
        g, order = self.graph.graph, self.graph.topological_order()
        stage: dict[str, int | None] = {}
        for node in order:
            stage[node] = self._first_guess(node, stage)
        for node in reversed(order):  # no producer: before its first consumer
            if stage[node] is None:
                stage[node] = min((stage[v] for v in g.successors(node) if stage[v] is not None), default=0)
        for node in order:  # no stage may feed an earlier one
            producers = [stage[u] for u in g.predecessors(node)]
            latest = max(producers, default=stage[node])
            if follows_producer(self.graph, node) and producers:
                stage[node] = latest
            elif latest > stage[node]:
                stage[node] = latest
                self.moved += node in self.placed_by_rule
        return {node: stage[node] for node in order}  # type: ignore[misc]

    def _first_guess(self, node: str, stage: dict[str, int | None]) -> int | None:
        if node in self.stage_of_old:
            self.placed_by_rule.add(node)
            return self.stage_of_old[node]
        scope = self.graph.node(node)["scope"]
        self.unmatched_scopes.add(scope or "<top>")
        module = _enclosing_known(scope, self.module_stages)
        if module is not None and len(self.module_stages[module]) == 1:
            self.by_module += 1
            self.placed_by_rule.add(node)
            return next(iter(self.module_stages[module]))
        self.by_producer += 1
        producers = [stage[u] for u in self.graph.graph.predecessors(node) if stage[u] is not None]
        return max(producers) if producers else None


def _enclosing_known(scope: str, known: dict[str, set[int]]) -> str | None:
    """``scope`` or its nearest enclosing module that has ops in ``known``."""
    while True:
        if scope in known:
            return scope
        if not scope:
            return None
        scope = scope.rpartition(".")[0]


def _predict(
    partition: Partition, graph: CostGraph, node_stage: dict[str, int], profile: GPUProfile | None
) -> Prediction | None:
    """The cost model's prediction of the re-anchored plan, under the options of the plan's own."""
    own = partition.predicted
    if own is None:
        return None
    if profile is None:
        from hf_ftpipe.costmodel.profiles import get_profile

        try:
            profile = get_profile(partition.key.gpu_profile, count=partition.key.num_gpus)
        except ProfileError as error:  # a profile from a file: only the caller has it
            raise PartitionError(
                f"cannot price it: the GPU profile {partition.key.gpu_profile!r} is not built in ({error}); pass "
                "the profile the plan was made for"
            ) from error
    return estimate(
        graph,
        node_stage,
        list(partition.stage_device),
        profile,
        num_microbatches=own.num_microbatches,
        microbatch_size=own.microbatch_size,
        optimizer=own.optimizer,  # type: ignore[arg-type]
        schedule=own.schedule,  # type: ignore[arg-type]
        dtype=own.dtype,
        memory=MemoryOptions(recompute=own.recompute),
    )
