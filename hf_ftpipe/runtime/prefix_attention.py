"""Attention over a sequence's earlier token slices: TeraPipe's keys and values kept per stage.

A token slice's queries attend to the keys and values of every earlier slice of its sequence
plus its own. Those never cross stages: each stage keeps, per sequence in flight, one buffer per
attention layer that every slice writes its own keys and values into (`SequenceKV`), so a
sequence's keys and values are held once, however many slices it has (a ``torch.cat`` per slice
would keep about (M + 1)/2 copies, one saved by each slice's attention).

`PrefixAttention` takes the place of a traced graph's ``scaled_dot_product_attention`` in a
sliced stage. It saves the slice's queries, and on the CPU its output and log-sum-exp, for the
flash kernel's backward; elsewhere, or with dropout, autocast or grouped heads, the backward
recomputes the slice's attention from the buffer instead. The backward returns the slice's own
key and value gradients plus what later slices left for its positions, and leaves the gradients
for earlier positions in the buffer for the slices before it: a sequence's slices run backward in
reverse, as every sliced schedule orders them.

The mask is causal aligned bottom-right (query row r of a slice at offset c sits at position
c + r) with the sequence's padding mask on the key columns: the traced graph's own mask, made for
a sequence without a prefix, is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrefixAttention", "SequenceKV", "SliceCursor", "laid_out"]


@dataclass
class SequenceKV:
    """One sequence's keys and values on one stage: a buffer per attention layer, and their gradients.

    Args:
        key_padding (`torch.Tensor`): ``(batch, length)`` bool, `True` where a token may be attended to.
    """

    key_padding: torch.Tensor
    keys: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    key_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    value_grads: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.key_padding.shape[-1])

    def write(self, layer: str, offset: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a slice's keys and values at ``offset`` (the buffer is made at the first slice)."""
        if layer not in self.keys:
            shape = (*key.shape[:-2], self.length, key.shape[-1])
            self.keys[layer] = key.new_empty(shape)
            self.values[layer] = value.new_empty((*value.shape[:-2], self.length, value.shape[-1]))
        end = offset + key.shape[-2]
        self.keys[layer][..., offset:end, :] = key.detach()
        self.values[layer][..., offset:end, :] = value.detach()

    def mask(self, offset: int, length: int) -> torch.Tensor:
        """``(batch, 1, length, offset + length)``: causal bottom-right, padded keys masked."""
        end = offset + length
        rows = torch.arange(offset, end, device=self.key_padding.device)
        columns = torch.arange(end, device=self.key_padding.device)
        causal = columns[None, :] <= rows[:, None]
        return causal[None, None] & self.key_padding[:, None, None, :end]

    def take_grads(self, layer: str, offset: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What later slices left for positions ``offset..end`` of ``layer``, if any."""
        if layer not in self.key_grads:
            return None
        return self.key_grads[layer][..., offset:end, :], self.value_grads[layer][..., offset:end, :]

    def leave_grads(self, layer: str, key_grad: torch.Tensor, value_grad: torch.Tensor) -> None:
        """Add the gradients of positions ``0..offset`` for the slices before this one."""
        if layer not in self.key_grads:
            self.key_grads[layer] = torch.zeros_like(self.keys[layer])
            self.value_grads[layer] = torch.zeros_like(self.values[layer])
        prefix = key_grad.shape[-2]
        self.key_grads[layer][..., :prefix, :] += key_grad
        self.value_grads[layer][..., :prefix, :] += value_grad


class SliceCursor:
    """Which sequence and offset a stage's attention layers are working on; the executor moves it."""

    def __init__(self) -> None:
        self.sequence: SequenceKV | None = None
        self.offset = 0

    def point(self, sequence: SequenceKV, offset: int) -> None:
        self.sequence, self.offset = sequence, offset


class _PrefixAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sequence: SequenceKV,
        layer: str,
        offset: int,
        options: dict[str, Any],
        layout: tuple[int, ...] | None,
    ) -> torch.Tensor:
        sequence.write(layer, offset, key, value)
        end = offset + key.shape[-2]
        mask = sequence.mask(offset, query.shape[-2])
        ctx.rng = _rng_state(query.device) if options["dropout_p"] > 0 else None
        device_type = query.device.type
        ctx.autocast = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        ctx.sequence, ctx.layer, ctx.offset, ctx.options = sequence, layer, offset, options
        keys, values = sequence.keys[layer][..., :end, :], sequence.values[layer][..., :end, :]
        ctx.flash = _cpu_flash(query, keys, values, options, ctx.autocast[0])
        if ctx.flash:  # keeps its output and log-sum-exp for the backward: nothing to recompute
            output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, keys, values, 0.0, False, attn_mask=_additive(mask, query.dtype), scale=options["scale"]
            )
            ctx.save_for_backward(query, output, logsumexp)
        else:
            output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, **options)
            ctx.save_for_backward(query)
        return laid_out(output, layout)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors  # unpacked once: under activation recomputation a second read fails
        query = saved[0]
        sequence, layer, offset = ctx.sequence, ctx.layer, ctx.offset
        end = offset + query.shape[-2]
        keys, values = sequence.keys[layer][..., :end, :], sequence.values[layer][..., :end, :]
        mask = sequence.mask(offset, end - offset)
        if ctx.flash:
            _, output, logsumexp = saved
            grad_query, grad_keys, grad_values = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_output.contiguous(),
                query,
                keys,
                values,
                output,
                logsumexp,
                0.0,
                False,
                attn_mask=_additive(mask, query.dtype),
                scale=ctx.options["scale"],
            )
        else:
            grad_query, grad_keys, grad_values = _recomputed_grads(ctx, query, keys, values, mask, grad_output)
        own_keys, own_values = grad_keys[..., offset:, :], grad_values[..., offset:, :]
        later = sequence.take_grads(layer, offset, end)
        if later is not None:
            own_keys, own_values = own_keys + later[0], own_values + later[1]
        if offset:
            sequence.leave_grads(layer, grad_keys[..., :offset, :], grad_values[..., :offset, :])
        return grad_query, own_keys, own_values, None, None, None, None, None


def _cpu_flash(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, options: dict[str, Any], autocast: bool
) -> bool:
    """Whether the CPU flash kernel can run the slice directly: its backward then takes the saved
    output and log-sum-exp. Dropout, grouped heads and autocast (which would cast its inputs) take
    the general path, which recomputes the attention in backward instead."""
    return (
        query.device.type == "cpu"
        and not autocast
        and options["dropout_p"] == 0
        and not options["enable_gqa"]
        and query.dtype == keys.dtype == values.dtype
    )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flash kernel's form of a boolean mask: 0 where attended, −inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _recomputed_grads(
    ctx: Any,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The attention's gradients from a second forward, in the precision and with the random
    state the first one had (so dropout repeats)."""
    query = query.detach().requires_grad_(True)
    keys, values = keys.detach().requires_grad_(True), values.detach().requires_grad_(True)
    enabled, dtype = ctx.autocast
    autocast = torch.autocast(query.device.type, dtype=dtype, enabled=enabled)
    with torch.enable_grad(), _restored_rng(query.device, ctx.rng), autocast:
        output = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, **ctx.options)
    return torch.autograd.grad(output, (query, keys, values), grad_output)


def laid_out(output: torch.Tensor, layout: tuple[int, ...] | None) -> torch.Tensor:
    """``output`` laid out in memory as ``layout`` says (its dimensions outermost first), where the
    traced graph's views after attention rely on it; as it is without a ``layout``."""
    if layout is None or _memory_order(output) == layout:
        return output
    return torch.empty_permuted(output.shape, layout, dtype=output.dtype, device=output.device).copy_(output)


def _memory_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``tensor`` from outermost to innermost in memory (ties in dimension order)."""
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda dim: -strides[dim]))


class PrefixAttention(nn.Module):
    """Stands for one traced ``scaled_dot_product_attention`` call in a sliced stage.

    Takes the call's arguments; the traced mask and ``is_causal`` are replaced by the slice's own
    (see the module docstring). Dropout follows ``self.training`` as the traced call did. The output
    is laid out in memory as the traced call's was (``layout``: its dimensions outermost first):
    the exporter dropped the copies that layout made needless, so the graph's views after attention
    rely on it, at every slice length.
    """

    def __init__(self, layer: str, cursor: SliceCursor, layout: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.layer, self.cursor, self.layout = layer, cursor, layout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        sequence = self.cursor.sequence
        if sequence is None:
            raise RuntimeError("a sliced stage ran outside a token slice (no sequence pointed at)")
        options = {"dropout_p": dropout_p if self.training else 0.0, "scale": scale, "enable_gqa": enable_gqa}
        return _PrefixAttentionFunction.apply(
            query, key, value, sequence, self.layer, self.cursor.offset, options, self.layout
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}"


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), accelerator


class _restored_rng:
    """Run the recomputation with the random state the forward had, so dropout repeats."""

    def __init__(self, device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
        self.device, self.state = device, state

    def __enter__(self) -> None:
        if self.state is None:
            return
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        if self.state is None:
            return
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
