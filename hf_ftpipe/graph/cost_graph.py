"""CostGraph: the traced op graph as plain data that partitioners read and never mutate.

A node is one operation of the exported model (an fx ``call_function`` node), keyed by its fx
name. Node attributes (all plain Python values, so a graph pickles, hashes and prints):

``op`` (`str`)
    the ATen target, e.g. ``"aten.linear.default"``.
``scope`` (`str`)
    the innermost module path that issued the op, e.g. ``"encoder.block.3.layer.1"``;
    ``""`` for the top-level module.
``scope_types`` (`tuple[str, ...]`)
    the class names of the module stack, outermost first, e.g. ``("T5ForConditionalGeneration",
    "T5Stack", "T5Block")``. Repeated classes are the natural blocks Mixed-Pipe coarsens to.
``output_shapes`` / ``output_dtypes`` (`tuple`)
    one entry per tensor output (most ops have one; ``split`` has several).
``output_bytes`` (`int`)
    bytes of all tensor outputs: the activation memory this node holds and what an edge carries.
``params`` (`tuple[str, ...]`)
    canonical names of the parameters and buffers the node reads. Tied parameters appear under
    one canonical name, so a tied weight is counted once.
``batch_inputs`` (`tuple[str, ...]`)
    names of the model inputs (``input_ids``, ``labels``...) the node reads directly.
``flops`` (`float`)
    forward floating-point operations (``FlopCounterMode``'s count).
``bytes_accessed`` (`int`)
    bytes read and written by the forward: tensor inputs + outputs + parameters.
``saved_bytes`` (`int`)
    bytes of the tensors autograd keeps from this node's forward until its backward (views of one
    tensor counted once, weights not at all): the activation memory one micro-batch in flight
    costs. Often far less than ``output_bytes`` summed, since views and temporaries are free.
``requires_grad`` (`bool`)
    whether the node's outputs take part in backward (a floating output downstream of a
    trainable parameter). Decides which activations travel back as gradients.
``size_inputs`` (`tuple[str, ...]`)
    the size nodes (``aten.sym_size`` of a varying input dimension) the node reads, e.g. the
    sequence length a ``view`` reshapes to. They are not nodes of the graph: every stage
    evaluates them from its micro-batch's shapes (`hf_ftpipe.graph.dynamic_shapes`).

Shapes and bytes are those of the planned micro-batch (the largest the run will see).

Edge ``u -> v`` means ``v`` reads an output of ``u``; attribute ``bytes`` is what ``u`` sends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx

__all__ = ["CostGraph", "InputInfo", "ParamInfo"]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer, under its canonical name (the first name it is registered as)."""

    name: str
    aliases: tuple[str, ...]
    """Every name the tensor is reachable under, canonical first (tied weights have several)."""
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    requires_grad: bool
    is_buffer: bool = False
    in_state_dict: bool = True
    """False for constants the exporter lifted out of the code (they are not model weights)."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class InputInfo:
    """One model input (an exported placeholder): a tensor, or a constant."""

    name: str
    shape: tuple[int, ...] | None
    """The planned shape: the largest micro-batch's (sizes in `varying` are the most it may have)."""
    dtype: str | None
    constant: bool | int | float | str | None = None
    """The value of a non-tensor input (``use_cache=False``); ``None`` for tensors."""
    varying: tuple[int, ...] = ()
    """The dimensions whose size may differ from micro-batch to micro-batch (batch, sequence)."""


@dataclass
class CostGraph:
    """A traced model as a DAG of ops with shapes, parameters and FLOPs (see the module docstring)."""

    graph: nx.DiGraph
    params: dict[str, ParamInfo]
    inputs: dict[str, InputInfo]
    outputs: tuple[str, ...]
    """The node names the model returns, in the model's output order (``loss`` first when labels were given)."""
    output_names: tuple[str, ...]
    """The model's names for those outputs (``("loss", "logits", ...)``)."""
    model_class: str = ""
    fingerprint: str = ""
    """Model fingerprint: a hash of the class, structural config and weights (see ``fingerprint``),
    the same across transformers releases that trace the model into slightly different graphs."""
    meta: dict[str, object] = field(default_factory=dict)

    @cached_property
    def digest(self) -> str:
        """16 hex digits of ``fingerprint.graph_hash``: this exact graph, op by op. A plan records
        it to tell the graph it was made on from a later release's (`plan.reanchor`)."""
        from hf_ftpipe.graph.fingerprint import graph_hash

        return graph_hash(self)[:16]

    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """Each tensor input's planned shape, by name in sorted order: what the keys of a plan and of a
        cost table record of the inputs (constants are left out)."""
        return {name: list(info.shape) for name, info in sorted(self.inputs.items()) if info.shape is not None}

    @property
    def num_nodes(self) -> int:
        return self.graph.number_of_nodes()

    def topological_order(self) -> list[str]:
        """Node names in the order the exported program runs them (a valid topological order)."""
        return sorted(self.graph.nodes, key=lambda name: self.graph.nodes[name]["order"])

    def node(self, name: str) -> dict:
        return self.graph.nodes[name]

    @property
    def total_flops(self) -> float:
        return float(sum(attrs["flops"] for _, attrs in self.graph.nodes(data=True)))

    def param_bytes(self, nodes: Iterable[str] | None = None, trainable_only: bool = False) -> int:
        """Bytes of the distinct parameters read by ``nodes`` (all nodes when ``None``)."""
        names = self.params_of(nodes) if nodes is not None else set(self.params)
        return sum(self.params[name].bytes for name in names if not trainable_only or self.params[name].requires_grad)

    def params_of(self, nodes: Iterable[str]) -> set[str]:
        """Canonical names of the parameters and buffers read by ``nodes``."""
        names: set[str] = set()
        for node in nodes:
            names.update(self.graph.nodes[node]["params"])
        return names

    def cut_bytes(self, nodes: Iterable[str]) -> tuple[int, int]:
        """(bytes entering, bytes leaving) the node set, counting each producer's output once per set."""
        inside = set(nodes)
        incoming = {u for v in inside for u in self.graph.predecessors(v) if u not in inside}
        leaving = {u for u in inside if any(v not in inside for v in self.graph.successors(u))}
        size = lambda u: self.graph.nodes[u]["output_bytes"]  # noqa: E731
        return sum(map(size, incoming)), sum(map(size, leaving))
