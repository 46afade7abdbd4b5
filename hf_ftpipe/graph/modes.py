"""Make train/eval-dependent ops of an exported graph follow ``module.train()`` / ``.eval()`` again.

``torch.export`` bakes the mode into the graph: ``aten.dropout(x, p, True)`` and
``aten.scaled_dot_product_attention(..., dropout_p=0.1)`` are constants of a training-mode export.
Exported modules also refuse ``.eval()``. Rather than export twice (the two graphs differ in
node names, so one partition could not serve both), each such call becomes a small submodule
that reads its own ``training`` flag, so one graph and one partition serve training and
evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

__all__ = ["ModeAwareOp", "make_mode_aware"]

aten = torch.ops.aten

# op -> (positional index, keyword name) of the argument that is zero/False in eval mode.
_EVAL_OVERRIDES: dict[Callable, tuple[int, str, Any]] = {
    aten.dropout.default: (2, "train", False),
    aten.feature_dropout.default: (2, "train", False),
    aten.alpha_dropout.default: (2, "train", False),
    aten.feature_alpha_dropout.default: (2, "train", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
}


class ModeAwareOp(nn.Module):
    """Calls ``op`` with its arguments, replacing one of them by ``eval_value`` in eval mode."""

    def __init__(self, op: Callable, index: int, name: str, eval_value: Any) -> None:
        super().__init__()
        self.op, self.index, self.name, self.eval_value = op, index, name, eval_value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            if len(args) > self.index:
                args = (*args[: self.index], self.eval_value, *args[self.index + 1 :])
            else:
                kwargs = {**kwargs, self.name: self.eval_value}
        return self.op(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.op}, eval: {self.name}={self.eval_value!r}"


def make_mode_aware(graph_module: fx.GraphModule) -> int:
    """Rewrite mode-dependent calls of ``graph_module`` in place; returns how many were rewritten.

    Node names are kept, so a partition made on the rewritten graph names the same nodes.
    """
    count = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in _EVAL_OVERRIDES:
            continue
        index, name, eval_value = _EVAL_OVERRIDES[node.target]
        submodule_name = f"_mode_aware_{node.name}"
        graph_module.add_submodule(submodule_name, ModeAwareOp(node.target, index, name, eval_value))
        node.op, node.target = "call_module", submodule_name
        count += 1
    if count:
        graph_module.recompile()
    return count
