"""The cost model: GPU profiles, the machines' topology (links, a profile per rank), the time of each
op, the memory rules, the estimate of a plan, and the latency of a token slice (for TeraPipe's slicing).

Pure arithmetic on plain data: no devices, no torch.distributed.
"""

from hf_ftpipe.costmodel.estimate import (
    MemoryOptions,
    Optimizer,
    Schedule,
    TokenSlices,
    estimate,
    estimate_memory,
    gpu_cost_s,
    usable_capacity,
)
from hf_ftpipe.costmodel.latency import LatencyKey, LatencySample, SliceLatency
from hf_ftpipe.costmodel.measured import BlockTime, CostKey, CostTable
from hf_ftpipe.costmodel.memory_rules import optimizer_state_bytes
from hf_ftpipe.costmodel.op_time import (
    NodeCost,
    backward_factor,
    backward_time_s,
    comm_time_s,
    compute_time_s,
    edge_comm_s,
    node_costs,
)
from hf_ftpipe.costmodel.prediction import GPUCost, Prediction, StageCost
from hf_ftpipe.costmodel.profiles import (
    BUILTIN_PROFILES,
    DType,
    GPUProfile,
    canonical_dtype,
    detect_profile,
    get_profile,
    list_profiles,
    match_device_name,
)
from hf_ftpipe.costmodel.roofline_latency import RooflineSliceTime
from hf_ftpipe.costmodel.topology import BUILTIN_LINKS, BUILTIN_TOPOLOGIES, Link, Node, Topology, get_link, get_topology
from hf_ftpipe.schedules.rules import gradients_persist, in_flight, weight_versions

__all__ = [
    "BlockTime",
    "CostKey",
    "CostTable",
    "BUILTIN_LINKS",
    "BUILTIN_PROFILES",
    "BUILTIN_TOPOLOGIES",
    "DType",
    "GPUCost",
    "GPUProfile",
    "LatencyKey",
    "Link",
    "LatencySample",
    "MemoryOptions",
    "Node",
    "NodeCost",
    "Optimizer",
    "Prediction",
    "RooflineSliceTime",
    "Schedule",
    "SliceLatency",
    "StageCost",
    "TokenSlices",
    "Topology",
    "backward_factor",
    "backward_time_s",
    "canonical_dtype",
    "comm_time_s",
    "compute_time_s",
    "detect_profile",
    "edge_comm_s",
    "estimate",
    "estimate_memory",
    "get_link",
    "get_profile",
    "get_topology",
    "gpu_cost_s",
    "gradients_persist",
    "in_flight",
    "list_profiles",
    "match_device_name",
    "node_costs",
    "optimizer_state_bytes",
    "usable_capacity",
    "weight_versions",
]
