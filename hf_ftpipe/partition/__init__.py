"""Partitions: which stage runs each op and which GPU runs each stage, how to find and check one."""

from hf_ftpipe.partition.auto import compare_partitioners, partition_auto
from hf_ftpipe.partition.baselines import find_blocks, partition_params, partition_uniform
from hf_ftpipe.partition.estimate import (
    MemoryOptions,
    Optimizer,
    Schedule,
    estimate,
    estimate_memory,
    gpu_cost_s,
    usable_capacity,
)
from hf_ftpipe.partition.memory_rules import gradients_persist, in_flight, optimizer_state_bytes, weight_versions
from hf_ftpipe.partition.mixed import partition_mixed
from hf_ftpipe.partition.plan import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_FILE_BYTES,
    GPUCost,
    Partition,
    PartitionKey,
    Prediction,
    StageCost,
)
from hf_ftpipe.partition.registry import available_partitioners, get_partitioner, register_partitioner
from hf_ftpipe.partition.seq_dp import partition_seq_dp
from hf_ftpipe.partition.seq_greedy import greedy_cuts, partition_seq_greedy
from hf_ftpipe.partition.validate import check_fits_run, stage_graph, validate_partition

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FILE_BYTES",
    "GPUCost",
    "MemoryOptions",
    "Optimizer",
    "Partition",
    "PartitionKey",
    "Prediction",
    "Schedule",
    "StageCost",
    "available_partitioners",
    "check_fits_run",
    "compare_partitioners",
    "estimate",
    "estimate_memory",
    "find_blocks",
    "get_partitioner",
    "gpu_cost_s",
    "gradients_persist",
    "greedy_cuts",
    "in_flight",
    "optimizer_state_bytes",
    "partition_auto",
    "partition_mixed",
    "partition_params",
    "partition_seq_dp",
    "partition_seq_greedy",
    "partition_uniform",
    "register_partitioner",
    "stage_graph",
    "usable_capacity",
    "validate_partition",
    "weight_versions",
]
