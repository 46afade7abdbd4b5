"""Attention over earlier token slices equals attention over the whole sequence: outputs and the
gradients of queries, keys and values, on both of `PrefixAttention`'s backward paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_ftpipe.runtime import prefix_attention
from hf_ftpipe.runtime.prefix_attention import PrefixAttention, SequenceKV, SliceCursor

SLICES = [3, 1, 4]
BATCH, HEADS, HEAD_DIM = 2, 4, 8


def whole_sequence(q, k, v, padding, enable_gqa):
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    mask = causal[None, None] & padding[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=enable_gqa)


@pytest.mark.parametrize("path", ["flash", "recomputed"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_slices_attend_like_the_whole_sequence(monkeypatch, path: str, kv_heads: int) -> None:
    if path == "recomputed":  # what CUDA, dropout and autocast take
        monkeypatch.setattr(prefix_attention, "_cpu_flash", lambda *args: False)
    generator = torch.Generator().manual_seed(0)
    length, gqa = sum(SLICES), kv_heads != HEADS

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(BATCH, heads, length, HEAD_DIM, dtype=torch.float64, generator=generator)

    q, k, v = tensor(HEADS).requires_grad_(), tensor(kv_heads).requires_grad_(), tensor(kv_heads).requires_grad_()
    padding = torch.ones(BATCH, length, dtype=torch.bool)
    padding[0, -2:] = False
    weights = torch.randn(BATCH, HEADS, length, HEAD_DIM, dtype=torch.float64, generator=generator)

    reference = whole_sequence(q, k, v, padding, gqa)
    expected = torch.autograd.grad(reference, (q, k, v), weights)

    cursor = SliceCursor()
    attention = PrefixAttention("layer", cursor)
    sequence = SequenceKV(padding)
    outputs, offset = [], 0
    for size in SLICES:
        cursor.point(sequence, offset)
        part = slice(offset, offset + size)
        outputs.append(attention(q[:, :, part], k[:, :, part], v[:, :, part], scale=0.3, enable_gqa=gqa))
        offset += size
    torch.testing.assert_close(torch.cat(outputs, dim=2), reference, rtol=0, atol=1e-12)

    offsets = [sum(SLICES[:i]) for i in range(len(SLICES))]
    for i in reversed(range(len(SLICES))):  # a sequence's slices go backward last to first
        part = slice(offsets[i], offsets[i] + SLICES[i])
        torch.autograd.backward(outputs[i], weights[:, :, part])
    for got, want in zip((q.grad, k.grad, v.grad), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_outside_a_slice_is_a_clear_error() -> None:
    attention = PrefixAttention("layer", SliceCursor())
    x = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="outside a token slice"):
        attention(x, x, x)
