"""Capture a model as an exported op graph and measure it on the meta device.

``torch.export`` (non-strict, training mode) gives an ATen-level graph whose nodes keep their
module scope, with the batch and sequence sizes of the inputs left variable where the model's
code allows (`hf_ftpipe.graph.dynamic_shapes`): one graph serves every batch shape. One pass of
that graph over meta tensors of the planned shapes (the largest micro-batch the run will see)
then measures it (`hf_ftpipe.graph.measure`). Nothing is computed for real and no weight is read,
so a T5-3B-sized model built on the meta device is measured in seconds. An export is kept for the
process (`hf_ftpipe.graph.export_cache`): capturing the same architecture again takes it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from hf_ftpipe.errors import PipelineError, TraceError
from hf_ftpipe.graph._export_failure import explain_export_failure, without_partial_graph
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.dynamic_shapes import ShapeFormulas, dynamic_shapes_spec
from hf_ftpipe.graph.export_cache import bind_tensors, cached_program, export_key, keep_program, named_tensors
from hf_ftpipe.graph.measure import measure_graph
from hf_ftpipe.graph.modes import make_mode_aware
from hf_ftpipe.graph.mutations import fuse_mutations
from hf_ftpipe.graph.peft_models import export_target, naming_untested_peft
from hf_ftpipe.graph.shape_capture import ShapeCapture, fixed_sizes

__all__ = ["TracedModel", "capture_model", "measure_at", "trace_model"]

logger = logging.getLogger(__name__)


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
    shapes: ShapeFormulas = field(default=None)  # type: ignore[assignment]
    """Which input sizes vary, and every value's shape as a formula in them (fixed shapes: none vary)."""
    per_shape: ShapeCapture | None = None
    """Where the export fixed a batch or sequence size: how to capture the model at other sizes,
    for batches of other shapes (`hf_ftpipe.runtime.per_shape`); ``None`` where every one varies."""


def trace_model(
    model: nn.Module, sample_inputs: Mapping[str, Any], planned: Mapping[str, Sequence[int]] | None = None
) -> CostGraph:
    """Trace ``model`` on ``sample_inputs`` (keyword tensors, meta accepted) into a `CostGraph`.

    Args:
        model (`nn.Module`): a Hugging Face model (any device, meta included). It is exported in
            training mode; its weights are never read.
        sample_inputs (`Mapping[str, Any]`): the keyword arguments of one micro-batch, e.g.
            ``input_ids``, ``attention_mask``, ``labels``.
        planned (`Mapping[str, Sequence[int]]`, *optional*): the input shapes to measure the graph
            at: the largest micro-batch the run will see (default: ``sample_inputs``' own).

    Raises:
        `TraceError`: the model cannot be exported; the message names the class, the failing op
            and what to try.
    """
    return capture_model(model, sample_inputs, planned=planned).cost_graph


def capture_model(
    model: nn.Module,
    sample_inputs: Mapping[str, Any],
    *,
    planned: Mapping[str, Sequence[int]] | None = None,
    dynamic: bool = True,
) -> TracedModel:
    """Export ``model`` and measure the graph; the runtime builds its stages from the result.

    With ``dynamic`` (the default) the batch and sequence sizes of the inputs stay variable where the
    model allows; a model that cannot be exported so is exported with ``sample_inputs``' fixed
    shapes, with a warning that names the reason. Where the export fixes a batch or sequence size,
    the result records how to capture the model again at other sizes (`TracedModel.per_shape`), and
    the graph is exported at the ``planned`` sizes, the one the plan is made on. The graph is measured
    at ``planned`` (default: the sample's shapes).
    """
    exported = export_target(model)  # a LoRA PeftModel: the model holding its adapters (graph.peft_models)
    inputs = _export_inputs(exported, sample_inputs)
    name = type(model).__name__
    with _weights_on_meta(model), _without_cache(exported), naming_untested_peft(model):
        graph_module, refused = (
            _export_any_shape(exported, inputs) if dynamic else (_export(exported, inputs, None), None)
        )
        shapes = _formulas(graph_module, inputs, name)
        fixed = fixed_sizes(shapes, inputs) if dynamic else ()
        if fixed and planned is not None and any(planned[n][d] != inputs[n].shape[d] for n, d in fixed if n in planned):
            inputs = _planned_inputs(inputs, planned, None)  # the plan is made on the graph of the planned sizes
            graph_module = _export_at(exported, inputs, fixed, dynamic=refused is None)
            shapes = _formulas(graph_module, inputs, name)
            fixed = fixed_sizes(shapes, inputs)
        canonical = _canonical_names(model, graph_module)
        state_names = set(model.state_dict())
    make_mode_aware(graph_module)
    fuse_mutations(graph_module)  # its nodes keep the shapes of those they replace
    shapes = _formulas(graph_module, inputs, name)  # of the fused nodes too
    per_shape = None
    if fixed:
        reason = refused or "torch.export found that its code fixes " + ", ".join(
            f"{n!r} dimension {d} (at {shapes.inputs[n][d]})" for n, d in fixed
        )
        per_shape = ShapeCapture(model, inputs, dynamic=refused is None, fixed=fixed, reason=reason)
    if refused is not None:
        logger.warning(
            "%s cannot take batches of varying shapes (%s); it was traced with fixed shapes %s, and a batch of "
            "other shapes runs on a graph traced at its shape (hf_ftpipe.runtime.per_shape)",
            name,
            refused,
            {n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)},
        )
    measured = _planned_inputs(inputs, planned, shapes)
    cost_graph = measure_graph(model, graph_module, measured, canonical, state_names, shapes)
    real = named_tensors(model)
    tensors = {name: real[name] for name in set(canonical.values()) if name in real}
    return TracedModel(
        graph_module=graph_module,
        cost_graph=cost_graph,
        canonical_names=canonical,
        tensors=tensors,
        shapes=shapes,
        per_shape=per_shape,
    )


def measure_at(model: nn.Module, traced: TracedModel, sample_inputs: Mapping[str, Any]) -> CostGraph:
    """The `CostGraph` of ``model`` at ``sample_inputs``' shapes, from its capture ``traced`` at others.

    A capture whose batch and sequence sizes all vary is the same graph at every shape (same nodes,
    names and edges): only the measured sizes differ, so planning at several shapes (a model's tasks,
    the shipped plans) exports once. A capture with a fixed size holds at its own shape only: the model
    is traced again.
    """
    if traced.per_shape is not None or not traced.graph_module.meta.get("dynamic"):
        return trace_model(model, sample_inputs)
    inputs = _export_inputs(export_target(model), sample_inputs)
    shapes = {name: tuple(value.shape) for name, value in inputs.items() if isinstance(value, torch.Tensor)}
    measured = _planned_inputs(inputs, shapes, traced.shapes)  # checks they fit the capture
    return measure_graph(
        model, traced.graph_module, measured, traced.canonical_names, set(model.state_dict()), traced.shapes
    )


def _formulas(graph_module: fx.GraphModule, inputs: dict[str, Any], name: str) -> ShapeFormulas:
    if graph_module.meta["dynamic"]:
        return ShapeFormulas.from_graph(graph_module, name)
    return ShapeFormulas.fixed({n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)}, name)


def _export_any_shape(model: nn.Module, inputs: dict[str, Any]) -> tuple[fx.GraphModule, str | None]:
    """Export with variable batch and sequence sizes; fixed shapes where that fails, with the
    first line of the reason (``None`` when the sizes vary)."""
    try:
        return _export(model, _at_least_two(inputs), dynamic_shapes_spec(model, inputs)), None
    except TraceError as error:
        return _export(model, inputs, None), str(error).split("\n")[0]


def _export_at(
    model: nn.Module, inputs: dict[str, Any], fixed: Sequence[tuple[str, int]], dynamic: bool
) -> fx.GraphModule:
    """Export again at ``inputs``' sizes, the ``fixed`` ones as they are, the others symbolic if ``dynamic``."""
    if not dynamic:
        return _export(model, inputs, None)
    return _export(model, _at_least_two(inputs, keep=fixed), dynamic_shapes_spec(model, inputs))


def _at_least_two(inputs: dict[str, Any], keep: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
    """``inputs`` with every batch or sequence size of 1 made 2: export fixes a size it sees as 0 or 1.
    Sizes in ``keep`` (input, dimension) stay as they are."""
    grown = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            shape = [
                max(size, 2) if dim < 2 and (name, dim) not in keep else size for dim, size in enumerate(value.shape)
            ]
            value = torch.empty(shape, dtype=value.dtype, device="meta")
        grown[name] = value
    return grown


def _planned_inputs(
    inputs: dict[str, Any], planned: Mapping[str, Sequence[int]] | None, shapes: ShapeFormulas | None
) -> dict[str, Any]:
    """The meta inputs the graph is measured on: ``inputs`` at the ``planned`` shapes (checked
    against ``shapes`` when given)."""
    if planned is None:
        return inputs
    try:
        if shapes is not None:
            shapes.bind(planned)
    except PipelineError as error:
        raise PipelineError(f"the planned shapes {dict(planned)} do not fit the traced model: {error}") from None
    return {
        name: torch.empty(tuple(planned[name]), dtype=value.dtype, device="meta")
        if isinstance(value, torch.Tensor) and name in planned
        else value
        for name, value in inputs.items()
    }


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
    """The sample inputs as meta tensors, plus ``use_cache=False`` where ``forward`` names it.

    Only shapes and dtypes matter to the trace. A KV-cache object in the outputs breaks export,
    and training never needs one; a model that takes ``use_cache`` only through ``**kwargs`` is
    exported with its config's ``use_cache`` off instead (`_without_cache`), since export cannot
    vary shapes with constants in ``**kwargs``.
    """
    inputs = {
        name: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
        for name, value in sample_inputs.items()
    }
    config = getattr(model, "config", None)
    if (
        config is not None
        and hasattr(config, "use_cache")
        and "use_cache" in inspect.signature(model.forward).parameters
    ):
        inputs.setdefault("use_cache", False)
    return inputs


@contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    """``model.config.use_cache`` off while exporting (see `_export_inputs`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = before


def _export(model: nn.Module, inputs: dict[str, Any], dynamic_shapes: tuple[Any, ...] | None) -> fx.GraphModule:
    was_training = model.training
    model.train()
    try:
        key = export_key(model, inputs, dynamic_shapes)
        program = cached_program(key)
        if program is None:
            program = _export_program(model, inputs, dynamic_shapes)
            keep_program(key, program)
    finally:
        model.train(was_training)
    graph_module = program.module()
    bind_tensors(graph_module, model)  # a kept program's graph holds the tensors of the model it was made from
    _drop_checks(graph_module)
    graph_module.meta["output_names"] = _output_names(program)
    graph_module.meta["input_names"] = tuple(inputs)
    graph_module.meta["dynamic"] = dynamic_shapes is not None
    # The relations between input sizes the model's code needs (dropped with the guards below; the
    # pipeline checks them per micro-batch): Python expressions over L['name'].size()[dim].
    graph_module.meta["input_relations"] = tuple(getattr(program, "_guards_code", None) or ())
    return graph_module


def _export_program(
    model: nn.Module, inputs: dict[str, Any], dynamic_shapes: tuple[Any, ...] | None
) -> torch.export.ExportedProgram:
    try:
        with without_partial_graph():
            return torch.export.export(model, (), kwargs=inputs, strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as error:  # torch raises many unrelated types here
        raise TraceError(explain_export_failure(model, error)) from error


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
