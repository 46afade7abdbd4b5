"""``data_parallel_size="auto"``: rank 0 picks P × D over the launched processes, as ``hf-ftpipe compare`` would.

Every D that divides the launched world is a candidate layout of D replicas of a P = world / D GPU
pipeline (replica d on ranks d·P .., so a pipeline whose P divides a machine's GPUs stays inside it),
planned by `auto` and priced by `hf_ftpipe.partitioners.layouts.compare_layouts` on the launched
topology (`hf_ftpipe.trainer.launched_gpus`), each GPU's memory its limit, within
``partition_time_budget_s`` shared among the layouts; the chosen layout's pipeline is then planned
as any run's is (``partitioner``, the cache, the Hub). Under ``"auto"`` the global batch is
``per_device_train_batch_size``, whatever D: the replicas share its ``num_microbatches`` micro-batches,
so only the D that divide ``num_microbatches`` (each replica at least one micro-batch of the same size)
are considered, and the choice never changes what the model trains on. The fastest predicted layout
that fits wins; rank 0 logs it once with the alternatives, in ``compare``'s table, and sends D to every
rank with the plan (`hf_ftpipe.trainer.plan_sharing`), so the ranks cannot disagree.
"""

from __future__ import annotations

from typing import Any

from hf_ftpipe.costmodel.topology import Topology
from hf_ftpipe.errors import PlanDoesNotFitError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.partitioners.layouts import (
    LayoutResult,
    best_layout,
    compare_layouts,
    divisors,
    format_layouts,
    layout_name,
)
from hf_ftpipe.trainer.replicas import Replicas
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["choose_replicas"]

logger = get_logger(__name__)


def choose_replicas(args: Any, graph: CostGraph, topology: Topology, options: dict[str, Any]) -> Replicas:
    """The replicas of the fastest predicted layout that fits (``args``: `PipeTrainingArguments`,
    ``options``: the plan's `PlanOptions` but ``num_microbatches`` and ``gpu_profiles``); logged with
    the alternatives.

    Raises:
        `PlanDoesNotFitError`: no layout fits, with each one's reason.
    """
    world, microbatches = topology.world_size, args.num_microbatches
    replica_counts = divisors(world)
    shared = [(world // d, d) for d in replica_counts if microbatches % d == 0]
    results = compare_layouts(
        graph,
        topology,
        layouts=shared,
        # Shared among the layouts, so that the other ranks' wait for the plan stays what it is for one.
        time_budget_s=args.partition_time_budget_s / len(shared),
        **(options | {"num_microbatches": args.num_microbatches * args.gradient_accumulation_steps}),
    )
    for d in replica_counts:
        if microbatches % d:
            results.append(
                LayoutResult(
                    layout=layout_name(world // d, d),
                    pipeline_gpus=world // d,
                    replicas=d,
                    feasible=False,
                    error=f"num_microbatches={microbatches} cannot be shared by {d} replicas (the global batch "
                    f"is per_device_train_batch_size under data_parallel_size='auto'); use a multiple of {d}",
                )
            )
    results.sort(key=lambda result: result.pipeline_gpus)
    best = best_layout(results)
    table = format_layouts(results, best)
    if best is None:
        raise PlanDoesNotFitError(
            f"data_parallel_size='auto': no layout of the {world} launched processes ({topology.name}) fits:\n{table}"
        )
    logger.info(
        "data_parallel_size='auto' chose %s: %d replicas of a %d-GPU pipeline, %.3g samples/s predicted "
        "(global batch per_device_train_batch_size=%d, %d micro-batches per replica), on %s:\n%s",
        best.layout,
        best.replicas,
        best.pipeline_gpus,
        best.samples_per_s,
        args.per_device_train_batch_size,
        microbatches // best.replicas,
        topology.name,
        table,
    )
    return Replicas.of(args, best.replicas)
