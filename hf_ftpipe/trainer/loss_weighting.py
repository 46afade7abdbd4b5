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

Not every model that takes ``**kwargs`` divides by ``num_items_in_batch``: `Trainer` passes it to any
forward with ``**kwargs`` (or ``accepts_loss_kwargs``) and then does not divide by the accumulation
steps, but BERT's classification head takes a ``CrossEntropyLoss()`` mean and drops it, and
``ForSequenceClassificationLoss`` uses it for single-label classification only. There `Trainer`'s
gradient is the *sum* over the window's batches of each batch's own mean: micro-batch m weighs its
count over its own batch's. `model_loss_counts_items` tells the two apart by reading the forward's
source (no forward runs, so a model with empty weights is read as well).
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from typing import Any

import torch
from torch import nn

from hf_ftpipe.graph.padding import IGNORE_INDEX

__all__ = ["label_counts", "model_loss_counts_items", "model_loss_shifts_labels"]

_ITEMS = "num_items_in_batch"
logger = logging.getLogger(__name__)


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


def model_loss_counts_items(model: nn.Module, labels: Any = None) -> bool:
    """Whether ``model``'s own loss divides by the ``num_items_in_batch`` `Trainer` passes (the loss a
    forward computes from ``labels``, whose dtype picks ``ForSequenceClassificationLoss``'s problem type).

    Read from the source of the (PEFT-unwrapped) model's ``forward``: it names ``num_items_in_batch``,
    or passes its ``**kwargs`` to ``self.loss_function`` and that function uses them. Where the source
    cannot be read, `Trainer`'s own assumption (it does), said once in the log."""
    from transformers.trainer_utils import unwrap_peft_model

    model = unwrap_peft_model(model)
    forward = inspect.unwrap(type(model).forward)
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as error:
        logger.warning(
            "PipeTrainer cannot read the source of %s.forward (%s): it weighs the micro-batch losses as if the "
            "model's loss divided by num_items_in_batch, as Trainer assumes; if it takes a mean of its own, set "
            "`model.accepts_loss_kwargs = False` so that Trainer and PipeTrainer both divide by the accumulation steps",
            type(model).__name__,
            error,
        )
        return True
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    arguments = function.args
    if _ITEMS in {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}:
        return True
    keywords = arguments.kwarg.arg if arguments.kwarg else None
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == _ITEMS:
            return True
        if isinstance(node, ast.Constant) and node.value == _ITEMS:  # kwargs["num_items_in_batch"]
            return True
        if isinstance(node, ast.Call) and _calls_loss_function(node):
            passed = any(k.arg == _ITEMS or (k.arg is None and _is_name(k.value, keywords)) for k in node.keywords)
            if passed and _loss_function_counts_items(model, labels):
                return True
    return False


def _calls_loss_function(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr == "loss_function" and _is_name(func.value, "self")


def _is_name(node: ast.AST, name: str | None) -> bool:
    return name is not None and isinstance(node, ast.Name) and node.id == name


def _loss_function_counts_items(model: nn.Module, labels: Any) -> bool:
    """Whether ``model.loss_function``, given ``num_items_in_batch``, divides by it: transformers'
    losses do, but ``ForSequenceClassificationLoss`` only for single-label classification (its
    regression and multi-label losses are means)."""
    from transformers.loss.loss_utils import ForSequenceClassificationLoss

    try:
        loss_function = model.loss_function
    except (AttributeError, KeyError, ValueError):
        return True
    if loss_function is not ForSequenceClassificationLoss:
        return True
    config = model.config
    problem = config.problem_type
    if problem is None:  # as ForSequenceClassificationLoss decides it on its first call
        integer = isinstance(labels, torch.Tensor) and labels.dtype in (torch.long, torch.int)
        problem = "single_label_classification" if config.num_labels > 1 and integer else "other"
    return problem == "single_label_classification"
