"""Device profiles and the analytical cost model that turn a CostGraph into seconds."""

from hf_ftpipe.profile.cost import (
    NodeCost,
    backward_factor,
    backward_time_s,
    comm_time_s,
    compute_time_s,
    edge_comm_s,
    node_costs,
)
from hf_ftpipe.profile.gpu import (
    BUILTIN_PROFILES,
    DType,
    GPUProfile,
    canonical_dtype,
    detect_profile,
    get_profile,
    list_profiles,
    match_device_name,
)

__all__ = [
    "BUILTIN_PROFILES",
    "DType",
    "GPUProfile",
    "NodeCost",
    "backward_factor",
    "backward_time_s",
    "canonical_dtype",
    "comm_time_s",
    "compute_time_s",
    "detect_profile",
    "edge_comm_s",
    "get_profile",
    "list_profiles",
    "match_device_name",
    "node_costs",
]
