"""A plan: which stage runs each op and which GPU runs each stage, its key, its file format, its checks,
and the request every partitioner plans for."""

from hf_ftpipe.plan._json import MAX_FILE_BYTES
from hf_ftpipe.plan.partition import FORMAT_NAME, FORMAT_VERSION, Partition, PartitionKey
from hf_ftpipe.plan.request import PlanOptions, PlanRequest
from hf_ftpipe.plan.validate import check_fits_run, stage_graph, validate_partition

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FILE_BYTES",
    "Partition",
    "PartitionKey",
    "PlanOptions",
    "PlanRequest",
    "check_fits_run",
    "stage_graph",
    "validate_partition",
]
