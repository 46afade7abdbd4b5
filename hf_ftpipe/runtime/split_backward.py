"""A stage's backward in two actions: input gradients first (``B``), weight gradients later (``W``).

Zero-bubble schedules (Qi et al., ICLR 2024) run ``W`` where a rank would otherwise wait: nothing
downstream waits for it. The heavy part of a weight gradient is one matrix product per weight,
dW = gᵀx, with x what the weight multiplied and g the gradient of the product; everything else in
a stage's backward (layer norms, embeddings, biases, attention) is cheap next to it. So, in the
manner of the paper's own implementation, `defer_weight_gradients` swaps each product of a stage
module's graph with a weight (``aten.linear(x, W, b)``, ``aten.addmm(b, x, W)`` of GPT-2's Conv1D)
for one whose backward computes the gradients of x and b at once and hands ``(W, x, g)`` to the
list being collected (`collecting`): B is the stage's autograd backward with those products
cheaper, W computes each dW = gᵀx into ``W.grad`` and frees x and g. B + W does exactly the work of
one whole backward.

Why this way and not by keeping autograd's intermediate gradients at the weights' consumers (what
``torch.distributed.pipelining`` does): it keeps only x and g per product, and a recomputed stage
(``torch.utils.checkpoint``, non-reentrant) needs nothing special, since its forward runs again
inside B as ever and the products save their inputs through checkpoint's hooks.

Autocast: the product casts x, W and b as autocast would (float32 to the autocast dtype) and runs
with autocast off, so dW comes out in the dtype one process computes it in and is converted to the
weight's dtype as autograd converts it. Float16 loss scaling: the gradients are the scaled ones, as
any backward's. A weight that does not train (frozen, or a buffer) gets no W.

A micro-batch whose ``W`` would follow its ``B`` at once (`hf_ftpipe.schedules.lowering.whole_backwards`)
runs its forward and its backward within `whole_products`: the swapped products are then the plain
aten ops, autograd computes every gradient in one backward, and the micro-batch pays nothing for a
split it does not use (the custom autograd function a deferred product runs through costs a few
percent of a stage's time on CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

__all__ = ["DeferredWeightGradient", "collecting", "defer_weight_gradients", "whole_products"]

_collected: list[DeferredWeightGradient] | None = None
"""Where a product's backward hands its weight gradient during a ``B``; ``None`` computes it at once.
A module global, not a thread-local: on a GPU autograd runs the backward in its own thread."""

_deferring = True
"""Whether the swapped products defer (``False`` within `whole_products`: they are the plain ops)."""


@dataclass
class DeferredWeightGradient:
    """What one product's weight gradient needs, from ``B`` until ``W``."""

    weight: torch.Tensor
    inputs: torch.Tensor
    """x as the product read it (in autocast's dtype), flattened to 2-D."""
    grad: torch.Tensor
    """The gradient of the product, flattened to 2-D."""
    transposed: bool
    """``linear``: the weight is (out, in) and dW = (xᵀg)ᵀ; ``addmm``: (in, out) and dW = xᵀg."""

    @torch.no_grad()
    def apply(self) -> None:
        """Add dW into the weight's ``grad`` (as autograd accumulates it).

        dW is computed in the weight's own layout (linear's (out, in) as gᵀx, addmm's (in, out) as
        xᵀg), so that a first gradient has the weight's strides, autograd's layout contract for
        ``.grad`` (fused optimizers, ``AdamW(fused=True)``, `Trainer`'s default, read a gradient's
        memory in the weight's order), and a later one is accumulated inside the product
        (``addmm_``), saving the pass over the gradient that a separate add makes. Under autocast dW
        comes out in the autocast dtype and is converted to the weight's, as autograd converts it.

        Without autograd, and on x and g detached (`_DeferredProduct.backward`): a ``W`` runs outside
        any backward, and a product of an x that requires grad recorded a graph saving g, which the
        gradient held, every micro-batch's g kept to the end of the step (measured: 4 MB a
        micro-batch on a 4-block GPT-2 stage).
        """
        left, right = (self.grad.t(), self.inputs) if self.transposed else (self.inputs.t(), self.grad)
        grad, weight = self.weight.grad, self.weight.detach()
        if grad is not None and left.dtype == weight.dtype:
            grad.addmm_(left, right)
            return
        dw = left.mm(right).to(weight.dtype)
        if grad is not None:
            grad.add_(dw)
        elif weight.is_contiguous():
            self.weight.grad = dw
        else:
            self.weight.grad = torch.empty_like(weight).copy_(dw)


@contextmanager
def collecting() -> Iterator[list[DeferredWeightGradient]]:
    """Within it, products hand their weight gradients to the list yielded instead of computing them."""
    global _collected
    outer, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected = outer


@contextmanager
def whole_products() -> Iterator[None]:
    """Within it, the swapped products are the plain aten ops: a forward run here, and its backward
    (also run here: a recomputed forward must record what the first one did), is an ordinary one."""
    global _deferring
    outer, _deferring = _deferring, False
    try:
        yield
    finally:
        _deferring = outer


def defer_weight_gradients(module: fx.GraphModule) -> None:
    """Swap, in place, every product of ``module``'s graph with one of its weights (a ``get_attr``)
    for one whose weight gradient is deferred; a module done before is left as it is. Computes the
    same values forward and backward, whether or not anything is collecting."""
    if getattr(module, "_deferred_weight_gradients", False):
        return
    for node in module.graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is torch.ops.aten.linear.default and _is_attribute(node.args, 1):
            node.target = _linear
        elif node.target is torch.ops.aten.addmm.default and _is_attribute(node.args, 2):
            node.target = _addmm
    module.recompile()
    module._deferred_weight_gradients = True


def _is_attribute(args: tuple[Any, ...], index: int) -> bool:
    return len(args) > index and isinstance(args[index], fx.Node) and args[index].op == "get_attr"


@torch.compiler.disable  # the backward's hand-over is a side effect a compiled graph cannot keep
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _deferring:
        return torch.ops.aten.linear.default(x, weight, bias)
    return _DeferredProduct.apply(x, weight, bias, True)


@torch.compiler.disable
def _addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not _deferring:
        return torch.ops.aten.addmm.default(bias, x, weight)
    return _DeferredProduct.apply(x, weight, bias, False)


class _DeferredProduct(torch.autograd.Function):
    """``linear(x, W, b)`` (``transposed``) or ``addmm(b, x, W)`` with a deferrable weight gradient."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
    ) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            xc, wc, bc = (_autocast(t, dtype) for t in (x, weight, bias))
            with torch.autocast(device_type, enabled=False):
                out = _product(xc, wc, bc, transposed)
        else:
            xc, wc, out = x, weight, _product(x, weight, bias, transposed)
        ctx.save_for_backward(xc, wc)  # through checkpoint's hooks: a recomputed stage keeps neither
        ctx.weight, ctx.transposed = weight, transposed
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        xc, wc = ctx.saved_tensors
        grad = grad.to(wc.dtype)
        grad2d = grad.reshape(-1, grad.shape[-1])
        x_dtype, bias_dtype = ctx.dtypes
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.matmul(wc) if ctx.transposed else grad.mm(wc.t())).to(x_dtype)
        grad_bias = grad2d.sum(0).to(bias_dtype) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            # Detached: an unpacked input keeps its grad_fn, and through it the stage's autograd nodes
            # and the leaves they accumulate into (the received activations) until W.
            inputs = xc.detach().reshape(-1, xc.shape[-1])
            deferred = DeferredWeightGradient(ctx.weight, inputs, grad2d.detach(), ctx.transposed)
            if _collected is None:
                deferred.apply()
            else:
                _collected.append(deferred)
        return grad_x, None, grad_bias, None


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:
        return torch.ops.aten.linear.default(x, weight, bias)
    return x.mm(weight) if bias is None else torch.ops.aten.addmm.default(bias, x, weight)


def _autocast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``tensor`` as autocast casts a matrix product's operand: floating point but double, to ``dtype``."""
    if tensor is None or dtype is None or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)
