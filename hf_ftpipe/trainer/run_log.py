"""What a PipeTrainer run logs, and through which logger: transformers', so that Trainer's verbosity applies.

PipeTrainer's lines belong beside `Trainer`'s own (``***** Running training *****``), so its
modules log under ``transformers.hf_ftpipe.<module>`` (`get_logger`): the level is transformers'
(``--log_level`` on rank 0 and ``--log_level_replica`` elsewhere, which `Trainer` applies, or an
official script's ``transformers.utils.logging.set_verbosity_info()``), and so are the handler and
the format (``enable_explicit_format()``). A logger under ``hf_ftpipe`` alone would fall back to
the standard library's warning level and show its info lines to nobody. The planning packages,
the hub and the command line keep plain ``hf_ftpipe.*`` loggers: they run without a Trainer.

The run's plan is one line, logged once by rank 0 at info (`plan_line`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers.utils import logging as transformers_logging

from hf_ftpipe._units import format_bytes
from hf_ftpipe.hub.sources import Resolved

__all__ = ["PlanUsed", "get_logger", "plan_line"]


def get_logger(name: str) -> logging.Logger:
    """The logger of PipeTrainer's module ``name`` (``__name__``), in transformers' logger tree."""
    return transformers_logging.get_logger(f"transformers.{name}")


@dataclass(frozen=True)
class PlanUsed:
    """What rank 0 knows of the run's plan once it is resolved: what `plan_line` reports."""

    resolved: Resolved
    """The plan, its source ('file', 'cache', 'hub', 'computed') and location."""
    planning_time_s: float
    """Finding the plan: reading and checking a stored one, or running the partitioner."""
    partitioner: str
    """The partitioner asked for (``PipeTrainingArguments.partitioner``), e.g. 'auto'."""
    token_slices: Sequence[int] | None = None
    """The slice lengths each sequence is cut into (None: whole sequences)."""
    token_slices_auto: bool = False
    """Whether TeraPipe's dynamic program chose them (``token_slices="auto"``)."""
    planned: dict[str, tuple[int, ...]] | None = None
    """The shapes of the largest micro-batch the plan is made for (`hf_ftpipe.trainer.planned_shapes`)."""


def plan_line(plan: PlanUsed) -> str:
    """One line: where the plan came from and how long that took, the partitioner, how a plan made
    under another transformers release was re-anchored onto this graph, the stages of
    each GPU with its predicted peak memory against its capacity, the predicted samples/s, and the
    token slices, e.g.

    ``pipeline plan: computed by auto (chose seq-dp) in 0.41 s; 2 stages on 2 GPUs; predicted 812
    samples/s; GPU 0: stage 0, peak 1.2 MiB of 80.00 GiB; GPU 1: stage 1, peak 1.1 MiB of 80.00 GiB``
    """
    partition = plan.resolved.partition
    parts = [f"pipeline plan: {_origin(plan)} in {plan.planning_time_s:.2f} s"]
    if plan.resolved.reanchored is not None:  # a stored plan made under another transformers release
        parts.append(plan.resolved.reanchored.describe())
    parts.append(f"{partition.num_stages} stages on {partition.num_devices} GPUs")
    if plan.planned:
        shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in plan.planned.items())
        parts.append(f"planned for micro-batches of up to {shapes}")
    predicted = partition.predicted
    if predicted is None:
        parts.append("no prediction in the plan")
    else:
        parts.append(f"predicted {_rate(predicted.throughput_samples_per_s)} samples/s")
    for gpu in range(partition.num_devices):
        stages = partition.stages_on(gpu)
        where = f"GPU {gpu}: stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        if predicted is not None and gpu < len(predicted.gpus):
            cost = predicted.gpus[gpu]
            where += f", peak {format_bytes(cost.memory_bytes)} of {format_bytes(cost.capacity_bytes)}"
        parts.append(where)
    if plan.token_slices is not None:
        chosen = " (chosen by token_slices='auto')" if plan.token_slices_auto else ""
        parts.append(f"token slices {list(plan.token_slices)}{chosen}")
    return "; ".join(parts)


def _rate(samples_per_s: float) -> str:
    """``0.0123``, ``12.3``, ``38,060``: three significant digits, whole numbers from 1000 on."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 1000 else f"{samples_per_s:.3g}"


def _origin(plan: PlanUsed) -> str:
    """``computed by auto (chose seq-dp)``, ``from the local cache, PATH (made by mixed)``, ..."""
    resolved, made_by = plan.resolved, plan.resolved.partition.partitioner
    if resolved.source == "computed":
        chose = f" (chose {made_by})" if plan.partitioner != made_by else ""
        return f"computed by {plan.partitioner}{chose}"
    where = {"file": "the file", "cache": "the local cache,", "hub": "the Hub,"}.get(resolved.source, resolved.source)
    return f"from {where} {resolved.location} (made by {made_by})"
