"""The tiny models of `models.KINDS` exported once per test process, measured per shape.

An export is most of a one-process test's time (2-10 s per model on 2 cores); measuring its graph at
another shape (`measure_at`) a fraction of a second. tests/graph (the graph and its shape formulas), the
partitioners' and re-anchoring tests on real models, tests/runtime/test_stage.py and
tests/faults/test_error_messages.py read captures of the same tiny models: they share one per kind, on one
worker (`suite_order.SHARED_LAUNCHES` makes the files that import this one unit of work). A test that writes
to a capture (gradients) undoes it.
"""

from __future__ import annotations

import functools

from torch import nn

from hf_ftpipe.graph import CostGraph, TracedModel, capture_model
from hf_ftpipe.graph.trace import measure_at

from models import tiny_batch, tiny_model

DROPOUT = 0.3

TRACED_ON = (2, 8)
PLANNED = (3, 5)
PLANNED_TARGET = 3
"""Exported on micro-batches of 2 rows of 8 tokens (`models.tiny_batch(kind, 2)`), measured at 3 rows of
5 tokens (3 target tokens): every batch and sequence size of the tiny models varies."""


@functools.cache
def tiny_capture(kind: str) -> tuple[nn.Module, TracedModel]:
    """`models.tiny_model(kind)` and its capture on `TRACED_ON`, planned for (measured at) `PLANNED`."""
    model = tiny_model(kind)
    planned = tiny_batch(kind, PLANNED[0], seq=PLANNED[1], target=PLANNED_TARGET)
    sample = tiny_batch(kind, TRACED_ON[0], seq=TRACED_ON[1])
    return model, capture_model(model, sample, planned={name: tuple(value.shape) for name, value in planned.items()})


@functools.cache
def tiny_graph(kind: str, batch_size: int = 2) -> CostGraph:
    """The `CostGraph` of the tiny ``kind`` at `models.tiny_batch(kind, batch_size)`, as
    ``trace_model(tiny_model(kind), tiny_batch(kind, batch_size))`` gives it (tests/graph/test_measure.py
    checks that `measure_at` does), from the shared capture."""
    model, traced = tiny_capture(kind)
    return measure_at(model, traced, tiny_batch(kind, batch_size))


@functools.cache
def tiny_t5_with_dropout() -> tuple[nn.Module, TracedModel]:
    """`models.tiny_model("t5", dropout=DROPOUT)` and its capture on `models.tiny_batch("t5", 2)`, exported at
    those fixed shapes (a third of the symbolic export's time): its tests are of dropout, not of shapes."""
    model = tiny_model("t5", dropout=DROPOUT)
    return model, capture_model(model, tiny_batch("t5", 2), dynamic=False)
