"""Partitioners by name, so `auto`, the CLI and PipeTrainer can pick one from a string.

Every partitioner has the same signature (``PlanOptions``: the fields of `PlanRequest`)::

    partition_<name>(graph: CostGraph, profile: GPUProfile, num_stages: int | None = None, *,
                     num_microbatches: int, microbatch_size: int, schedule: Schedule = "gpipe",
                     optimizer: Optimizer = "adamw", dtype: str | None = None,
                     key: PartitionKey | None = None, memory: MemoryOptions | None = None) -> Partition

and is called one way, with a `PlanRequest`: ``run_partitioner(name, graph, request)``.
``num_stages`` defaults to the partitioner's own choice (one per GPU for sequential ones).
A partitioner raises `PartitionError` when it cannot produce a plan that fits memory.

Registering a partitioner also makes every plan it returns record the graph it was made on
(``Partition.anchors``), in one place for all of them, so that any plan can later be re-anchored
onto another release's graph of the model (`plan.reanchor`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.anchors import GraphAnchors
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanRequest

__all__ = ["Partitioner", "available_partitioners", "get_partitioner", "register_partitioner", "run_partitioner"]

Partitioner = Callable[..., Partition]
_PARTITIONERS: dict[str, Partitioner] = {}


def register_partitioner(name: str) -> Callable[[Partitioner], Partitioner]:
    """Decorator: make ``function`` available as ``name``; the plans it returns record their graph."""

    def register(function: Partitioner) -> Partitioner:
        @functools.wraps(function)
        def anchored(graph: CostGraph, *args: Any, **kwargs: Any) -> Partition:
            plan = function(graph, *args, **kwargs)
            return plan if plan.anchors is not None else replace(plan, anchors=GraphAnchors.of(graph))

        if name in _PARTITIONERS and _PARTITIONERS[name].__wrapped__ is not function:  # type: ignore[attr-defined]
            raise ValueError(f"a partitioner named {name!r} is already registered")
        _PARTITIONERS[name] = anchored
        return anchored

    return register


def get_partitioner(name: str) -> Partitioner:
    if name not in _PARTITIONERS:
        raise PartitionError(f"unknown partitioner {name!r}; choose one of {available_partitioners()}")
    return _PARTITIONERS[name]


def available_partitioners() -> list[str]:
    return sorted(_PARTITIONERS)


def run_partitioner(name: str, graph: CostGraph, request: PlanRequest, **extra: Any) -> Partition:
    """The plan of ``graph`` that the partitioner called ``name`` makes for ``request``; ``extra``:
    that partitioner's own keyword arguments (e.g. ``auto``'s ``report``)."""
    return get_partitioner(name)(graph, request.profile, request.num_stages, **request.options(), **extra)
