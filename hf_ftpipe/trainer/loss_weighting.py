"""How much each micro-batch's loss weighs in the loss `Trainer` computes over the whole mini-batch.

A pipeline computes one loss per micro-batch: the model's own mean over that micro-batch's label
tokens. `Trainer` (transformers 5.x) passes ``num_items_in_batch``, the label tokens of the whole
mini-batch, to models whose ``forward`` takes loss keyword arguments, and they return the *sum* of
their token losses divided by it. When micro-batches hold different numbers of label tokens
(``-100`` padding), the plain mean of the micro-batch means is a different number, with different
gradients. Weighting micro-batch m by ``n_m / N`` (its token count over Trainer's count) gives
Trainer's loss exactly: ``sum_m (S_m / n_m) * n_m / N = sum_m S_m / N``.

The two counts follow different rules, and both matter: ``n_m`` is what the model's loss divides
by (a causal LM shifts its labels, so the first position of each row is never a target), ``N`` is
what `Trainer` counts (``labels[..., 1:]`` only when its `_loss_shifts_labels` says so, which in
transformers 5.23 is not the case for GPT-2, whose ``loss_type`` is unset).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_ftpipe.graph.padding import IGNORE_INDEX

__all__ = ["label_counts", "model_loss_shifts_labels"]


def model_loss_shifts_labels(model: nn.Module) -> bool:
    """Whether ``model``'s own loss predicts ``labels[..., 1:]`` from the positions before (a causal LM)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):  # shifts its decoder inputs, not its targets
        return False
    try:
        return getattr(model, "loss_function", None) is ForCausalLMLoss
    except (AttributeError, KeyError, ValueError):
        return False


def label_counts(labels: torch.Tensor, num_microbatches: int, shifted: bool) -> list[int]:
    """Labels that are not ``-100`` in each of ``labels``' micro-batches (without the first
    position of each row when ``shifted``)."""
    if shifted:
        labels = labels[..., 1:]
    pieces = labels.tensor_split(min(len(labels), num_microbatches))  # the pipeline's split
    return [int(piece.ne(IGNORE_INDEX).sum()) for piece in pieces]
