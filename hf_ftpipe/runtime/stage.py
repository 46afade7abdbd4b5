"""Stages: what each stage reads, computes and hands on, and the module that runs it.

A stage is the set of graph nodes a partition gives one stage index. From the exported graph
and ``node_stage`` this module derives, as plain data, every value that crosses a stage
boundary (``StageSpec``), then builds a stage as its own ``fx.GraphModule`` that shares the
model's parameters. Stages are detached from each other: a stage's forward returns the values
other stages read, and its backward is driven explicitly by the schedule. That keeps one
rule for neighbours, non-adjacent stages and stages that share a rank (Mixed-Pipe).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import networkx as nx
import torch
from torch import fx

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.plan.validate import check_stages

__all__ = ["StagePlacement", "StageSpec", "build_stage_module", "loss_reads_of", "plan_stages"]


class StagePlacement(Protocol):
    """What the engine needs of a partition: node → stage and stage → rank."""

    node_stage: dict[str, int]
    stage_device: list[int]


@dataclass
class StageSpec:
    """The data flow of one stage, derived from the graph and the partition."""

    stage_index: int
    nodes: list[str]
    batch_inputs: list[str]
    """Model inputs (``input_ids``, ``labels``...) the stage reads from its own copy of the batch."""
    received: list[str]
    """Values produced by earlier stages, in the order they are passed to the stage module."""
    sent: list[str]
    """Values the stage produces for later stages or as model outputs, in the module's output order."""
    consumers: dict[str, list[int]] = field(default_factory=dict)
    """For each sent value, the stages that read it."""
    model_outputs: dict[str, str] = field(default_factory=dict)
    """Model output name (``loss``, ``logits``) → the sent value that holds it."""
    size_inputs: list[str] = field(default_factory=list)
    """Size nodes the stage reads (a varying sequence length...), evaluated per micro-batch from its
    input shapes (`hf_ftpipe.runtime.shapes`); passed after the batch inputs."""


def plan_stages(graph: CostGraph, node_stage: Mapping[str, int], loss_reads: Collection[str] = ()) -> list[StageSpec]:
    """Derive every stage's inputs and outputs. Raises `PartitionError` on a malformed assignment
    (``plan.validate.check_stages``, or a value that is not one tensor read across stages).

    ``loss_reads`` names model outputs (``logits``) that a loss computed from the outputs reads on
    the loss stage (`hf_ftpipe.trainer.output_loss`): each one produced on another stage is read
    there too, as if an op of the loss stage read it, so it travels with its shape and its gradient
    comes back like any other value's (once, if the loss stage reads it anyway). Only the loss's
    own ancestors can be read so: any other output may be produced after the loss stage.
    """
    check_stages(graph, node_stage)
    num_stages = max(node_stage.values()) + 1
    specs = [StageSpec(s, [], [], [], []) for s in range(num_stages)]
    for name in graph.topological_order():
        specs[node_stage[name]].nodes.append(name)

    for name in graph.topological_order():
        stage = node_stage[name]
        attrs = graph.node(name)
        for batch_input in attrs["batch_inputs"]:
            if batch_input not in specs[stage].batch_inputs:
                specs[stage].batch_inputs.append(batch_input)
        for size in attrs.get("size_inputs", ()):
            if size not in specs[stage].size_inputs:
                specs[stage].size_inputs.append(size)
        for producer in graph.graph.predecessors(name):
            source = node_stage[producer]
            if source == stage:
                continue
            if len(graph.node(producer)["output_shapes"]) != 1:
                raise PartitionError(
                    f"{producer!r} ({graph.node(producer)['op']}) returns several tensors and is read across "
                    f"stages {source} → {stage}; keep it with its getitem users in one stage"
                )
            _read_across(specs, producer, source, stage)

    for output_name, value in zip(graph.output_names, graph.outputs, strict=False):
        if value not in node_stage:
            continue
        spec = specs[node_stage[value]]
        if value not in spec.consumers:
            spec.sent.append(value)
            spec.consumers[value] = []
        spec.model_outputs[output_name] = value
    for value in _routed_to_loss(graph, node_stage, loss_reads):
        _read_across(specs, value, node_stage[value], node_stage[dict(_outputs(graph))["loss"]])
    return specs


def loss_reads_of(graph: CostGraph, specs: Sequence[StageSpec]) -> list[str]:
    """The model outputs ``specs``' loss stage reads from other stages: the ``loss_reads`` that
    `plan_stages` was given, as far as they needed routing (to plan another capture alike)."""
    loss_stage = next((spec for spec in specs if "loss" in spec.model_outputs), None)
    if loss_stage is None:
        return []
    return [name for name, value in _outputs(graph) if value in loss_stage.received]


def _outputs(graph: CostGraph) -> list[tuple[str, str]]:
    return list(zip(graph.output_names, graph.outputs, strict=False))


def _routed_to_loss(graph: CostGraph, node_stage: Mapping[str, int], loss_reads: Collection[str]) -> list[str]:
    """The values of ``loss_reads`` that another stage than the loss's produces and the loss depends on."""
    outputs = dict(_outputs(graph))
    loss = outputs.get("loss")
    if not loss_reads or loss not in node_stage:
        return []
    ancestors = nx.ancestors(graph.graph, loss)
    routed = []
    for name in loss_reads:
        value = outputs.get(name)
        if value in ancestors and node_stage[value] != node_stage[loss] and value not in routed:
            if len(graph.node(value)["output_shapes"]) == 1:
                routed.append(value)
    return routed


def _read_across(specs: list[StageSpec], value: str, source: int, stage: int) -> None:
    """Record that ``stage`` reads ``value``, which ``source`` produces (once, however often it is read)."""
    if value not in specs[stage].received:
        specs[stage].received.append(value)
    source_spec = specs[source]
    if value not in source_spec.consumers:
        source_spec.sent.append(value)
        source_spec.consumers[value] = []
    if stage not in source_spec.consumers[value]:
        source_spec.consumers[value].append(stage)


def build_stage_module(
    graph_module: fx.GraphModule,
    spec: StageSpec,
    canonical_names: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
) -> fx.GraphModule:
    """A GraphModule computing ``spec``: ``forward(*batch_inputs, *size_inputs, *received) -> tuple(sent)``.

    Parameters are read under their canonical names (a tied weight is one attribute) and bound to
    ``tensors``, the model's own: nothing is copied. The graph was traced on meta, so every device
    argument baked into it (``arange(device=...)``, ``.to(device)``) is pointed at ``device``.
    """
    source_nodes = {node.name: node for node in graph_module.graph.nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in [*spec.batch_inputs, *spec.size_inputs, *spec.received]:
        env[name] = graph.placeholder(name)

    def lookup(node: fx.Node) -> fx.Node:
        if node.name in env:
            return env[node.name]
        if node.op == "get_attr":
            env[node.name] = graph.get_attr(canonical_names.get(node.target, node.target))
            return env[node.name]
        raise PartitionError(f"stage {spec.stage_index}: {node.name!r} is neither received nor computed here")

    for name in spec.nodes:
        env[name] = graph.node_copy(source_nodes[name], lookup)
    graph.output(tuple(env[name] for name in spec.sent))
    root = _attribute_root(graph_module, graph, canonical_names, tensors, device)
    module = fx.GraphModule(root, graph, class_name=f"Stage{spec.stage_index}")
    retarget_devices(module, device)
    return module


def retarget_devices(module: fx.GraphModule, device: torch.device) -> None:
    """Point every device argument in ``module``'s graph, and in its nested regions, at ``device``."""
    for submodule in module.modules():
        if not isinstance(submodule, fx.GraphModule):
            continue
        for node in submodule.graph.nodes:
            node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
            node.kwargs = {k: device if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
        submodule.recompile()


def _attribute_root(
    graph_module: fx.GraphModule,
    graph: fx.Graph,
    canonical_names: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
) -> torch.nn.Module:
    """A module holding exactly the tensors and submodules the stage graph refers to."""
    aliases = {canonical: target for target, canonical in canonical_names.items()}
    root = torch.nn.Module()
    for node in graph.nodes:
        if node.op == "get_attr":
            if node.target in tensors:
                value = tensors[node.target]
            else:  # a constant the exporter lifted, or a higher-order op's region
                value = _fetch(graph_module, aliases.get(node.target, node.target))
                if isinstance(value, fx.GraphModule):
                    value = copy.deepcopy(value)  # retargeted per stage; the traced graph stays as is
                elif isinstance(value, torch.Tensor) and value.is_meta:
                    raise PartitionError(
                        f"the traced constant {node.target!r} has no value: the exporter created it on "
                        "the meta device. Please report the model class to hf_ftpipe."
                    )
            _assign(root, node.target, value)
        elif node.op == "call_module":
            submodule = graph_module.get_submodule(node.target)
            if isinstance(submodule, fx.GraphModule):  # a fused region: retargeted per stage
                submodule = copy.deepcopy(submodule)
            _assign(root, node.target, submodule)
    return root


def _fetch(module: torch.nn.Module, target: str) -> object:
    value: object = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _assign(root: torch.nn.Module, target: str, value: object) -> None:
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.nn.Module):
        module.add_module(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)
