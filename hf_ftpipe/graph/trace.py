"""Capture a model as an exported op graph and measure it on the meta device.

``torch.export`` (non-strict, training mode) gives an ATen-level graph whose nodes keep their
module scope. One pass of that graph over meta tensors then records, per node, output shapes and
bytes, the parameters it reads, its forward FLOPs (``FlopCounterMode`` works on meta tensors) and
whether it takes part in backward. Nothing is computed for real and no weight is read, so a
T5-3B-sized model built on the meta device is measured in seconds.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph._export_failure import explain_export_failure, without_partial_graph
from hf_ftpipe.graph.cost_graph import CostGraph, InputInfo, ParamInfo
from hf_ftpipe.graph.fingerprint import model_fingerprint
from hf_ftpipe.graph.modes import make_mode_aware
from hf_ftpipe.graph.mutations import fuse_mutations

__all__ = ["TracedModel", "trace_model", "capture_model"]


@dataclass
class TracedModel:
    """An exported model: its graph (traced on meta), its CostGraph, and the model's own tensors.

    The graph always comes from a meta twin of the model, so the same model gives the same
    graph, node names and fingerprint wherever its weights live (meta, CPU or GPU): a partition
    planned from a config alone names the nodes the runtime builds.
    """

    graph_module: fx.GraphModule
    cost_graph: CostGraph
    canonical_names: dict[str, str]
    """Every tensor ``get_attr`` target of the graph → the canonical name of the tensor it reads."""
    tensors: dict[str, torch.Tensor]
    """Canonical name → the model's real parameter or buffer, which the stages bind to."""


def trace_model(model: nn.Module, sample_inputs: Mapping[str, Any]) -> CostGraph:
    """Trace ``model`` on ``sample_inputs`` (keyword tensors, meta accepted) into a `CostGraph`.

    Args:
        model (`nn.Module`): a Hugging Face model (any device, meta included). It is exported in
            training mode; its weights are never read.
        sample_inputs (`Mapping[str, Any]`): the keyword arguments of one micro-batch, e.g.
            ``input_ids``, ``attention_mask``, ``labels``. Shapes are fixed into the graph.

    Raises:
        `TraceError`: the model cannot be exported; the message names the class, the failing op
            and what to try.
    """
    return capture_model(model, sample_inputs).cost_graph


def capture_model(model: nn.Module, sample_inputs: Mapping[str, Any]) -> TracedModel:
    """Export ``model`` and measure the graph; the runtime builds its stages from the result."""
    inputs = _export_inputs(model, sample_inputs)
    with _weights_on_meta(model):
        graph_module = _export(model, inputs)
        canonical = _canonical_names(model, graph_module)
        state_names = set(model.state_dict())
    make_mode_aware(graph_module)
    fuse_mutations(graph_module)
    cost_graph = _measure(model, graph_module, inputs, canonical, state_names)
    real = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    tensors = {name: real[name] for name in set(canonical.values()) if name in real}
    return TracedModel(graph_module=graph_module, cost_graph=cost_graph, canonical_names=canonical, tensors=tensors)


@contextmanager
def _weights_on_meta(model: nn.Module) -> Iterator[None]:
    """Swap every parameter and buffer for a meta twin (tied ones stay tied); put them back on exit."""
    twins: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for leaf, tensor in list(store.items()):
                if tensor is None:
                    continue
                if id(tensor) not in twins:
                    twin = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, nn.Parameter):
                        twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
                    twins[id(tensor)] = twin
                swapped.append((store, leaf, tensor))
                store[leaf] = twins[id(tensor)]
    try:
        yield
    finally:
        for store, leaf, tensor in swapped:
            store[leaf] = tensor


def _export_inputs(model: nn.Module, sample_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The sample inputs as meta tensors, plus ``use_cache=False``.

    Only shapes and dtypes matter to the trace. A KV-cache object in the outputs breaks export,
    and training never needs one.
    """
    inputs = {
        name: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
        for name, value in sample_inputs.items()
    }
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        inputs.setdefault("use_cache", False)
    return inputs


def _export(model: nn.Module, inputs: dict[str, Any]) -> fx.GraphModule:
    was_training = model.training
    model.train()
    try:
        with without_partial_graph():
            program = torch.export.export(model, (), kwargs=inputs, strict=False)
    except Exception as error:  # torch raises many unrelated types here
        raise TraceError(explain_export_failure(model, error)) from error
    finally:
        model.train(was_training)
    graph_module = program.module()
    _drop_checks(graph_module)
    graph_module.meta["output_names"] = _output_names(program)
    graph_module.meta["input_names"] = tuple(inputs)
    return graph_module


def _drop_checks(graph_module: fx.GraphModule) -> None:
    """Remove export's input guards and tensor-metadata asserts.

    They have no outputs, would drag every model input into the first stage, and the runtime
    checks micro-batch shapes itself with a clearer message.
    """
    for node in reversed(list(graph_module.graph.nodes)):
        is_guard = node.op == "call_module" and str(node.target).startswith("_guards")
        is_assert = node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
        if (is_guard or is_assert) and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()


def _output_names(program: torch.export.ExportedProgram) -> tuple[str, ...]:
    spec = program.call_spec.out_spec
    context = getattr(spec, "context", None)
    if isinstance(context, list | tuple) and all(isinstance(key, str) for key in context):
        return tuple(context)
    return tuple(f"output_{index}" for index in range(spec.num_leaves))


def _canonical_names(model: nn.Module, graph_module: fx.GraphModule) -> dict[str, str]:
    """Map every ``get_attr`` target to the canonical name of its tensor (tied weights share one)."""
    canonical_by_id: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        canonical_by_id.setdefault(id(tensor), name)
    names: dict[str, str] = {}
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            value = _fetch_attr(graph_module, node.target)
            # Submodules of higher-order ops (autocast or no-grad regions) are code, not weights.
            if isinstance(value, torch.Tensor):
                names[node.target] = canonical_by_id.get(id(value), node.target)
    return names


def _fetch_attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _measure(
    model: nn.Module,
    graph_module: fx.GraphModule,
    meta_inputs: dict[str, Any],
    canonical: dict[str, str],
    state_names: set[str],
) -> CostGraph:
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
        if node.op not in ("call_function", "call_module"):
            continue
        record = recorder.records[node.name]
        producers = [arg for arg in node.all_input_nodes]
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
        )
        order += 1
        for producer in producers:
            if producer.op in ("call_function", "call_module"):
                graph.add_edge(producer.name, node.name, bytes=recorder.records[producer.name]["bytes"])

    output_node = next(node for node in graph_module.graph.nodes if node.op == "output")
    flat_outputs, _ = tree_flatten(output_node.args[0])
    example = {
        name: InputInfo(name, tuple(v.shape), str(v.dtype).removeprefix("torch."))
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
