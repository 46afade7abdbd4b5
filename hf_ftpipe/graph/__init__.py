"""Graph capture: a model becomes a CostGraph of ops with shapes, parameters and FLOPs.

``CostGraph`` is plain data, read by the planner without torch; capturing needs torch, so the
capture names are imported on first use. ``load_model_for_planning`` builds a model to trace from
its config alone (the paper's models ship with the package: ``shipped_models()``), and
``apply_lora`` puts LoRA adapters on it (``peft``) to plan LoRA fine-tuning.
"""

from hf_ftpipe._lazy import lazy_getattr

_HOMES = {
    "CostGraph": "hf_ftpipe.graph.cost_graph",
    "apply_lora": "hf_ftpipe.graph.peft_models",
    "InputInfo": "hf_ftpipe.graph.cost_graph",
    "ParamInfo": "hf_ftpipe.graph.cost_graph",
    "match_ops": "hf_ftpipe.graph.alignment",
    "op_rows": "hf_ftpipe.graph.alignment",
    "graph_hash": "hf_ftpipe.graph.fingerprint",
    "model_fingerprint": "hf_ftpipe.graph.fingerprint",
    "structural_config": "hf_ftpipe.graph.fingerprint",
    "load_config": "hf_ftpipe.graph.sources",
    "load_model_for_planning": "hf_ftpipe.graph.sources",
    "sample_inputs_for": "hf_ftpipe.graph.sources",
    "shipped_models": "hf_ftpipe.graph.sources",
    "ShapeCapture": "hf_ftpipe.graph.shape_capture",
    "TracedModel": "hf_ftpipe.graph.trace",
    "clear_export_cache": "hf_ftpipe.graph.export_cache",
    "capture_model": "hf_ftpipe.graph.trace",
    "trace_model": "hf_ftpipe.graph.trace",
    "SlicedModel": "hf_ftpipe.graph.token_slices",
    "capture_token_slices": "hf_ftpipe.graph.token_slices",
    "check_sliceable": "hf_ftpipe.graph.token_slices",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_getattr(__name__, _HOMES)
