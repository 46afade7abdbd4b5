"""validate_partition: structure, stage-graph order and memory, each with a readable message."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_ftpipe.costmodel import MemoryOptions
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition, PartitionKey, check_fits_run, stage_graph, validate_partition

from toy_graphs import UNIT, chain, make_graph, param

KEY = PartitionKey(
    model_fingerprint="toy-fingerprint",
    model_class="ToyModel",
    input_shapes={"input_ids": [2, 8]},
    dtype="float32",
    schedule="gpipe",
    num_microbatches=2,
    gpu_profile="unit",
    num_gpus=4,
)


def _plan(node_stage: dict[str, int], stage_device: list[int]) -> Partition:
    return Partition(node_stage=node_stage, stage_device=stage_device, partitioner="hand", key=KEY)


def _error(partition: Partition, graph, **kwargs) -> str:
    with pytest.raises(PartitionError) as info:
        validate_partition(partition, graph, **kwargs)
    return str(info.value)


def test_greedy_plan_is_valid():
    graph = chain([1, 2, 3, 4])
    plan = partition_seq_greedy(graph, UNIT, num_microbatches=2, microbatch_size=1)
    validate_partition(plan, graph)


def test_mixed_plan_with_non_adjacent_stages_on_one_gpu_is_valid():
    graph = chain([1, 1, 1])
    validate_partition(_plan({"n0": 0, "n1": 1, "n2": 2}, [0, 1, 0]), graph)


def test_cyclic_stage_graph():
    graph = chain([1, 1, 1])
    message = _error(_plan({"n0": 0, "n1": 1, "n2": 0}, [0, 1]), graph)
    assert "cycle" in message and "0 → 1 → 0" in message
    assert "'n0' (stage 0) feeds 'n1' (stage 1)" in message
    assert "'n1' (stage 1) feeds 'n2' (stage 0)" in message


def test_stage_numbering_must_be_topological():
    graph = chain([1, 1])
    message = _error(_plan({"n0": 1, "n1": 0}, [0, 1]), graph)
    assert "stage 1 feeds the earlier stage 0" in message and "'n0' → 'n1'" in message


def test_empty_stage():
    graph = chain([1, 1])
    assert "stages [1] have no op" in _error(_plan({"n0": 0, "n1": 2}, [0, 1, 2]), graph)


def test_node_in_no_stage_and_unknown_node():
    graph = chain([1, 1, 1])
    message = _error(_plan({"n0": 0, "n1": 1, "zz": 1}, [0, 1]), graph)
    assert "1 ops are in no stage, e.g. ['n2']" in message
    assert "not in the graph, e.g. ['zz']" in message


def test_stage_index_out_of_range():
    graph = chain([1, 1])
    assert "outside 0..1" in _error(_plan({"n0": 0, "n1": 5}, [0, 1]), graph)


def test_unused_gpu_in_the_middle():
    graph = chain([1, 1])
    assert "GPUs [1] run no stage" in _error(_plan({"n0": 0, "n1": 1}, [0, 2]), graph)


def test_gpu_beyond_the_key():
    graph = chain([1, 1])
    assert "outside 0..3" in _error(_plan({"n0": 0, "n1": 1}, [0, 4]), graph)


def test_memory_over_capacity():
    weights = {"w": param("w", (10, 10))}  # 400 bytes; AdamW: 400 + 800 state + the gradient
    a = {"flops": 1.0, "params": ("w",)}
    graph = make_graph({"a": a, "b": 1.0}, [("a", "b")], params=weights)
    plan = partition_seq_greedy(graph, UNIT.with_count(2), num_microbatches=2, microbatch_size=1)
    gpu0 = plan.predicted.gpus[0].memory_bytes
    # per micro-batch 16 B saved and the 16 B output; under gpipe the gradient replaces the 16 B
    # its backward frees, beside 2 × 16 B of working tensors
    assert gpu0 == 1200 + (16 + 16) * 2 + 32 + (400 - 16)
    validate_partition(plan, graph, memory_capacity_bytes=gpu0)
    message = _error(plan, graph, memory_capacity_bytes=gpu0 - 1)
    assert f"GPU 0 needs {gpu0} bytes" in message and f"its {gpu0 - 1} bytes" in message
    assert "GPU 1" not in message
    # per-GPU capacities, and a plan without predictions is estimated from its key
    assert "GPU 1 needs 96 bytes" in _error(plan, graph, memory_capacity_bytes=[gpu0, 95])  # + 2 × 16 B working
    bare = replace(plan, predicted=None, key=replace(plan.key, num_microbatches=2))
    assert f"GPU 0 needs {gpu0} bytes" in _error(bare, graph, memory_capacity_bytes=100)


def test_stage_graph_edges():
    graph = make_graph({"a": 1.0, "b": 1.0, "c": 1.0}, [("a", "b"), ("a", "c"), ("b", "c")])
    stages = stage_graph(graph, {"a": 0, "b": 1, "c": 2})
    assert sorted(stages.edges) == [(0, 1), (0, 2), (1, 2)]


def test_tuple_output_must_stay_with_its_producer():
    # split returns two tensors; its getitems must run in its stage
    graph = make_graph(
        {
            "a": 1.0,
            "split": {"flops": 1.0, "output_shapes": ((2,), (2,))},
            "part0": {"op": "getitem"},
            "part1": {"op": "getitem"},
            "b": 1.0,
        },
        [("a", "split"), ("split", "part0"), ("split", "part1"), ("part0", "b"), ("part1", "b")],
    )
    validate_partition(_plan({"a": 0, "split": 1, "part0": 1, "part1": 1, "b": 1}, [0, 1]), graph)
    message = _error(_plan({"a": 0, "split": 0, "part0": 0, "part1": 1, "b": 1}, [0, 1]), graph)
    assert "'split' (stage 0) returns 2 tensors as one tuple" in message
    assert "'part1' (stage 1)" in message and "'part0'" not in message and "put them in stage 0" in message


def test_memory_headroom_and_recompute_from_memory_options():
    graph = chain([1, 1])
    plan = partition_seq_greedy(graph, UNIT, 2, num_microbatches=2, microbatch_size=1)
    need = plan.predicted.gpus[0].memory_bytes  # 96: (16 B saved + 16 B output) × 2 micro-batches + 2 × 16 B
    validate_partition(plan, graph, memory_capacity_bytes=need)
    message = _error(plan, graph, memory_capacity_bytes=need, memory=MemoryOptions(headroom=0.5))
    assert f"more than its {need // 2} bytes" in message and "less 50% headroom" in message
    # without a prediction, recomputation changes the estimate: stage 1 keeps n0's 16 B (and its
    # own output) per micro-batch and recomputes one micro-batch
    bare = replace(plan, predicted=None)
    recompute = MemoryOptions(headroom=0, recompute=True)
    validate_partition(bare, graph, memory_capacity_bytes=(16 + 16) * 2 + 16 + 32, memory=recompute)
    assert "GPU 1 needs 112 bytes" in _error(bare, graph, memory_capacity_bytes=111, memory=recompute)


def test_a_stored_plan_is_checked_against_this_runs_memory_budget():
    """A plan made for SGD fits its own prediction but not a run with AdamW's two moments; nor a
    run with more headroom. The key records neither, so the run's options decide."""
    weights = {"w": param("w", (10, 10))}  # 400 bytes: SGD 400 + the gradient; AdamW + 800 state
    graph = make_graph({"a": {"flops": 1.0, "params": ("w",)}, "b": 1.0}, [("a", "b")], params=weights)
    plan = partition_seq_greedy(graph, UNIT.with_count(2), num_microbatches=2, microbatch_size=1, optimizer="sgd")
    need_sgd = plan.predicted.gpus[0].memory_bytes
    assert need_sgd == 400 + (16 + 16) * 2 + 32 + (400 - 16)
    validate_partition(plan, graph, memory_capacity_bytes=need_sgd)  # its own prediction fits
    check_fits_run(plan, graph, need_sgd, optimizer="sgd", memory=MemoryOptions(headroom=0))
    with pytest.raises(PartitionError) as info:
        check_fits_run(plan, graph, need_sgd, optimizer="adamw", memory=MemoryOptions(headroom=0))
    message = str(info.value)
    assert "made for another memory budget" in message and "optimizer 'adamw'" in message
    assert f"GPU 0 needs {need_sgd + 800} bytes" in message and f"its {need_sgd} bytes" in message
    with pytest.raises(PartitionError, match="less 50% headroom"):
        check_fits_run(plan, graph, need_sgd, optimizer="sgd", memory=MemoryOptions(headroom=0.5))
