"""A causal LM captured for token slicing (TeraPipe): the whole sequence and one graph per slice length.

A slice runs the model on its own tokens with global positions, so every graph of a sliced model
takes ``position_ids``, the labels already shifted across the whole sequence (``shift_labels``, so a
slice's last token learns the next slice's first) and ``num_items_in_batch``, the sequence's label
count: each slice's loss is then its share of the sequence's mean loss, and the slices' losses add
up to it exactly. The whole-sequence graph takes the same inputs: the partition is planned on it,
evaluation runs it, and a slice is the same computation at another length.

So one export with a symbolic batch and sequence length (`hf_ftpipe.graph.dynamic_shapes`) serves
the whole sequence and every slice of every length: nothing is exported when a batch of a new
length, or a slicing with new lengths, comes. Only where a model cannot be exported with a
symbolic length (the capture falls back to fixed shapes, with a warning) is each distinct slice
length exported on its own, for the one sequence length every batch must then have; that is at
most as many exports as the slicing has distinct lengths. ``dynamic=False`` asks for those fixed
captures (per-length timing and memory prediction read a graph measured at each length).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph.padding import IGNORE_INDEX
from hf_ftpipe.graph.prefix_attention_rules import prefix_attention_problem
from hf_ftpipe.graph.trace import TracedModel, capture_model

__all__ = [
    "DERIVED_INPUTS",
    "SlicedModel",
    "capture_token_slices",
    "check_sliceable",
    "cut_slices",
    "fit_slices",
    "sequence_inputs",
]

DERIVED_INPUTS = frozenset({"position_ids", "shift_labels", "num_items_in_batch"})
"""Inputs the pipeline derives from a batch of ``input_ids`` (and ``attention_mask``, ``labels``)."""

_DROPOUT_FIELDS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout", "dropout")


@dataclass
class SlicedModel:
    """A causal LM captured for token slicing, and the rule that cuts a sequence of each length.

    ``by_length`` is empty when ``full`` has a symbolic sequence length (`dynamic`): that one graph
    then runs every slice. Otherwise it holds a fixed-shape capture per slice length.
    """

    full: TracedModel
    by_length: dict[int, TracedModel]
    slice_lengths: tuple[int, ...]
    """The slicing of the planned (longest) sequence length: what the plan and the run log name."""
    slices_for: Callable[[int], tuple[int, ...]] = field(default=None)  # type: ignore[assignment]
    """Sequence length → its slice lengths; by default `fit_slices` of ``slice_lengths``. Deterministic
    (a pure function of the length), so every rank cuts a batch alike without a message."""

    def __post_init__(self) -> None:
        if self.slices_for is None:
            self.slices_for = functools.partial(fit_slices, tuple(self.slice_lengths))

    @property
    def seq_len(self) -> int:
        return sum(self.slice_lengths)

    @property
    def dynamic(self) -> bool:
        """Whether ``full`` serves every slice length (its sequence length is symbolic)."""
        return not self.by_length and 1 in self.full.shapes.varying("input_ids")


def check_sliceable(model: nn.Module, seq_len: int | None = None, what: str | None = None) -> None:
    """Refuse a model token slicing cannot train exactly, naming what to use instead; warn on dropout.

    Raises:
        `TraceError`: an encoder-decoder or a model that is not a causal LM; Hugging Face gradient
            checkpointing (it drops the cache in training); dynamic-NTK RoPE (it rescales by the
            longest position of each call, which a slice does not know); a sliding window shorter
            than the sequence; an attention implementation other than ``sdpa``.
    """
    config, name = model.config, type(model).__name__
    what = what or name
    micro = "use micro-batches (`--num-microbatches` of `hf-ftpipe partition`, `num_microbatches` in Python)"
    if getattr(config, "is_encoder_decoder", False):
        raise TraceError(
            f"{what} is an encoder-decoder ({name}): token slicing needs a causal decoder (GPT-2-, Llama-style) "
            f"whose tokens see only earlier ones, and cross-attention reads the whole source; {micro}"
        )
    if not name.endswith(("ForCausalLM", "LMHeadModel")):
        raise TraceError(
            f"{what} is not a causal LM ({name}): token slicing needs a causal decoder (GPT-2-, Llama-style) "
            f"whose tokens see only earlier ones; {micro}"
        )
    if _checkpointing(model):
        raise TraceError(
            f"{name} has Hugging Face activation (gradient) checkpointing on, which drops the keys and values of "
            "earlier slices in training; turn it off on the model and recompute per stage with "
            "`PipeTrainingArguments(activation_checkpointing=True)` instead"
        )
    problem = prefix_attention_problem(config, name, piece="a slice", replacer="token slicing", longest=seq_len)
    if problem is not None:
        kind, message = problem
        fix = ""
        if kind == "dynamic_rope":
            fix = "; use a fixed scaling ('linear', 'yarn', 'llama3') or no token slicing"
        elif kind == "sliding_window":
            fix = f"; train sequences of at most {config.sliding_window} tokens or set `sliding_window=None`"
        raise TraceError(message + fix)
    dropouts = {f: getattr(config, f) for f in _DROPOUT_FIELDS if isinstance(getattr(config, f, None), float)}
    if any(p > 0 for p in dropouts.values()):
        active = ", ".join(f"{f}={p}" for f, p in dropouts.items() if p > 0)
        warnings.warn(
            f"{name} has dropout ({active}): token slices draw their dropout masks in another order than the "
            "whole sequence, so training is equal only statistically; set them to 0 for exact equality",
            stacklevel=2,
        )


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5.x renamed `is_gradient_checkpointing` (deprecated) to `is_activation_checkpointing`
    flag = getattr(type(model), "is_activation_checkpointing", None)
    name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def sequence_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with the inputs a sliced model's graphs take: global positions, labels shifted
    across the sequence (``-100`` after the last token) and the label count."""
    if "input_ids" not in batch or "labels" not in batch:
        raise TraceError(f"token slicing trains a causal LM on `input_ids` and `labels`; the batch has {sorted(batch)}")
    input_ids = torch.as_tensor(batch["input_ids"])
    labels = torch.as_tensor(batch["labels"])
    if labels.shape != input_ids.shape:
        raise TraceError(
            f"`labels` {tuple(labels.shape)} must have the shape of `input_ids` {tuple(input_ids.shape)} "
            "for a causal LM"
        )
    inputs = dict(batch)
    if "position_ids" not in inputs:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        inputs["position_ids"] = positions.expand_as(input_ids)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    inputs["shift_labels"] = shifted
    inputs["labels"] = shifted
    inputs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return inputs


def fit_slices(slice_lengths: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """``slice_lengths`` (planned for sequences of their sum) applied to a sequence of ``seq_len``:
    the leading slices that fit, the last cut to what is left. ``[3, 1, 4]`` cuts 8 tokens as
    ``(3, 1, 4)``, 5 as ``(3, 1, 1)``, 4 as ``(3, 1)`` and 2 as ``(2,)``.

    Raises:
        `TraceError`: ``seq_len`` is longer than the lengths add up to (both named, with the fix).
    """
    planned = sum(slice_lengths)
    if seq_len > planned:
        raise TraceError(
            f"a batch holds sequences of {seq_len} tokens, longer than the {planned} that `token_slices="
            f"{list(slice_lengths)}` cut; give lengths that add up to the longest sequence of the run (at least "
            f"{seq_len}), or token_slices='auto', which plans for every length"
        )
    if seq_len < 1:
        raise TraceError(f"cannot cut a sequence of {seq_len} tokens into token slices")
    slices, left = [], seq_len
    for length in slice_lengths:
        if left == 0:
            break
        slices.append(min(length, left))
        left -= slices[-1]
    return tuple(slices)


def cut_slices(inputs: Mapping[str, Any], slice_lengths: Sequence[int]) -> list[dict[str, Any]]:
    """One input dict per slice: every per-token input cut along the sequence, the rest as is."""
    seq_len = int(torch.as_tensor(inputs["input_ids"]).shape[1])
    if sum(slice_lengths) != seq_len or min(slice_lengths) < 1:
        raise TraceError(
            f"token slices {list(slice_lengths)} (sum {sum(slice_lengths)}) must be positive lengths that add up "
            f"to the sequence length {seq_len}"
        )
    pieces: list[dict[str, Any]] = []
    offset = 0
    for length in slice_lengths:
        piece = {}
        for name, value in inputs.items():
            per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len
            piece[name] = value[:, offset : offset + length].contiguous() if per_token else value
        pieces.append(piece)
        offset += length
    return pieces


def capture_token_slices(
    model: nn.Module,
    sample_inputs: Mapping[str, Any],
    slice_lengths: Sequence[int],
    *,
    full: TracedModel | None = None,
    planned: Mapping[str, Sequence[int]] | None = None,
    dynamic: bool = True,
) -> SlicedModel:
    """Capture ``model`` on one micro-batch for token slicing.

    With ``dynamic`` (the default) one export with a symbolic batch and sequence length runs the
    whole sequence and every slice; it is measured at ``planned`` (the largest micro-batch: its
    ``input_ids`` shape stands for every per-token input). ``slice_lengths`` add up to the
    planned length (the sample's without ``planned``) and cut shorter sequences by `fit_slices`.
    A model that cannot be exported so, or ``dynamic=False``, gets a fixed-shape capture whole and
    one per distinct slice length, each matched op by op to the whole one by the runtime.

    ``full``: the whole-sequence capture of an earlier call on the same model and sample, reused
    (choosing the lengths needs it first: PipeTrainer's ``token_slices="auto"``).

    Raises:
        `TraceError`: the model cannot be sliced (see `check_sliceable`), or the lengths do not add
            up to the planned sequence length.
    """
    full_inputs = sequence_inputs(sample_inputs)
    seq_len = int(full_inputs["input_ids"].shape[1])
    planned_len = int(planned["input_ids"][1]) if planned is not None and "input_ids" in planned else seq_len
    check_sliceable(model, planned_len)
    if full is None:
        with _keyword_signature(model, full_inputs):
            full = capture_model(model, full_inputs, planned=_planned_sequence(planned), dynamic=dynamic)
    if not any(_is_attention(node) for node in full.graph_module.modules()):
        raise TraceError(
            f"{type(model).__name__}'s graph has no scaled_dot_product_attention call to slice; "
            'load it with `attn_implementation="sdpa"`'
        )
    if sum(slice_lengths) != planned_len or min(slice_lengths) < 1:
        raise TraceError(
            f"token slices {list(slice_lengths)} (sum {sum(slice_lengths)}) must be positive lengths that add up "
            f"to the planned sequence length {planned_len}"
        )
    # One graph of a symbolic length serves every slice, or every batch has the one length a fixed-shape
    # capture was made for: never a graph per batch shape (`hf_ftpipe.runtime.per_shape`).
    full = replace(full, per_shape=None)
    sliced = SlicedModel(full=full, by_length={}, slice_lengths=tuple(slice_lengths))
    if sliced.dynamic:
        return sliced
    by_length: dict[int, TracedModel] = {}  # fixed shapes: every batch has the sample's length
    for length, piece in zip(slice_lengths, cut_slices(full_inputs, slice_lengths), strict=True):
        if length not in by_length:
            by_length[length] = full if length == seq_len else capture_model(model, piece, dynamic=False)
    sliced.by_length = by_length
    return sliced


def _planned_sequence(planned: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]] | None:
    """``planned`` with the derived per-token inputs at the shape of ``input_ids``."""
    if planned is None or "input_ids" not in planned:
        return None if planned is None else dict(planned)
    shape = tuple(planned["input_ids"])
    return {**planned, "position_ids": shape, "shift_labels": shape, "labels": shape}


@contextmanager
def _keyword_signature(model: nn.Module, inputs: Mapping[str, Any]) -> Iterator[None]:
    """``model.forward`` with every input of ``inputs`` a named keyword while exporting.

    ``shift_labels`` and ``num_items_in_batch`` reach a Hugging Face causal LM through
    ``**kwargs``, and torch 2.13's export cannot match symbolic dimensions to inputs there (its
    range constraints flatten ``**kwargs`` inputs twice: "Must provide a tree_name when there might
    be a mismatch"). The model itself is exported, so module paths and weight names are unchanged.
    """
    method = type(model).forward
    parameters = inspect.signature(method).parameters
    named = [
        p.replace(kind=p.KEYWORD_ONLY)
        for name, p in parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in inputs if n not in parameters]
    if not extra:
        yield
        return

    def forward(**kwargs: Any) -> Any:
        return method(model, **kwargs)

    forward.__signature__ = inspect.Signature(named + extra)  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward


def _is_attention(module: nn.Module) -> bool:
    return getattr(module, "op", None) is torch.ops.aten.scaled_dot_product_attention.default
