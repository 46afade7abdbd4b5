"""Partitions: which stage runs each op and which GPU runs each stage, how to find and check one."""

from hf_ftpipe.partition.estimate import (
    Optimizer,
    Schedule,
    estimate,
    estimate_memory,
    gpu_cost_s,
    in_flight,
    optimizer_state_bytes,
    weight_versions,
)
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
from hf_ftpipe.partition.seq_greedy import greedy_cuts, partition_seq_greedy
from hf_ftpipe.partition.validate import stage_graph, validate_partition

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FILE_BYTES",
    "GPUCost",
    "Optimizer",
    "Partition",
    "PartitionKey",
    "Prediction",
    "Schedule",
    "StageCost",
    "estimate",
    "estimate_memory",
    "gpu_cost_s",
    "greedy_cuts",
    "in_flight",
    "optimizer_state_bytes",
    "partition_seq_greedy",
    "stage_graph",
    "validate_partition",
    "weight_versions",
]
