"""The dtype each traced value has under ``torch.autocast``, found without running the model.

Under autocast a stage's outputs may come out in bfloat16 although the graph was traced in
float32, and which ones depends on the ops that made them (a matmul casts down, a softmax up).
Receives are posted before the sender has run, so each rank must know these dtypes in advance;
and sending a value in its autocast dtype keeps the pipeline exactly equal to one process under
autocast (a float32 copy would make the next non-autocast op compute in float32 instead).

The whole traced graph is interpreted once on fake tensors of the run's device type, inside the
same autocast region the stages use: autocast's dispatch decides every dtype, shapes are checked
for free, and no memory or FLOP is spent.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_ftpipe.runtime.stage import retarget_devices

__all__ = ["autocast_dtypes"]


def autocast_dtypes(graph_module: fx.GraphModule, device: torch.device, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Node name → dtype of its (first) tensor output when the graph runs under ``autocast(dtype)`` on ``device``."""
    module = copy.deepcopy(graph_module)
    retarget_devices(module, device)  # traced on meta: its device arguments point there
    found: dict[str, torch.dtype] = {}

    class _Recorder(fx.Interpreter):
        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
            value = super().get_attr(target, args, kwargs)
            if isinstance(value, torch.Tensor):  # weights are meta here: stand-ins on the run's device
                return torch.empty(value.shape, dtype=value.dtype, device=device, requires_grad=value.requires_grad)
            return value

        def run_node(self, node: fx.Node) -> Any:
            result = super().run_node(node)
            first = result[0] if isinstance(result, (tuple, list)) and result else result
            if isinstance(first, torch.Tensor):
                found[node.name] = first.dtype
            return result

    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast(device.type, dtype=dtype):
        inputs = [_stand_in(node.meta.get("val"), device) for node in placeholders]
        _Recorder(module).run(*inputs)
    return found


def _stand_in(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device=device)
    return value
