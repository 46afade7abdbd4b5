"""A plan: which stage runs each op and which GPU runs each stage, its key, its file format and its checks."""

from hf_ftpipe.plan.partition import FORMAT_NAME, FORMAT_VERSION, MAX_FILE_BYTES, Partition, PartitionKey
from hf_ftpipe.plan.validate import check_fits_run, stage_graph, validate_partition

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FILE_BYTES",
    "Partition",
    "PartitionKey",
    "check_fits_run",
    "stage_graph",
    "validate_partition",
]
