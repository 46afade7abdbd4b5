"""Greedy decoding for encoder-decoder models through a pipeline traced with fixed shapes.

The pipeline is traced once, on a batch with ``labels`` of a fixed length T, and an
encoder-decoder model (T5, BART) builds its decoder inputs by shifting ``labels`` right behind
the decoder start token. So greedy decoding needs no new trace and no key/value cache: step t
feeds ``labels = [y_1 .. y_{t-1}, pad, ...]``, whose decoder inputs are ``[start, y_1 .. y_{t-1},
...]``; the causal mask makes the logits at position t-1 depend on those only, and their argmax
is y_t. That is T forwards of the whole model (the encoder runs again each time) instead of one
encoder pass and T cached decoder steps: fine for targets of a few tokens (SuperGLUE labels,
short answers), wasteful for long ones.

The output follows ``model.generate(do_sample=False, num_beams=1)``: the decoder start token
first, then one token per step; a row that produced EOS gets ``pad`` afterwards, and decoding
stops early once every row has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hf_ftpipe.errors import PipelineError

__all__ = ["greedy_decode"]


def greedy_decode(
    logits_of: Callable[[dict[str, Any]], torch.Tensor],
    batch: Mapping[str, Any],
    *,
    label_length: int,
    max_new_tokens: int,
    decoder_start_token_id: int,
    pad_token_id: int,
    eos_token_id: int | list[int] | None,
    rows: int | None = None,
) -> torch.Tensor:
    """Greedy tokens for ``batch``: ``(batch, 1 + generated)``, the decoder start token first.

    Args:
        logits_of: runs the model on a batch (the encoder inputs and ``labels``) and returns its
            logits, ``(batch, label_length, vocab)``: the pipeline's forward, or an eager model's.
        batch: the encoder inputs; any ``labels`` in it are replaced.
        label_length: T, the length of ``labels`` the model was traced with.
        max_new_tokens: tokens to generate at most (``<= label_length``).
        decoder_start_token_id, pad_token_id, eos_token_id: the model's generation settings.
        rows: only the first ``rows`` rows are real (the rest pad a short batch); only they decide
            when to stop early.
    """
    if not 1 <= max_new_tokens <= label_length:
        raise PipelineError(
            f"the pipeline was traced with labels of length {label_length}, so it can generate 1 to "
            f"{label_length} tokens, not {max_new_tokens}; lower `generation_max_length` or trace "
            "with longer (padded) labels"
        )
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    size = next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor))
    device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
    rows = size if rows is None else rows
    eos = torch.tensor([] if eos_token_id is None else _as_list(eos_token_id), device=device)
    labels = torch.full((size, label_length), pad_token_id, dtype=torch.long, device=device)
    done = torch.zeros(size, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logits = logits_of({**inputs, "labels": labels.clone()})  # (batch, label_length, vocab)
        token = logits[:, step].argmax(dim=-1)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        labels[:, step] = token
        done |= torch.isin(token, eos)
        if bool(done[:rows].all()):
            labels = labels[:, : step + 1]
            break
    else:
        labels = labels[:, :max_new_tokens]
    start = torch.full((size, 1), decoder_start_token_id, dtype=torch.long, device=device)
    return torch.cat([start, labels], dim=1)


def _as_list(value: int | list[int]) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
