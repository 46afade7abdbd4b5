"""What a batch is padded with: the one home of the values every padding in hf_ftpipe uses.

A Hugging Face collator pads ``input_ids`` with the tokenizer's pad token, attention masks and
``token_type_ids`` with 0, and labels with ``-100``, the ``ignore_index`` of every Hugging Face
loss. Padding more of the same on the right changes no real token's output where the model reads
an attention mask (a causal model never looks ahead; a bidirectional one masks the keys), and adds
nothing to a loss. The pipeline pads with these values where a graph takes only some lengths
(`hf_ftpipe.runtime.per_shape`), and the trainer where a batch lacks its labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "pad_lengths", "padding_value"]

IGNORE_INDEX = -100
"""The label every Hugging Face loss ignores (cross-entropy's ``ignore_index``)."""


def padding_value(name: str, pad_token_id: int) -> int:
    """What input ``name`` is padded with: ``-100`` for labels, the pad token for token ids, else 0
    (attention masks, ``token_type_ids``, positions)."""
    if name.endswith("labels"):
        return IGNORE_INDEX
    if name.endswith("input_ids"):
        return pad_token_id
    return 0


def pad_lengths(microbatch: Mapping[str, Any], lengths: Mapping[str, int], pad_token_id: int) -> dict[str, Any]:
    """``microbatch`` with each input named in ``lengths`` padded on the right of dimension 1 to that
    length, with `padding_value`; the other values as they are."""
    padded = dict(microbatch)
    for name, length in lengths.items():
        value = microbatch[name]
        missing = length - int(value.shape[1])
        if missing > 0:
            filler = value.new_full((value.shape[0], missing, *value.shape[2:]), padding_value(name, pad_token_id))
            padded[name] = torch.cat([value, filler], dim=1)
    return padded
