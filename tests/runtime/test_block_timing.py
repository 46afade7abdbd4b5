"""Block timing: one block per layer type is run, its repeats get its time, and the timing core's
phases are timed apart."""

from __future__ import annotations

import math
import time

import pytest
import torch
from cost_tables import tiny_gpt2_traced

from hf_ftpipe.costmodel import CostTable, get_profile
from hf_ftpipe.runtime.block_timing import median_times, time_blocks


def test_profile_times_one_block_per_layer_type() -> None:
    traced = tiny_gpt2_traced(4)
    timings = time_blocks(traced, device=torch.device("cpu"), warmup=1, repeats=2, show_progress=False)
    table = CostTable.from_timings(traced.cost_graph, timings, get_profile("cpu"))
    names = [b.name for b in table.blocks]
    assert names == ["transformer", *[f"transformer.h.{i}" for i in range(4)], "transformer.ln_f"]
    assert table.num_timed == 3 < len(table.blocks)  # before the layers, one layer, after them
    layers = table.blocks[1:5]
    assert [b.timed_as for b in layers] == ["", "transformer.h.0", "transformer.h.0", "transformer.h.0"]
    assert len({(b.forward_s, b.backward_s) for b in layers}) == 1
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in table.blocks)
    # W, the products' weight gradients, timed apart inside the backward: none in the embeddings
    assert timings.blocks[0].weight_s == 0.0
    assert all(0 < b.weight_s < b.backward_s for b in timings.blocks[1:])  # the layers' Conv1D, lm_head
    assert (table.key.device, table.key.dtype, table.key.graph_digest) == ("cpu", "float32", traced.cost_graph.digest)
    costs = table.node_costs(traced.cost_graph)
    assert math.fsum(c.total_s for c in costs.values()) == pytest.approx(
        math.fsum(b.forward_s + b.backward_s for b in table.blocks)
    )


def test_median_times_times_each_phase() -> None:
    def phases():
        time.sleep(0.01)
        yield
        time.sleep(0.03)
        yield

    forward_s, backward_s = median_times(phases, warmup=0, repeats=3, device=torch.device("cpu"))
    assert 0.01 <= forward_s < backward_s
    assert backward_s >= 0.03
