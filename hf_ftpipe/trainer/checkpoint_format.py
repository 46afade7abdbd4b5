"""Checkpoints of a pipeline that any partition can resume: weights and optimizer state by parameter name.

A checkpoint folder is `Trainer`'s (``checkpoint-N/`` with ``trainer_state.json``, ``scheduler.pt``,
``rng_state_{rank}.pth``), plus what a pipeline needs to resume under another partition or
another number of ranks:

- ``model.safetensors`` + ``config.json``: the whole model, gathered from every stage by rank 0
  (`PipelineEngine.gather_state_dict`), so the folder is also a standard Hugging Face checkpoint.
  On resume each rank reads only its own stages' tensors from it (`load_engine_weights`).
- ``optimizer/rank{r}.safetensors`` + ``optimizer/rank{r}.json``: each rank's optimizer state,
  keyed by the model's own parameter names instead of a rank's parameter order. On resume every
  rank reads the JSON indexes of all the writers and takes the entries of the parameters it now
  holds, wherever they were written (`load_optimizer_state`). With ``data_parallel_size`` replicas
  of the pipeline, every replica holds the same state (its gradients are summed across the
  replicas before each update), so replica 0's ranks alone write it, ``r`` being the pipeline
  position; every replica reads it back, under any P x D.

A weight tied across ranks (GPT-2's ``wte`` and ``lm_head``) has one copy per rank holding it.
Under ``gpipe`` and ``1f1b`` every copy receives the same summed gradient, so the copies' optimizer
states are equal and the owner (the lowest rank holding it) writes the one state. Under ``async``
and ``2bw`` each copy steps with its own rank's gradients, so every holder writes its copy's state
and a resuming rank takes back the one its own rank wrote, if any (else the owner's).

The trainer drains a streaming pipeline before saving: a checkpoint never holds micro-batches in
flight, and a run resumed from it continues exactly as the run that wrote it did.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hf_ftpipe._json_depth import check_json_depth
from hf_ftpipe.errors import CheckpointError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.runtime.weight_sync import WeightSync
from hf_ftpipe.runtime.weights import find_weights

__all__ = [
    "OPTIMIZER_FOLDER",
    "check_optimizer_state",
    "load_engine_weights",
    "load_optimizer_state",
    "save_optimizer_state",
]

OPTIMIZER_FOLDER = "optimizer"
_FORMAT = "hf_ftpipe-optimizer"
_FORMAT_VERSION = 1


class _Engine(Protocol):
    """What checkpoints need of `PipelineEngine`: this rank's tensors by name, and who owns a shared one."""

    rank: int
    replica: int
    """Which replica of the pipeline this rank belongs to (0 .. data_parallel_size - 1)."""
    position: int
    """This rank's place in its replica's pipeline: the partition's device number."""
    layout: ReplicaLayout
    graph: CostGraph
    weight_sync: WeightSync
    streaming: bool

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def drain(self) -> None: ...


# -- weights --------------------------------------------------------------------------------


@torch.no_grad()
def load_engine_weights(engine: _Engine, folder: str | os.PathLike) -> int:
    """Copy this rank's weights and buffers from the checkpoint in ``folder``, in place; returns how many.

    In place, so the optimizer keeps holding the parameters. A streaming pipeline is drained
    first (micro-batches in flight would apply their updates to the new weights) and the loaded
    values become the reference its tied copies are reconciled from. A tied weight may be stored
    under any of its names. Every rank must call it.
    """
    engine.drain()
    tensors = engine.state_dict()
    found = find_weights(folder, tensors, engine.graph)
    if found.missing:
        raise CheckpointError(
            f"[rank {engine.rank}] {len(found.missing)} weights of this rank's stages are not in the checkpoint "
            f"{folder}, e.g. {found.missing[:5]}; is it a checkpoint of this model?"
        )
    count = 0
    for name, path, value in found.read():
        tensor = tensors[name]
        if value.shape != tensor.shape:
            raise CheckpointError(
                f"[rank {engine.rank}] {name!r} has shape {tuple(value.shape)} in {path} but "
                f"{tuple(tensor.shape)} in the model; is it a checkpoint of this model?"
            )
        tensor.copy_(value)
        count += 1
    if engine.streaming:
        engine.weight_sync.remember_tied(dict(engine.named_parameters()))
    return count


# -- optimizer state ------------------------------------------------------------------------


def save_optimizer_state(engine: _Engine, optimizer: torch.optim.Optimizer, folder: str | os.PathLike) -> None:
    """Write this rank's optimizer state under parameter names (every rank calls it; the ranks of
    replica 0 write, the others hold the same state).

    ``optimizer/rank{r}.json`` holds the param groups' settings with the names of their
    parameters, and each parameter's non-tensor state; ``optimizer/rank{r}.safetensors`` the
    tensor state, as ``{parameter name}/{state key}`` (e.g. ``transformer.h.0.mlp.c_fc.weight/exp_avg``).
    """
    if engine.replica != 0:
        return  # replica 0's ranks are pipeline positions 0 .. P - 1: rank{r} names a position
    params = dict(engine.named_parameters())
    names = {id(param): name for name, param in params.items()}
    groups = []
    for group in optimizer.param_groups:
        settings = {key: _to_json(value, f"param group setting {key!r}") for key, value in group.items()}
        settings["params"] = [names[id(p)] for p in group["params"] if id(p) in names]
        groups.append(settings)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, param in params.items():
        if engine.weight_sync.owner(name) != engine.rank and not engine.streaming:
            continue  # a shared weight's copies have one state (summed gradients): the owner writes it
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = _to_json(value, f"optimizer state {key!r} of {name!r}")
    index = {
        "format": _FORMAT,
        "version": _FORMAT_VERSION,
        "optimizer": type(_unwrap(optimizer)).__name__,
        "rank": engine.rank,
        "world_size": engine.layout.pipeline_size,  # the writers: one pipeline's ranks
        "param_groups": groups,
        "tensors": sorted(tensors),
        "scalars": scalars,
    }
    out = Path(folder) / OPTIMIZER_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / f"rank{engine.rank}.safetensors", metadata={"format": _FORMAT})
    (out / f"rank{engine.rank}.json").write_text(json.dumps(index, indent=1))


def check_optimizer_state(folder: str | os.PathLike) -> None:
    """Refuse a checkpoint whose ``optimizer/`` lacks a rank's files or mixes two runs (before any rank
    reads from it); a checkpoint without ``optimizer/`` (``save_only_model``, plain `Trainer`) passes."""
    if (Path(folder) / OPTIMIZER_FOLDER).is_dir():
        _read_indexes(Path(folder) / OPTIMIZER_FOLDER)


def load_optimizer_state(engine: _Engine, optimizer: torch.optim.Optimizer, folder: str | os.PathLike) -> None:
    """Give ``optimizer`` the saved state of the parameters this rank holds, whatever rank wrote it.

    Builds the optimizer's own ``state_dict`` for this rank's parameter order and hands it to
    ``optimizer.load_state_dict``, which casts each state tensor to its parameter's device and
    dtype as usual.
    """
    saved = _SavedOptimizer(Path(folder) / OPTIMIZER_FOLDER, reader_rank=engine.position)
    kind = type(_unwrap(optimizer)).__name__
    if saved.optimizers != {kind}:
        raise CheckpointError(
            f"the checkpoint {folder} holds {sorted(saved.optimizers)} state but this run's optimizer is "
            f"{kind}; resume with the `optim` setting of the run that wrote it"
        )
    names = {id(param): name for name, param in engine.named_parameters()}
    packed = optimizer.state_dict()["param_groups"]  # the optimizer's own numbering of its parameters
    state: dict[int, dict[str, Any]] = {}
    groups = []
    unknown = []
    with saved:
        for numbers, group in zip(packed, optimizer.param_groups, strict=True):
            group_names = [names.get(id(p)) for p in group["params"]]
            source = next((saved.settings(name) for name in group_names if saved.has(name)), {})
            settings = {k: _from_json(source[k], like=v) if k in source else v for k, v in numbers.items()}
            groups.append({**settings, "params": numbers["params"]})
            for number, name in zip(numbers["params"], group_names, strict=True):
                if not saved.has(name):
                    unknown.append(name or f"parameter #{number}")
                elif entry := saved.state(name):
                    state[number] = entry
    if unknown:
        raise CheckpointError(
            f"[rank {engine.rank}] the optimizer state in {folder} has no entry for {len(unknown)} parameters "
            f"of this rank, e.g. {unknown[:5]}; is it a checkpoint of this model?"
        )
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class _SavedOptimizer:
    """Every rank's saved optimizer state, looked up by parameter name.

    A weight tied across ranks under ``async``/``2bw`` has a state per copy (each copy took its
    own rank's gradients): a reader takes the copy its own rank wrote if there is one, else the
    owner's. Resuming with the same partition so gives every copy its own state back.
    """

    def __init__(self, folder: Path, reader_rank: int) -> None:
        self.folder = folder
        self._files = ExitStack()
        self._handles: dict[Path, Any] = {}
        indexes = _read_indexes(folder)
        self.optimizers = {index["optimizer"] for index in indexes}
        self._settings: dict[str, dict[str, Any]] = {}
        self._tensors: dict[str, tuple[Path, list[str]]] = {}
        self._scalars: dict[str, dict[str, Any]] = {}
        # The reader's own file last, so its copies replace the owner's.
        for index in sorted(indexes, key=lambda index: (index["rank"] == reader_rank, -index["rank"])):
            path = folder / f"rank{index['rank']}.safetensors"
            for group in index["param_groups"]:
                self._settings.update(dict.fromkeys(group["params"], group))
            keys: dict[str, list[str]] = defaultdict(list)
            for key in index["tensors"]:
                keys[key.rpartition("/")[0]].append(key)
            self._tensors.update({name: (path, name_keys) for name, name_keys in keys.items()})
            self._scalars.update(index["scalars"])

    def has(self, name: str | None) -> bool:
        return name is not None and name in self._settings

    def settings(self, name: str) -> dict[str, Any]:
        """The settings (``lr``, ``betas``, ...) of the param group that held ``name``."""
        return {key: value for key, value in self._settings[name].items() if key != "params"}

    def state(self, name: str) -> dict[str, Any]:
        """The optimizer state of ``name`` (e.g. ``step``, ``exp_avg``, ``exp_avg_sq``); use inside ``with``."""
        entry = dict(self._scalars.get(name, {}))
        if name in self._tensors:
            path, keys = self._tensors[name]
            if path not in self._handles:
                self._handles[path] = self._files.enter_context(safe_open(path, framework="pt", device="cpu"))
            entry.update({key.rpartition("/")[2]: self._handles[path].get_tensor(key) for key in keys})
        return entry

    def __enter__(self) -> _SavedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._files.close()


def _read_indexes(folder: Path) -> list[dict[str, Any]]:
    paths = sorted(folder.glob("rank*.json"))
    if not paths:
        raise CheckpointError(
            f"no pipeline optimizer state in {folder} (rank*.json); resume from a checkpoint written by "
            "PipeTrainer (a plain Trainer checkpoint's weights can be used with `weights_path` instead)"
        )
    indexes = [_read_index(path) for path in paths]
    bad = [str(path) for path, index in zip(paths, indexes, strict=True) if index.get("format") != _FORMAT]
    if bad:
        raise CheckpointError(f"{bad} are not hf_ftpipe optimizer indexes (no format {_FORMAT!r})")
    world_sizes = {index["world_size"] for index in indexes}
    if len(world_sizes) != 1 or len(indexes) != next(iter(world_sizes)):
        raise CheckpointError(
            f"{folder} holds {len(indexes)} rank files but they were written by {sorted(world_sizes)} ranks; "
            "the checkpoint is incomplete (a rank failed while saving?) or mixes two runs"
        )
    # Every rank checks every writer's tensor file here, before any rank reads one: a rank that
    # needs none of a missing file's entries would otherwise go on and wait for the rank that does.
    missing = [f"rank{index['rank']}.safetensors" for index in indexes]
    missing = [name for name in missing if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(
            f"the checkpoint {folder.parent} is incomplete: {folder.name}/{missing[0]} is missing (its "
            f"{folder.name}/{missing[0].replace('.safetensors', '.json')} is there)"
            + (f", and {len(missing) - 1} more tensor files" if len(missing) > 1 else "")
            + "; resume from another checkpoint, or copy the checkpoint again if it was moved"
        )
    return indexes


def _read_index(path: Path) -> dict[str, Any]:
    text = path.read_text()
    check_json_depth(text, str(path), CheckpointError)
    return json.loads(text)


def _unwrap(optimizer: Any) -> Any:
    """accelerate's `AcceleratedOptimizer` wraps the optimizer `Trainer` made."""
    return getattr(optimizer, "optimizer", optimizer)


def _to_json(value: Any, what: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return [_to_json(v, what) for v in value]
    if value is None or isinstance(value, bool | int | float | str | list):
        return value
    raise CheckpointError(
        f"{what} is a {type(value).__name__}, which hf_ftpipe checkpoints cannot store; "
        "use an optimizer whose settings are numbers, strings or tuples of them"
    )


def _from_json(value: Any, like: Any) -> Any:
    """A saved setting in the type the fresh optimizer uses for it (tuples, tensors)."""
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(like, torch.Tensor):
        return torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return value
