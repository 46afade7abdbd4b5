"""Model fingerprints: what makes two traced models interchangeable for one partition."""

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
    """The model config without names, ids, dropout rates and other settings a partition ignores."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    return {
        key: value
        for key, value in sorted(config.to_dict().items())
        if key not in _NON_STRUCTURAL and "dropout" not in key and not key.startswith("_")
    }


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
    """A 16-hex-digit fingerprint of the model's class, structural config and traced graph."""
    payload = json.dumps(
        {"class": type(model).__name__, "config": structural_config(model), "graph": graph_hash(graph)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
