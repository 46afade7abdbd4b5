"""Batches of any shape through one traced graph: which input sizes vary, and every value's shape.

A Hugging Face script hands the trainer batches of many shapes: dynamic padding makes each batch
as long as its longest row, and the last batch of an epoch is short. So the model is exported once
with its batch dimension and its second (sequence) dimension of every tensor input marked
dynamic (``torch.export.Dim.AUTO``: a size the model's code fixes, such as a classifier's label
count, silently stays fixed, and `ShapeFormulas.varying` says which did vary). The exported graph
then computes with symbols (``s0``, ``s1``...) where those sizes were; every node's output shape
is a formula in them.

Knowing a micro-batch's input shapes binds the symbols, so every rank knows the shape of every
value a stage will send or receive before a tensor moves (receive buffers are sized from it, never
from shapes sent ahead), and the value of each size node (``aten.sym_size``) that a stage reads
without holding the tensor it measures. Evaluating a few formulas costs microseconds; results are
cached per micro-batch shape (`hf_ftpipe.runtime.shapes`).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx, nn

from hf_ftpipe.errors import PipelineError

__all__ = ["ShapeFormulas", "dynamic_shapes_spec", "is_size_node"]

_SIZE_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)

Formula = int | sympy.Expr
"""A size: fixed (``int``) or a formula in the input symbols."""


def dynamic_shapes_spec(model: nn.Module, inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """``torch.export``'s ``dynamic_shapes`` for keyword ``inputs``: dimensions 0 and 1 of every
    tensor ``Dim.AUTO``, in the order of ``model.forward``'s signature (keywords the signature
    collects in ``**kwargs`` go in one dict there, as export requires)."""
    auto = torch.export.Dim.AUTO

    def spec(value: Any) -> dict[int, Any] | None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        return {dim: auto for dim in range(min(value.dim(), 2))}

    parameters = inspect.signature(model.forward).parameters
    named = [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = {name: spec(value) for name, value in inputs.items() if name not in named}
    shapes: list[Any] = []
    for name, parameter in parameters.items():
        if parameter.kind == parameter.VAR_KEYWORD:
            if extra:
                shapes.append(extra)
        elif parameter.kind != parameter.VAR_POSITIONAL and name in inputs:
            shapes.append(spec(inputs[name]))
    return tuple(shapes)


def is_size_node(node: fx.Node) -> bool:
    """Whether ``node`` computes a size (a Python number, symbolic or not), not a tensor."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), _SIZE_TYPES)


@dataclass(frozen=True)
class ShapeFormulas:
    """The sizes of a dynamically exported graph as formulas in its input symbols.

    Built once per trace (`from_graph`); plain data apart from the sympy formulas.
    """

    model_class: str
    inputs: dict[str, tuple[Formula, ...]]
    """Each tensor input's dimensions: a symbol where it varies, its traced size where it does not."""
    values: dict[str, tuple[Formula, ...]]
    """Each node with one tensor output: that tensor's shape."""
    sizes: dict[str, Formula]
    """Each size node (`is_size_node`): the number it computes."""
    fixed_because: str = "torch.export found that the model's code needs that size"
    """Why a size cannot vary, for the error that refuses a batch with another."""
    relations: tuple[str, ...] = ()
    """What the model's code needs of its input sizes beyond equal symbols (e.g. as many labels as
    logits: ``L['labels'].size()[0]*L['labels'].size()[1] == ...``, a sequence no longer than the
    position embeddings, or long enough for the branch the model took when traced), as torch.export
    words its guards; `bind` checks them (`_checked`), so a mismatch is refused before any stage runs
    instead of running a graph traced for other sizes."""

    @classmethod
    def from_graph(cls, graph_module: fx.GraphModule, model_class: str) -> ShapeFormulas:
        inputs, values, sizes = {}, {}, {}
        for node in graph_module.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                inputs[node.name] = tuple(_formula(size) for size in value.shape)
            elif is_size_node(node):
                sizes[node.name] = _formula(value)
            elif node.op in ("call_function", "call_module") and isinstance(value, torch.Tensor):
                values[node.name] = tuple(_formula(size) for size in value.shape)
        relations = tuple(r for r in graph_module.meta.get("input_relations", ()) if _checked(r))
        return cls(model_class, inputs, values, sizes, relations=relations)

    @classmethod
    def fixed(cls, inputs: Mapping[str, Sequence[int]], model_class: str) -> ShapeFormulas:
        """A graph exported with fixed shapes: nothing varies, values keep their traced shapes."""
        because = "the pipeline was traced with fixed shapes (token slicing, or a model that cannot vary them)"
        return cls(model_class, {name: tuple(shape) for name, shape in inputs.items()}, {}, {}, because)

    def varying(self, name: str) -> tuple[int, ...]:
        """The dimensions of input ``name`` that may differ from batch to batch."""
        return tuple(dim for dim, size in enumerate(self.inputs.get(name, ())) if not isinstance(size, int))

    def bind(self, shapes: Mapping[str, Sequence[int]]) -> dict[sympy.Symbol, int]:
        """The symbols' values for a micro-batch whose tensor inputs have ``shapes``.

        Raises `PipelineError` naming the input and dimension where a fixed size differs, or where
        two inputs give one symbol two values (e.g. ``input_ids`` and ``attention_mask`` of
        different lengths)."""
        bound: dict[sympy.Symbol, int] = {}
        where: dict[sympy.Symbol, tuple[str, int]] = {}  # the input and dimension that bound a symbol
        for name, formulas in self.inputs.items():
            if name not in shapes:
                continue
            shape = tuple(shapes[name])
            if len(shape) != len(formulas):
                raise PipelineError(
                    f"{name!r} has {len(shape)} dimensions {shape}, but {self.model_class} was traced with "
                    f"{len(formulas)}: {self._describe(name)}; give {name!r} in the layout of the batch the "
                    "model was traced on"
                )
            for dim, (formula, size) in enumerate(zip(formulas, shape, strict=True)):
                if isinstance(formula, int):
                    if formula != size:
                        raise PipelineError(
                            f"{name!r} has size {size} in dimension {dim}, but {self.model_class} takes only "
                            f"{formula} there ({self.fixed_because}; {self._describe(name)}): give batches "
                            f"whose {name!r} has {formula} there (pad to that length, drop a short last batch)"
                        )
                    continue
                symbol = formula if isinstance(formula, sympy.Symbol) else None
                if symbol is None:
                    continue
                if bound.setdefault(symbol, int(size)) != size:
                    other, other_dim = where[symbol]
                    raise PipelineError(
                        f"{name!r} has size {size} in dimension {dim}, but {other!r} has {bound[symbol]} in dimension "
                        f"{other_dim}, and {self.model_class} needs the two equal (torch.export found its code uses "
                        "them together); give inputs of matching shapes, e.g. padded by one collator"
                    )
                where.setdefault(symbol, (name, dim))
        self._check_relations(shapes)
        return bound

    def _check_relations(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Refuse ``shapes`` that break a relation of `relations` among the inputs they give."""
        given = {name: _Sizes(tuple(shape)) for name, shape in shapes.items()}
        for relation in self.relations:
            try:
                holds = eval(_compiled(relation), {"__builtins__": {}}, {"L": given})  # noqa: S307  (export's own guard text)
            except (KeyError, IndexError, ZeroDivisionError, NameError, TypeError):
                continue  # an input this micro-batch lacks, or not a plain size relation
            if holds is False:
                readable = _RELATION_SIZE.sub(r"\1.shape[\2]", relation)
                names = dict.fromkeys(name for name, _ in _RELATION_SIZE.findall(relation))
                sizes = ", ".join(f"{name!r} {tuple(shapes[name])}" for name in names)
                raise PipelineError(
                    f"the micro-batch's {sizes} break what {self.model_class}'s code needs of them (torch.export "
                    f"found it): {readable}; give inputs whose sizes satisfy it (matching shapes, e.g. padded by "
                    "one collator, within the model's limits)"
                )

    def shape_of(self, value: str, bound: Mapping[sympy.Symbol, int], traced: Sequence[int]) -> tuple[int, ...]:
        """The shape of node ``value`` under ``bound``; ``traced`` where the graph has no formula
        (exported with fixed shapes)."""
        formulas = self.values.get(value)
        if formulas is None:
            return tuple(traced)
        return tuple(_evaluate(formula, bound, value) for formula in formulas)

    def size_of(self, node: str, bound: Mapping[sympy.Symbol, int]) -> int | bool | float:
        return _evaluate(self.sizes[node], bound, node)

    def _describe(self, name: str) -> str:
        shape = ", ".join(str(size) for size in self.inputs[name])
        return f"traced as ({shape}), a symbol where the size may vary"


_RELATION_SIZE = re.compile(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]")


_ZERO_ONE_CAUTION = re.compile(r"\(*(.+?)\)* (>= 2|> 1|!= 1|!= 0)|(2 <=|1 <|1 !=|0 !=) (.+)")


def _checked(relation: str) -> bool:
    """Whether `ShapeFormulas.bind` checks ``relation``: all but export's caution about the sizes 0
    and 1 it saw no example of (``x >= 2``, ``x - 1 != 1``; `hf_ftpipe.graph.trace` grows them to 2):
    batches of one row, or of labels that short, run. A bound the model's code sets (``x <= 32``
    past the position embeddings, ``x > 8`` for a branch taken on long inputs) is checked."""
    return not _ZERO_ONE_CAUTION.fullmatch(relation.strip())


class _Sizes:
    """An input as a relation reads it: ``.size()`` gives its shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self._shape = shape

    def size(self) -> tuple[int, ...]:
        return self._shape


@functools.cache
def _compiled(relation: str) -> Any:
    return compile(relation, "<input relation>", "eval")


def _formula(size: Any) -> Formula:
    if isinstance(size, torch.SymInt | torch.SymBool | torch.SymFloat):
        expr = size.node.expr
        return int(expr) if expr.is_Integer else expr
    return size


def _evaluate(formula: Formula, bound: Mapping[sympy.Symbol, int], node: str) -> Any:
    if not isinstance(formula, sympy.Basic):
        return formula
    result = sympy.sympify(formula.xreplace(bound))
    if result.free_symbols:
        missing = ", ".join(sorted(str(s) for s in result.free_symbols))
        raise PipelineError(
            f"the size of {node!r} depends on {missing}, which no input of this micro-batch sets; "
            "please report the model class to hf_ftpipe"
        )
    if result.is_Boolean or result in (sympy.true, sympy.false):
        return bool(result)
    return int(result) if result.is_integer else float(result)
