"""Sharing partitions: a local cache under ``HF_HOME`` and a Hugging Face Hub dataset repo."""

from hf_ftpipe.hub.resolve import Resolved, resolve_partition
from hf_ftpipe.hub.store import MAX_HUB_FILE_BYTES, PartitionStore, PlanEntry, PulledPlan, path_for

__all__ = [
    "MAX_HUB_FILE_BYTES",
    "PartitionStore",
    "PlanEntry",
    "PulledPlan",
    "Resolved",
    "path_for",
    "resolve_partition",
]
