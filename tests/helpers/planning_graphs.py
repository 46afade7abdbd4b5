"""The shipped models traced for planning: each model exported once per test session, measured per shape.

A T5-3B export takes 6-20 s on 2 cores; measuring its graph at another shape under one. tests/cli (the
`hf-ftpipe` commands), tests/hub (the shipped plans) and tests/test_docs.py (the documented GPU commands)
plan the same models at several shapes: they share one capture per model (`measure_at`), on one
worker (`suite_order.SHARED_LAUNCHES` makes the files that import this one unit of work).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import huggingface_hub.constants
import pytest

from hf_ftpipe.cli.partition import _Request
from hf_ftpipe.graph.cost_graph import CostGraph

_GRAPHS: dict[tuple[Any, ...], CostGraph] = {}
_CAPTURES: dict[tuple[Any, ...], tuple[Any, Any]] = {}
"""(model, task, attention_mask) → the model on meta and its capture."""


def planning_graph(
    model: str,
    batch_size: int,
    seq_len: int,
    target_len: int | None = None,
    *,
    task: str | None = None,
    attention_mask: bool = False,
) -> CostGraph:
    """``model`` (a shipped name or config) on the meta device traced for one micro-batch, as
    `hf-ftpipe partition` and `hub.catalog.GraphCache` trace it."""
    from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for
    from hf_ftpipe.graph.trace import capture_model, measure_at

    key = (model, task, batch_size, seq_len, target_len, attention_mask)
    if key not in _GRAPHS:
        captured = _CAPTURES.get(key[:2] + key[-1:])
        loaded = captured[0] if captured else load_model_for_planning(model, task=task)  # type: ignore[arg-type]
        inputs = sample_inputs_for(loaded, batch_size, seq_len, target_len, attention_mask=attention_mask)
        if captured is None:
            traced = capture_model(loaded, inputs)
            _CAPTURES[key[:2] + key[-1:]] = (loaded, traced)
            _GRAPHS[key] = traced.cost_graph
        else:
            _GRAPHS[key] = measure_at(loaded, captured[1], inputs)
    return _GRAPHS[key]


class SessionGraphs:
    """`hub.catalog.GraphCache`'s interface (a setup → its graph) over the session's graphs."""

    def __call__(self, setup: Any) -> CostGraph:
        return planning_graph(setup.model, setup.microbatch_size, setup.seq_len, setup.target_len)


@contextmanager
def cli_traces() -> Iterator[None]:
    """`hf-ftpipe` commands run in this process get the session's graphs, offline."""

    traced = _Request.trace

    def trace(request: _Request) -> CostGraph:
        a = request.args
        if a.lora_r is not None:  # the session's graphs are of the models without adapters
            return traced(request)
        return planning_graph(
            a.model, a.batch_size, a.seq_len, a.target_len, task=a.task, attention_mask=a.attention_mask
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(_Request, "trace", trace)
        yield
