"""Each rank's weights: loaded for its own stages only, and released for everybody else's.

A model too large for one GPU is often too large for N copies in host memory too. Build it with
empty weights (``accelerate.init_empty_weights()``, parameters on the meta device) and every rank
reads only the tensors its stages use from the checkpoint's safetensors files. A model built
with real weights works as well; `release_foreign_weights` then frees the parameters this rank
does not run, so each process keeps one slice.

`find_weights` is hf_ftpipe's one reader of a model's safetensors checkpoint: stage weights
here, and a training checkpoint's weights on resume (``trainer.checkpoint_format``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph

__all__ = ["StoredWeights", "checkpoint_files", "find_weights", "load_stage_weights", "release_foreign_weights"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def checkpoint_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, for a single-file or sharded checkpoint."""
    folder = Path(folder)
    if (folder / _INDEX).is_file():
        index = json.loads((folder / _INDEX).read_text())
        return {name: folder / file for name, file in index["weight_map"].items()}
    if (folder / _SINGLE).is_file():
        with safe_open(folder / _SINGLE, framework="pt") as handle:
            return {name: folder / _SINGLE for name in handle.keys()}
    raise PipelineError(
        f"no safetensors checkpoint in {folder} (looked for {_SINGLE} and {_INDEX}); the model has "
        "empty (meta) weights, so point `weights_path` at a folder saved with save_pretrained()"
    )


def load_stage_weights(
    modules: Mapping[int, nn.Module], graph: CostGraph, folder: str | os.PathLike, device: torch.device
) -> int:
    """Fill every meta parameter of ``modules`` from ``folder``; returns the number of tensors read.

    A weight tied across local stages is read once and stays one tensor. The checkpoint may
    store it under any of its names (``lm_head.weight`` or ``transformer.wte.weight``).
    """
    wanted: dict[str, list[tuple[nn.Module, str]]] = {}
    for module in modules.values():
        for owner_name, owner in module.named_modules():
            for leaf, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
                if tensor is not None and tensor.is_meta:
                    name = f"{owner_name}.{leaf}" if owner_name else leaf
                    wanted.setdefault(name, []).append((owner, leaf))
    if not wanted:
        return 0
    found = find_weights(folder, wanted, graph)
    if found.missing:
        raise PipelineError(
            f"{len(found.missing)} weights of this rank's stages are not in the checkpoint {folder}, e.g. "
            f"{found.missing[:5]}; is it the checkpoint of this model?"
        )
    for name, _, value in found.read():
        _place(wanted[name], value, device)
    return len(wanted)


@dataclass(frozen=True)
class StoredWeights:
    """Where a checkpoint stores each wanted tensor, and the wanted names it stores nowhere."""

    by_file: dict[Path, list[tuple[str, str]]]
    """File → (wanted name, the name it is stored under) for each tensor that file holds."""
    missing: list[str]

    def read(self) -> Iterator[tuple[str, Path, torch.Tensor]]:
        """(wanted name, file, tensor on the CPU) for every stored tensor, each file opened once."""
        for path, entries in self.by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name, stored in entries:
                    yield name, path, handle.get_tensor(stored)


def find_weights(folder: str | os.PathLike, names: Iterable[str], graph: CostGraph) -> StoredWeights:
    """Look up ``names`` in the safetensors checkpoint in ``folder`` (nothing is read yet).

    A tied weight may be stored under any of its names (``lm_head.weight`` or
    ``transformer.wte.weight``: ``graph.params[name].aliases``), so callers check ``missing``
    before reading and name the checkpoint in their own words.
    """
    files = checkpoint_files(folder)
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    missing = []
    for name in names:
        info = graph.params.get(name)
        aliases = info.aliases if info is not None else (name,)
        stored = next((alias for alias in aliases if alias in files), None)
        if stored is None:
            missing.append(name)
        else:
            by_file[files[stored]].append((name, stored))
    return StoredWeights(dict(by_file), missing)


def _place(places: list[tuple[nn.Module, str]], value: torch.Tensor, device: torch.device) -> None:
    first_owner, first_leaf = places[0]
    old = first_owner._parameters.get(first_leaf)
    if old is not None:
        dtype = old.dtype if old.is_floating_point() else value.dtype
        new: torch.Tensor = nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=old.requires_grad)
        for owner, leaf in places:
            owner._parameters[leaf] = new
    else:
        new = value.to(device)
        for owner, leaf in places:
            owner._buffers[leaf] = new


def release_foreign_weights(model: nn.Module, keep: Iterable[torch.Tensor]) -> int:
    """Move every parameter of ``model`` that is not in ``keep`` to the meta device; returns bytes freed.

    The model's structure stays intact (its config, names and shapes), so rank 0 can later load
    the gathered trained weights back into it with ``load_state_dict(..., assign=True)``.
    """
    kept = {id(tensor) for tensor in keep}
    freed = 0
    seen: set[int] = set()
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or id(param) in kept or param.is_meta:
                continue
            if id(param) not in seen:
                freed += param.numel() * param.element_size()
                seen.add(id(param))
            module._parameters[leaf] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    return freed
