"""Checkpoints of a LoRA (``peft``) model: the adapter as ``peft`` writes it, read back on resume.

`Trainer` saves a ``PeftModel`` with its own ``save_pretrained``: ``adapter_model.safetensors``
(the adapter's weights, under ``peft``'s names, the adapter name left out) and
``adapter_config.json``, which ``PeftModel.from_pretrained(base_model, folder)`` loads. PipeTrainer
gathers the stages' trained weights (the adapter; the frozen base never changes) into the model on
rank 0 first (`PipeTrainer.sync_model`), then lets `Trainer` write it the same way, so checkpoints
and `save_model()` folders hold the adapter only.

On resume the frozen base weights are the ones the model was built with (training never changes
them); each rank reads the adapter into its copy of the model with ``peft``'s own loader (its
names are ``peft``'s business), then copies the trainable weights of its stages from it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from hf_ftpipe.errors import CheckpointError

__all__ = ["ADAPTER_WEIGHTS", "has_adapter", "load_adapter_weights"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""What ``PeftModel.save_pretrained`` writes the adapter's weights to (peft's ``SAFETENSORS_WEIGHTS_NAME``)."""


class _Engine(Protocol):
    rank: int

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def drain(self) -> None: ...


def has_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds an adapter written by ``PeftModel.save_pretrained``."""
    return os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS))


@torch.no_grad()
def load_adapter_weights(engine: _Engine, model: nn.Module, folder: str | os.PathLike) -> int:
    """Copy the adapter in ``folder`` into this rank's trainable weights, in place; returns how many.

    ``model`` is the rank's ``PeftModel`` (its stages' weights real, the others' may be on the meta
    device): ``peft`` loads the adapter into it by its own names, and the rank's parameters that
    train take their values from it. Every rank must call it (a streaming pipeline is drained).
    """
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    engine.drain()
    if not has_adapter(folder):
        raise CheckpointError(
            f"[rank {engine.rank}] {folder} holds no {ADAPTER_WEIGHTS}; the model is a PeftModel, whose "
            "checkpoints hold its adapter: is it a checkpoint of this model?"
        )
    adapter = model.active_adapters[0]
    with warnings.catch_warnings():  # other ranks' weights are on the meta device here: copying into them is a no-op
        warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model")
        loaded = set_peft_model_state_dict(model, load_peft_weights(os.fspath(folder), device="cpu"), adapter)
    missing = set(loaded.missing_keys)
    state = model.state_dict()
    trainable = [(name, param) for name, param in engine.named_parameters() if param.requires_grad]
    absent = [name for name, _ in trainable if name in missing or name not in state]
    if absent:
        raise CheckpointError(
            f"[rank {engine.rank}] {len(absent)} adapter weights of this rank's stages are not in {folder}, e.g. "
            f"{absent[:5]}; is it a checkpoint of this model and adapter?"
        )
    for name, param in trainable:  # the model's own tensor, unless the stage moved it to another device
        param.copy_(state[name])
    return len(trainable)
