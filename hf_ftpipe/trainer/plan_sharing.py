"""How PipeTrainer gets its plan: rank 0 resolves it, every rank receives it and checks it.

Rank 0 looks for a plan in ``partition_file``, then the local cache, then ``partition_repo``,
and else runs the partitioner (``hub.resolve``); the plan travels to every rank as JSON text and
each checks it against its own trace. Only rank 0 plans, so the ranks cannot disagree; when it
fails the others receive the error instead of waiting for a plan that never comes. Once every rank
holds the plan, rank 0 logs which one the run uses (`hf_ftpipe.trainer.run_log.plan_line`).

The plan is made for the launched GPUs (`hf_ftpipe.trainer.launched_gpus`): one pipeline's P of them,
with a profile per position when they are of several kinds (its key then names them all). Under
``data_parallel_size="auto"`` rank 0 first chooses D (`hf_ftpipe.trainer.layout_choice`), and D
travels with the plan.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_ftpipe.costmodel import GPUProfile
from hf_ftpipe.costmodel.estimate import MemoryOptions, Optimizer
from hf_ftpipe.costmodel.measured import CostTable
from hf_ftpipe.errors import PartitionError, PipelineError, PlanDoesNotFitError
from hf_ftpipe.graph.trace import TracedModel
from hf_ftpipe.hub.sources import Resolved
from hf_ftpipe.partitioners.auto import PartitionerResult, reason_line
from hf_ftpipe.partitioners.layouts import pipeline_gpus
from hf_ftpipe.partitioners.registry import run_partitioner
from hf_ftpipe.plan import Partition, check_fits_run, validate_partition
from hf_ftpipe.plan.request import PlanRequest, v_on_mixed_gpus
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.schedules.registry import SCHEDULE_NAMES, SCHEDULES
from hf_ftpipe.trainer.arguments import PipeTrainingArguments
from hf_ftpipe.trainer.launched_gpus import device_of_this_rank, launched_topology
from hf_ftpipe.trainer.layout_choice import choose_replicas
from hf_ftpipe.trainer.replicas import Replicas, pipeline_size
from hf_ftpipe.trainer.run_log import PlanUsed, get_logger, plan_line
from hf_ftpipe.trainer.schedule_choice import planned_placement

__all__ = ["SharedPlan", "memory_options", "planned_optimizer", "share_partition"]

logger = get_logger(__name__)


@dataclass(frozen=True)
class SharedPlan:
    partition: Partition
    source: str | None
    """Rank 0: where the plan came from ('file', 'cache', 'hub' or 'computed'); None elsewhere."""
    replicas: Replicas
    """The replicas that run the plan (under ``data_parallel_size="auto"``, rank 0's choice)."""


def share_partition(
    args: PipeTrainingArguments,
    traced: TracedModel,
    microbatch: dict[str, Any],
    watchdog: Watchdog,
    token_slices: Sequence[int] | None = None,
) -> SharedPlan:
    """Rank 0 makes or loads the plan; every rank gets it as JSON text and checks it against its own trace.

    The other ranks wait for it at most ``pipeline_timeout_s`` (``watchdog``), planning included.
    Rank 0 then logs the plan, with the ``token_slices`` the pipeline cuts sequences into."""
    # Every rank: "auto" gathers each one's GPU.
    topology = launched_topology(args.gpu_profile, watchdog, device_of_this_rank(args.device))
    payload: list[str | None] = [None]
    used: PlanUsed | None = None
    if dist.get_rank() == 0:
        try:
            start = time.perf_counter()
            # Timed (cost_table="measured") once, when first needed: by the layout choice, else by planning.
            costs = functools.cache(functools.partial(_cost_table, args, traced))
            if args.data_parallel_size == "auto":
                options = _plan_options(args, traced, microbatch) | {"cost_table": costs()}
                replicas = choose_replicas(args, traced.cost_graph, topology, options)
            else:
                replicas = Replicas.of(args)
            num_gpus = pipeline_size(replicas.data_parallel_size, topology.world_size)
            profile, gpus = pipeline_gpus(topology, num_gpus)  # every replica runs the plan
            resolved = _make_partition(args, traced, profile, microbatch, replicas, gpus, costs)
            used = PlanUsed(
                resolved,
                time.perf_counter() - start,
                args.partitioner,
                token_slices,
                token_slices_auto=args.token_slices == "auto",
                planned={
                    name: info.shape
                    for name, info in traced.cost_graph.inputs.items()
                    if info.shape is not None and info.varying
                },
            )
            plan = resolved.partition.to_dict()
            payload[0] = json.dumps({"partition": plan, "data_parallel_size": replicas.data_parallel_size})
        except Exception as error:  # the other ranks must not wait for a plan that never comes
            # Every rank raises the same kind: under auto_find_batch_size each then plans a smaller batch.
            does_not_fit = isinstance(error, PlanDoesNotFitError)
            payload[0] = json.dumps({"error": f"{type(error).__name__}: {error}", "does_not_fit": does_not_fit})
            watchdog.broadcast_from_rank0(payload, "sharing the partition from rank 0")
            raise
    watchdog.broadcast_from_rank0(payload, "sharing the partition from rank 0")
    data = json.loads(payload[0] or "{}")
    if "error" in data:
        error = PlanDoesNotFitError if data["does_not_fit"] else PipelineError
        raise error(f"[rank {dist.get_rank()}] rank 0 could not make the partition: {data['error']}")
    partition = Partition.from_dict(data["partition"], source="the partition from rank 0")
    partition.check_matches(traced.cost_graph, source="the partition from rank 0")
    if used is not None:
        logger.info(plan_line(used))
    replicas = Replicas.of(args, data["data_parallel_size"])
    return SharedPlan(partition, used.resolved.source if used is not None else None, replicas)


def planned_optimizer(args: PipeTrainingArguments) -> Optimizer:
    """The optimizer whose state the memory model counts: Adafactor's factored state, else
    Adam's two moments (an upper bound for SGD)."""
    return "adafactor" if "adafactor" in str(args.optim) else "adamw"


def memory_options(args: PipeTrainingArguments) -> MemoryOptions:
    return MemoryOptions(
        headroom=args.partition_memory_headroom,
        recompute=bool(args.activation_checkpointing),
        gradient_accumulation_steps=args.async_update_interval,
    )


def _plan_options(args: PipeTrainingArguments, traced: TracedModel, microbatch: dict[str, Any]) -> dict[str, Any]:
    """The `PlanOptions` of the run's plan but ``num_microbatches`` (one replica's), ``gpu_profiles`` and
    ``cost_table`` (timed only when a plan is made)."""
    return {
        "microbatch_size": next(v.shape[0] for v in microbatch.values() if isinstance(v, torch.Tensor)),
        "schedule": args.pipeline_schedule,
        "placement": planned_placement(args.pipeline_schedule)[0],
        "optimizer": planned_optimizer(args),
        "memory": memory_options(args),
    }


def _make_partition(
    args: PipeTrainingArguments,
    traced: TracedModel,
    profile: GPUProfile,
    microbatch: dict[str, Any],
    replicas: Replicas,
    gpus: Sequence[GPUProfile] | None,
    costs: Callable[[], CostTable | None],
) -> Resolved:
    """``partition_file``, else the local cache, else ``partition_repo``, else the partitioner."""
    from hf_ftpipe.hub.resolve import resolve_partition
    from hf_ftpipe.plan.keys import resolve_key

    graph = traced.cost_graph
    microbatches = replicas.microbatches_per_step(args)
    key = resolve_key(graph, profile, None, schedule=args.pipeline_schedule, num_microbatches=microbatches, dtype=None)
    return resolve_partition(
        graph,
        key,
        lambda: _compute_partition(args, traced, profile, microbatch, replicas, gpus, costs),
        partition_file=args.partition_file,
        repo_id=args.partition_repo,
        revision=args.partition_revision,
        push=args.push_partition_to_hub,
        # The cache's key says neither how a plan was priced nor what a schedule file (named by its path) held.
        use_cache=args.partition_cache and args.cost_table is None and args.pipeline_schedule in SCHEDULE_NAMES,
        check=lambda plan: validate_partition(plan, graph, memory_capacity_bytes=profile.memory_bytes),
        check_stored=lambda plan: check_fits_run(
            plan, graph, profile.memory_bytes, optimizer=planned_optimizer(args), memory=memory_options(args)
        ),
        partitioner=args.partitioner,
        profile=profile,
    )


def _compute_partition(
    args: PipeTrainingArguments,
    traced: TracedModel,
    profile: GPUProfile,
    microbatch: dict[str, Any],
    replicas: Replicas | None = None,
    gpus: Sequence[GPUProfile] | None = None,
    costs: Callable[[], CostTable | None] | None = None,
) -> Partition:
    """The plan for one pipeline of ``profile.count`` GPUs (``gpus``: one profile per position when
    they differ), for one replica's micro-batches (``replicas``; default ``args``' own), priced by
    ``costs()`` (default: ``args.cost_table`` read or timed here)."""
    replicas = replicas or Replicas.of(args)
    placement, num_stages = planned_placement(args.pipeline_schedule)
    if v_on_mixed_gpus(placement, gpus):
        chains = [name for name, traits in SCHEDULES.items() if not traits.v_placement]
        raise PartitionError(
            f"pipeline_schedule={args.pipeline_schedule!r} runs a V placement, which is planned for one kind of "
            f"GPU, but this pipeline's GPUs are {[gpu.name for gpu in gpus or ()]}; use a chain schedule ({chains}), "
            "or a gpu_profile naming one kind"
        )
    request = PlanRequest(
        profile=profile,
        num_microbatches=replicas.microbatches_per_step(args),
        gpu_profiles=gpus,
        num_stages=num_stages,  # a schedule file's own
        cost_table=costs() if costs is not None else _cost_table(args, traced),
        **_plan_options(args, traced, microbatch),
    )
    report: list[PartitionerResult] = []
    extra: dict[str, Any] = {}
    if args.partitioner == "auto":
        extra = {"report": report, "time_budget_s": args.partition_time_budget_s}
    try:
        partition = run_partitioner(args.partitioner, traced.cost_graph, request, **extra)
    except PlanDoesNotFitError as error:  # name the fixes as PipeTrainingArguments fields
        raise error.worded_for("trainer") from error
    for result in report:  # the run's plan line names the winner; --log_level debug shows every candidate
        logger.debug("partitioner %s: %s", result.partitioner, _summary(result))
    return partition


def _cost_table(args: PipeTrainingArguments, traced: TracedModel) -> CostTable | None:
    """``args.cost_table`` read, or (``"measured"``) timed on this rank's device: rank 0 alone plans."""
    if args.cost_table is None:
        return None
    if args.cost_table != "measured":
        return CostTable.load(args.cost_table)  # checked against the graph when the partitioner prices it
    from hf_ftpipe.trainer.measured_costs import cached_profile

    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else None  # what autocast will run in
    start = time.perf_counter()
    table = cached_profile(traced, dtype=dtype)  # on this rank's device
    elapsed_s = time.perf_counter() - start
    logger.info("measured costs: %d blocks on %s (%.1f s)", len(table.blocks), table.key.device, elapsed_s)
    return table


def _summary(result: PartitionerResult) -> str:
    if result.step_time_s is None:
        return f"no plan ({reason_line(result)})"
    verdict = "fits" if result.feasible else f"does not fit ({reason_line(result)})"
    return (
        f"{result.throughput_samples_per_s:.3g} samples/s, worst GPU / ideal {result.worst_over_ideal:.3f}, "
        f"peak memory {result.max_memory_fraction:.0%}, {result.time_s:.2f} s, {verdict}"
    )
