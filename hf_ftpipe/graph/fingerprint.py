"""Model fingerprints: what makes two traced models interchangeable for one partition.

A plan depends on the model's class, its structural config and its weights' names and shapes:
those are what `model_fingerprint` hashes, and what a plan's key records. The traced graph
itself is not in it: its ops change with every transformers release (an op added, reordered or
renamed inside a layer) while the model and the plan's stages stay the same. The exact graph has
its own hash, `graph_hash`, which a plan records beside its key as a check (`plan.anchors`), so
that a plan made on another release's graph is re-anchored onto this one (`plan.reanchor`)
rather than lost.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["model_fingerprint", "graph_hash", "structural_config"]

# Config entries that change neither the graph's structure nor its costs.
_NON_STRUCTURAL = {
    "_name_or_path",
    "transformers_version",
    "architectures",
    "id2label",
    "label2id",
    "torch_dtype",
    "dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "finetuning_task",
    "task_specific_params",
    "problem_type",
    "_commit_hash",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "prefix",
    "tokenizer_class",
    "initializer_range",
    "initializer_factor",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "_attn_implementation_autoset",
}


def structural_config(model: nn.Module) -> dict[str, Any]:
    """The model config without names, ids, dropout rates and other settings a partition ignores,
    and without entries at their class's default: a key that a newer transformers adds with its
    default value leaves the fingerprint as it was."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    defaults = _class_defaults(config)
    return {
        key: value
        for key, value in sorted(config.to_dict().items())
        if key not in _NON_STRUCTURAL
        and "dropout" not in key
        and not key.startswith("_")
        and (key not in defaults or defaults[key] != value)
    }


def _class_defaults(config: Any) -> dict[str, Any]:
    """``config``'s class built with no arguments, as a dict; empty when the class needs arguments
    (a composite config): every entry then counts."""
    try:
        return type(config)().to_dict()
    except Exception:  # any constructor may refuse to build without arguments
        return {}


def graph_hash(graph: CostGraph) -> str:
    """SHA-256 over every node's name, op, scope, inputs, output shapes and parameters, in order."""
    digest = hashlib.sha256()
    for name in graph.topological_order():
        attrs = graph.node(name)
        row = [
            name,
            attrs["op"],
            attrs["scope"],
            sorted(graph.graph.predecessors(name)),
            attrs["output_shapes"],
            attrs["output_dtypes"],
            attrs["params"],
            attrs["batch_inputs"],
        ]
        digest.update(json.dumps(row, default=list).encode())
    for param in sorted(graph.params.values(), key=lambda p: p.name):
        digest.update(json.dumps([param.name, param.shape, param.dtype, param.requires_grad]).encode())
    return digest.hexdigest()


def model_fingerprint(model: nn.Module, graph: CostGraph) -> str:
    """A 16-hex-digit fingerprint of the model's class, structural config and weights (the name,
    shape, dtype and trainability of every parameter ``graph`` records). Buffers and constants are
    left out: releases add and drop them (a cached mask, a lifted constant) without changing the
    model a checkpoint holds."""
    weights = [
        [p.name, list(p.shape), p.dtype, p.requires_grad]
        for p in sorted(graph.params.values(), key=lambda p: p.name)
        if not p.is_buffer and p.in_state_dict
    ]
    payload = json.dumps(
        {"class": type(model).__name__, "config": structural_config(model), "weights": weights},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
