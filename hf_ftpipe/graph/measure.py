"""Measure an exported graph on the meta device: per node shapes, bytes, FLOPs and what backward keeps.

One pass of the graph over meta tensors records, per node, output shapes and bytes, the
parameters it reads, its forward FLOPs (``FlopCounterMode`` works on meta tensors) and whether it
takes part in backward. Nothing is computed for real and no weight is read. Nodes that compute a
size (``sym_size`` of a dynamic dimension) are not ops of the cost graph: they cost nothing and
every stage evaluates them from its micro-batch's shapes (`hf_ftpipe.graph.dynamic_shapes`).
"""

from __future__ import annotations

import copy
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph.cost_graph import CostGraph, InputInfo, ParamInfo
from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas, is_size_node
from hf_ftpipe.graph.fingerprint import model_fingerprint

__all__ = ["measure_graph"]


def measure_graph(
    model: nn.Module,
    graph_module: fx.GraphModule,
    meta_inputs: dict[str, Any],
    canonical: dict[str, str],
    state_names: set[str],
    shapes: ShapeFormulas | None = None,
) -> CostGraph:
    """The `CostGraph` of ``graph_module`` run on ``meta_inputs`` (the shapes it is measured at);
    ``shapes`` says which input sizes vary (recorded in `InputInfo.varying`)."""
    params = _param_infos(model, graph_module, canonical, state_names)
    recorder = _MetaRecorder(graph_module, canonical)
    try:
        recorder.run(*[meta_inputs[node.target] for node in recorder.placeholders])
    except Exception as error:
        raise TraceError(
            f"cannot measure {type(model).__name__} on the meta device: node "
            f"{recorder.current!r} failed with {type(error).__name__}: {error}. "
            "An op without a meta implementation or a data-dependent shape is the usual cause; "
            "report the op name."
        ) from error

    graph = nx.DiGraph()
    placeholder_names = {node.name for node in recorder.placeholders}
    attr_nodes = {node.name for node in graph_module.graph.nodes if node.op == "get_attr" and node.target in canonical}
    order = 0
    for node in graph_module.graph.nodes:
        if node.op not in ("call_function", "call_module") or is_size_node(node):
            continue
        record = recorder.records[node.name]
        producers = [arg for arg in node.all_input_nodes if not is_size_node(arg)]
        graph.add_node(
            node.name,
            order=order,
            op=str(node.target) if node.op == "call_function" else _module_op_name(graph_module, node),
            scope=record["scope"],
            scope_types=record["scope_types"],
            output_shapes=record["shapes"],
            output_dtypes=record["dtypes"],
            output_bytes=record["bytes"],
            params=tuple(sorted({canonical[p.target] for p in producers if p.name in attr_nodes})),
            batch_inputs=tuple(p.name for p in producers if p.name in placeholder_names),
            flops=record["flops"],
            bytes_accessed=record["bytes"] + record["input_bytes"],
            saved_bytes=record["saved_bytes"],
            requires_grad=record["requires_grad"],
            size_inputs=tuple(arg.name for arg in node.all_input_nodes if is_size_node(arg)),
        )
        order += 1
        for producer in producers:
            if producer.op in ("call_function", "call_module"):
                graph.add_edge(producer.name, node.name, bytes=recorder.records[producer.name]["bytes"])

    output_node = next(node for node in graph_module.graph.nodes if node.op == "output")
    flat_outputs, _ = tree_flatten(output_node.args[0])
    example = {
        name: InputInfo(
            name, tuple(v.shape), str(v.dtype).removeprefix("torch."), varying=shapes.varying(name) if shapes else ()
        )
        if isinstance(v, torch.Tensor)
        else InputInfo(name, None, None, constant=v)
        for name, v in meta_inputs.items()
    }
    cost_graph = CostGraph(
        graph=graph,
        params=params,
        inputs=example,
        outputs=tuple(n.name if isinstance(n, fx.Node) else str(n) for n in flat_outputs),
        output_names=graph_module.meta["output_names"],
        model_class=type(model).__name__,
    )
    cost_graph.fingerprint = model_fingerprint(model, cost_graph)
    return cost_graph


def _module_op_name(graph_module: fx.GraphModule, node: fx.Node) -> str:
    submodule = graph_module.get_submodule(node.target)
    return str(getattr(submodule, "op", type(submodule).__name__))


def _param_infos(
    model: nn.Module, graph_module: fx.GraphModule, canonical: dict[str, str], state_names: set[str]
) -> dict[str, ParamInfo]:
    aliases: dict[str, list[str]] = {}
    for target, name in canonical.items():
        aliases.setdefault(name, [name])
        if target != name and target not in aliases[name]:
            aliases[name].append(target)
    buffers = {name for name, _ in model.named_buffers()}
    infos: dict[str, ParamInfo] = {}
    for name, names in aliases.items():
        tensor = _fetch_attr(graph_module, next(t for t, c in canonical.items() if c == name))
        infos[name] = ParamInfo(
            name=name,
            aliases=tuple(names),
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            bytes=tensor.numel() * tensor.element_size(),
            requires_grad=bool(getattr(tensor, "requires_grad", False)),
            is_buffer=name in buffers or not isinstance(tensor, nn.Parameter),
            in_state_dict=name in state_names,
        )
    return infos


class _MetaRecorder(fx.Interpreter):
    """Runs the graph on meta tensors, recording per node shapes, bytes, FLOPs and requires_grad."""

    def __init__(self, graph_module: fx.GraphModule, canonical: dict[str, str]) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        self.placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self.records: dict[str, dict[str, Any]] = {}
        self.current = ""
        self._meta_params: dict[str, torch.Tensor] = {}
        self._canonical = canonical
        self._counter = FlopCounterMode(display=False)
        self._meta_regions: dict[int, fx.GraphModule] = {}
        self._saved: dict[int, torch.Tensor] = {}
        self._saved_now = 0
        self._param_ids: set[int] = set()

    def run(self, *args: Any) -> Any:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        with self._counter, torch.enable_grad(), hooks:
            return super().run(*args)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor autograd keeps for backward once, views of it included, weights excluded."""
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self._saved and id(base) not in self._param_ids:
            self._saved[id(base)] = base  # holding it keeps the id from being reused
            self._saved_now += _nbytes(base)
        return tensor

    def _fused_attention_saved(self, node: fx.Node, output: torch.Tensor, saved_before: set[int]) -> None:
        """What a fused attention kernel keeps for backward, in place of the math decomposition's.

        On meta, ``scaled_dot_product_attention`` runs its math decomposition, which saves the
        attention probabilities (batch × heads × query × key). The runtime's kernels (flash and
        memory-efficient on CUDA, flash on the CPU) keep the query, key, value, output and one
        log-sum-exp per query row and head instead, and a mask as an additive bias of the query's
        dtype, of its full (broadcast) shape.
        """
        for key in set(self._saved) - saved_before:
            del self._saved[key]
        self._saved_now = 0
        for arg in node.args[:3]:
            value = self.env.get(arg) if isinstance(arg, fx.Node) else None
            if isinstance(value, torch.Tensor):
                self._pack(value)
        self._pack(output)
        rows = output.numel() // output.shape[-1]
        self._saved_now += rows * (8 if output.dtype == torch.float64 else 4)
        mask_arg = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mask = self.env.get(mask_arg) if isinstance(mask_arg, fx.Node) else None
        if isinstance(mask, torch.Tensor):
            self._saved_now += mask.numel() * output.element_size()

    def fetch_attr(self, target: str) -> Any:
        key = self._canonical.get(target, target)
        if key not in self._meta_params:
            real = super().fetch_attr(target)
            if not isinstance(real, torch.Tensor):
                return real
            meta = torch.empty(real.shape, dtype=real.dtype, device="meta")
            self._meta_params[key] = meta.requires_grad_(real.requires_grad and real.is_floating_point())
            self._param_ids.add(id(self._meta_params[key]))
        return self._meta_params[key]

    def call_function(self, target: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        # The export baked the model's device into factory and `.to()` calls; keep everything on meta.
        args = tuple(self._on_meta(a) for a in args)
        kwargs = {k: self._on_meta(v) for k, v in kwargs.items()}
        return super().call_function(target, args, kwargs)

    def _on_meta(self, value: Any) -> Any:
        """Device arguments become meta; so do those inside a higher-order op's region (a submodule)."""
        if isinstance(value, torch.device):
            return torch.device("meta")
        if isinstance(value, fx.GraphModule):
            if id(value) not in self._meta_regions:
                self._meta_regions[id(value)] = _with_meta_devices(copy.deepcopy(value))
            return self._meta_regions[id(value)]
        return value

    def run_node(self, node: fx.Node) -> Any:
        self.current = node.name
        self._saved_now = 0
        flops_before = self._counter.get_total_flops()
        saved_before = set(self._saved)
        result = super().run_node(node)
        if _is_attention(node, self.module):
            self._fused_attention_saved(node, result, saved_before)
        if node.op in ("call_function", "call_module"):
            tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            inputs = [
                t
                for arg in node.all_input_nodes
                if arg.op != "get_attr"
                for t in tree_flatten(self.env.get(arg))[0]
                if isinstance(t, torch.Tensor)
            ]
            scope, scope_types = _scope(node)
            self.records[node.name] = {
                "shapes": tuple(tuple(t.shape) for t in tensors),
                "dtypes": tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                "bytes": sum(_nbytes(t) for t in tensors),
                "saved_bytes": self._saved_now,
                "input_bytes": sum(_nbytes(t) for t in inputs),
                "flops": float(self._counter.get_total_flops() - flops_before),
                "requires_grad": any(t.requires_grad for t in tensors),
                "scope": scope,
                "scope_types": scope_types,
            }
        return result


def _is_attention(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target is torch.ops.aten.scaled_dot_product_attention.default
    if node.op == "call_module":  # made mode-aware (`graph.modes`)
        return (
            getattr(root.get_submodule(node.target), "op", None) is torch.ops.aten.scaled_dot_product_attention.default
        )
    return False


def _with_meta_devices(region: fx.GraphModule) -> fx.GraphModule:
    """A higher-order op's region with every baked device argument moved to meta, nested ones too."""
    meta = torch.device("meta")
    for node in region.graph.nodes:
        node.args = tuple(meta if isinstance(a, torch.device) else a for a in node.args)
        node.kwargs = {k: meta if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
    for child in region.children():
        if isinstance(child, fx.GraphModule):
            _with_meta_devices(child)
    region.recompile()
    return region


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _scope(node: fx.Node) -> tuple[str, tuple[str, ...]]:
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return "", ()
    path = entries[-1][0] if isinstance(entries[-1], tuple) else ""
    types = tuple(str(entry[1]).rsplit(".", 1)[-1] if isinstance(entry, tuple) else "" for entry in entries)
    return _clean_scope(path), types


def _clean_scope(path: str) -> str:
    """``L['self'].encoder.block[0]``-style paths (older exporters) to ``encoder.block.0``."""
    for old, new in (("L['self'].", ""), ("L['self']", ""), ("[", "."), ("]", ""), ("'", "")):
        path = path.replace(old, new)
    return path.strip(".")


def _fetch_attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value
