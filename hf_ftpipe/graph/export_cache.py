"""Exported programs kept for the process, so that exporting the same model again costs nothing.

``torch.export`` is most of what capturing a model costs, and a process may capture the same
architecture several times: a trainer made with ``model_init`` at each ``train()``, a second trainer
on a fresh model, a run that captures again at another batch shape, a test suite's launched jobs that
train one tiny model under many settings. An export depends on the model's code, its configuration,
its tensors' names, shapes and dtypes (never their values: the export runs on meta twins of the
weights), the inputs' shapes and dtypes, the dynamic-shape specification and the grad and autocast
modes; `export_key` is all of these, and a later export with the same key takes the kept program's
graph, bound to the new model's tensors by name (`bind_tensors`).

What the key cannot see, it refuses to cache: a model with a submodule whose class comes from
outside ``transformers`` and ``torch`` (a PEFT adapter's scaling, a user's module's attributes live
outside any config), a forward replaced on an instance (accelerate's hooks) and module hooks. The
model's code is part of the key as the identity of the functions of each module class and of the
module that defines it, so a monkeypatched attention function or ``forward`` makes a new key.
`clear_export_cache` empties the cache for code changed some other way.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules import module as module_globals

__all__ = ["bind_tensors", "cached_program", "clear_export_cache", "export_key", "keep_program", "named_tensors"]

_MAX_PROGRAMS = 8
_programs: OrderedDict[Hashable, torch.export.ExportedProgram] = OrderedDict()
_CACHEABLE_PACKAGES = ("transformers.", "torch.")


def export_key(model: nn.Module, inputs: Mapping[str, Any], dynamic_shapes: Any) -> Hashable | None:
    """What an export of ``model`` on ``inputs`` depends on, or ``None`` where some of it is not visible."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)) or _has_hooks():
        return None
    modules = []
    for name, module in model.named_modules():
        cls = type(module)
        if not cls.__module__.startswith(_CACHEABLE_PACKAGES) or "forward" in vars(module) or _hooked(module):
            return None
        modules.append((name, cls, module.training, getattr(module, "gradient_checkpointing", None)))
    classes = {cls for _, cls, _, _ in modules}
    code = tuple(sorted((c.__module__, c.__qualname__, _functions(vars(c))) for c in classes))
    homes = tuple(sorted((m, _functions(vars(sys.modules.get(m, object)))) for m in {c.__module__ for c in classes}))
    try:
        settings = config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a value JSON cannot hold: the configuration is not all visible
        return None
    return (
        type(model),
        settings,
        getattr(config, "_attn_implementation", None),
        tuple(modules),
        code,
        homes,
        _tensors(model),
        tuple((n, _value_key(v)) for n, v in inputs.items()),
        repr(dynamic_shapes),
        torch.is_grad_enabled(),
        tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")),
    )


def cached_program(key: Hashable | None) -> torch.export.ExportedProgram | None:
    """The program kept for ``key`` (``None``: none, or ``key`` is ``None``)."""
    if key is None or key not in _programs:
        return None
    _programs.move_to_end(key)
    return _programs[key]


def keep_program(key: Hashable | None, program: torch.export.ExportedProgram) -> None:
    """Keep ``program`` for ``key`` (nothing where ``key`` is ``None``); the oldest go beyond a few."""
    if key is None:
        return
    _programs[key] = program
    while len(_programs) > _MAX_PROGRAMS:
        _programs.popitem(last=False)


def clear_export_cache() -> None:
    """Forget every kept program (after changing a model's code in a way `export_key` cannot see)."""
    _programs.clear()


def bind_tensors(graph_module: fx.GraphModule, model: nn.Module) -> None:
    """Point every weight and buffer ``graph_module`` reads at ``model``'s tensor of the same name.

    A kept program's graph holds the tensors of the model first exported; the capture names a
    graph's tensors by identity with the model's (tied weights are one tensor), so they must be the
    new model's. Constants the export made itself (no such name in ``model``) stay as they are.
    """
    tensors = named_tensors(model)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.target in tensors:
            owner_path, _, leaf = node.target.rpartition(".")
            owner = graph_module.get_submodule(owner_path)
            tensor = tensors[node.target]
            if leaf in owner._parameters:
                owner._parameters[leaf] = tensor
            elif leaf in owner._buffers:
                owner._buffers[leaf] = tensor
            else:
                setattr(owner, leaf, tensor)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under every name it has (a tied weight under each)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _functions(namespace: Mapping[str, Any]) -> tuple[tuple[str, _Identity], ...]:
    """Every function in a class's or module's namespace, by identity: a patched one is another object."""
    return tuple(sorted((name, _Identity(value)) for name, value in namespace.items() if callable(value)))


class _Identity:
    """An object compared by identity (and kept alive by the key that holds it, so no other object
    can take its ``id``): a callable may define ``__eq__`` or be unhashable."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __lt__(self, other: _Identity) -> bool:  # sorted by name first: never reached with equal names
        return id(self.value) < id(other.value)


def _tensors(model: nn.Module) -> tuple[Any, ...]:
    """Names, shapes, dtypes and trainability of ``model``'s tensors, with which names share one (ties)."""
    first: dict[int, str] = {}
    rows = []
    for kind, named in (("p", model.named_parameters), ("b", model.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            tied_to = first.setdefault(id(tensor), name)
            rows.append((kind, name, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, tied_to))
    return tuple(rows)


def _value_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("value", repr(value))


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _has_hooks() -> bool:
    """Hooks registered for every module (``register_module_forward_hook`` and its kin)."""
    return any(
        getattr(module_globals, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )
