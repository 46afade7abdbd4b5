"""Graph capture: a model becomes a CostGraph of ops with shapes, parameters and FLOPs."""

from .cost_graph import CostGraph, InputInfo, ParamInfo
from .fingerprint import graph_hash, model_fingerprint, structural_config
from .trace import TracedModel, capture_model, trace_model

__all__ = [
    "CostGraph",
    "InputInfo",
    "ParamInfo",
    "TracedModel",
    "capture_model",
    "graph_hash",
    "model_fingerprint",
    "structural_config",
    "trace_model",
]
