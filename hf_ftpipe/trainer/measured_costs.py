"""Measured cost tables for Python users and for ``PipeTrainingArguments(cost_table="measured")``.

The runtime times the blocks (`hf_ftpipe.runtime.block_timing.time_blocks`, plain data) and the cost
model keeps them (`hf_ftpipe.costmodel.CostTable`); neither imports the other, so the two meet here,
above both (``hf-ftpipe profile`` joins them the same way in `hf_ftpipe.cli.profile`)::

    table = hf_ftpipe.profile_model(model, sample_inputs, dtype="bfloat16")
    table.save("measured.json")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hf_ftpipe.costmodel import CostKey, CostTable, detect_profile
from hf_ftpipe.costmodel.measured import cache_path
from hf_ftpipe.graph.trace import TracedModel, capture_model
from hf_ftpipe.plan.keys import params_dtype
from hf_ftpipe.plan.partition import collect_versions
from hf_ftpipe.runtime.block_timing import TimingOptions, default_device, device_name, dtype_name, time_blocks

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["cached_profile", "profile_model", "profile_traced"]


def profile_model(
    model: torch.nn.Module, sample_inputs: Mapping[str, Any], **options: Unpack[TimingOptions]
) -> CostTable:
    """Trace ``model`` at one micro-batch ``sample_inputs`` (meta tensors and a meta model are fine)
    and time its blocks (``options``: `time_blocks`' keywords: ``dtype``, ``device``, ``warmup``,
    ``repeats``, ``show_progress``)."""
    return profile_traced(capture_model(model, sample_inputs), **options)


def profile_traced(traced: TracedModel, **options: Unpack[TimingOptions]) -> CostTable:
    """The `CostTable` of ``traced``'s blocks timed by `time_blocks` (``options``: its keywords)."""
    timings = time_blocks(traced, **options)
    return CostTable.from_timings(traced.cost_graph, timings, detect_profile(1), info=collect_versions())


def cached_profile(traced: TracedModel, *, dtype: str | None = None, device: torch.device | None = None) -> CostTable:
    """The table of ``traced`` on ``device`` from the cache (``$HF_HOME/hf_ftpipe/costs/``), else
    `profile_traced` and cache it: what ``cost_table="measured"`` runs on rank 0."""
    device = device or default_device()
    graph = traced.cost_graph
    key = CostKey.of(graph, dtype=dtype_name(dtype) if dtype else params_dtype(graph), device=device_name(device))
    path = cache_path(key)
    if path.is_file():
        return CostTable.load(path, expected_key=key)
    table = profile_traced(traced, dtype=key.dtype, device=device)
    table.save(path)
    return table
