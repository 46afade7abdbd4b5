"""How `PipeTrainer` buckets batch lengths for a model whose export fixes the sequence length.

Such a model runs each length on a graph traced at it (`hf_ftpipe.runtime.per_shape`). The trainer's
collator already pads to its ``pad_to_multiple_of`` where it has one, so that multiple is the bucket
(no extra padding, one graph per length the collator makes); other collators get the default.
"""

from __future__ import annotations

from typing import Any

from hf_ftpipe.runtime.per_shape import PerShapeOptions

__all__ = ["per_shape_options"]


def per_shape_options(collator: Any, processing_class: Any, model: Any) -> PerShapeOptions:
    """The collator's ``pad_to_multiple_of`` (else the default) and the pad token of its tokenizer,
    the trainer's processing class or the model's config (else 0: padding is masked out)."""
    defaults = PerShapeOptions()
    multiple_of = getattr(collator, "pad_to_multiple_of", None)
    pad_token_id = None
    for owner in (getattr(collator, "tokenizer", None), processing_class, getattr(model, "config", None)):
        pad_token_id = getattr(owner, "pad_token_id", None)
        if isinstance(pad_token_id, int):
            break
    return PerShapeOptions(
        multiple_of=multiple_of if isinstance(multiple_of, int) and multiple_of > 0 else defaults.multiple_of,
        pad_token_id=pad_token_id if isinstance(pad_token_id, int) else defaults.pad_token_id,
    )
