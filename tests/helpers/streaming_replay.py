"""One-process replays of ``async`` and ``2bw`` with a weight several stages read (docs/schedules.md's rule).

Each rank holding a shared weight has its own copy, versioned with its owner there (the first of the
rank's stages reading it): every reader on that rank runs micro-batch m on the copy's version the
owner ran m on, and the copy's k-th update applies the k-th update's gradients of all of that rank's
readers. At the drain the copies become their common start plus the sum of every copy's change.
Every other weight is versioned with its stage, as in the engine's version log.

To give each reader its own tensor in one forward, the reference model is untied: every module
that reads the shared weight (its scope in the traced graph) gets a weight of its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_ftpipe.graph import capture_model

from placements import contiguous_placement

Step = list[tuple[dict[str, torch.Tensor], float]]
"""One mini-batch: (micro-batch, loss weight) pairs."""


def shared_readers(
    model: nn.Module, microbatch: dict[str, torch.Tensor], stage_device: list[int]
) -> dict[str, list[tuple[str, int]]]:
    """Each weight several stages read (``model`` captured on ``microbatch``, cut by the tests'
    `contiguous_placement`) → the (module path, stage) of every op reading it."""
    traced = capture_model(model, microbatch)
    graph = traced.cost_graph
    node_stage = contiguous_placement(graph, stage_device).node_stage
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in graph.topological_order():
        for name in graph.params_of([node]):
            readers.setdefault(name, set()).add((graph.graph.nodes[node]["scope"], node_stage[node]))
    return {name: sorted(r) for name, r in readers.items() if len({s for _, s in r}) > 1}


def untie(model: nn.Module, readers: dict[str, list[tuple[str, int]]]) -> dict[tuple[str, int], nn.Parameter]:
    """Give every (module path, stage) reading a shared weight a parameter of its own; returns them
    by (weight name, stage) (stages reading it through several modules get one parameter)."""
    own: dict[tuple[str, int], nn.Parameter] = {}
    for name, scopes in readers.items():
        value = model.get_parameter(name).detach()
        for scope, stage in scopes:
            param = own.setdefault((name, stage), nn.Parameter(value.clone()))
            module = copy.copy(model.get_submodule(scope))
            module._parameters = {**module._parameters, "weight": param}
            model.set_submodule(scope, module)
    return own


def replay(
    model: nn.Module,
    steps: list[Step],
    schedule: str,
    lr: float,
    version_log: list[tuple[int, ...]],
    stage_params: dict[int, list[str]],
    readers: dict[str, list[tuple[str, int]]],
    stage_device: list[int],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Replay ``schedule`` with SGD(``lr``) over ``steps``; returns each step's loss (sum of w * loss)
    and the weights after the drain. ``readers``: shared weight → (module path, stage) of each reader."""
    used = {(s, m): v for s, m, v, *_ in version_log}
    shared = {name: sorted({s for _, s in scopes}) for name, scopes in readers.items()}
    owner = {
        (name, s): min(t for t in stages if stage_device[t] == stage_device[s])
        for name, stages in shared.items()
        for s in stages
    }
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = untie(model, readers)
    # A "slot" is what has versions: (stage, name) for a stage's own weight, (owner, name) for a copy.
    slot_stage = {(s, n): s for s, names in stage_params.items() for n in names if n not in shared}
    slot_stage |= {(owner[key], key[0]): owner[key] for key in owner}
    history = {slot: [initial[slot[1]]] for slot in slot_stage}
    model.train()
    losses: list[float] = []
    pending: dict[tuple[int, str], torch.Tensor] = {}
    m = 0
    for step in steps:
        losses.append(0.0)
        for microbatch, weight in step:
            with torch.no_grad():
                for (s, n), versions in history.items():
                    if n not in shared:
                        model.get_parameter(n).copy_(versions[used[(s, m)]])
                for (n, s), param in tensors.items():
                    o = owner[(n, s)]
                    param.copy_(history[(o, n)][used[(o, m)]])
            model.zero_grad(set_to_none=True)
            loss = model(**microbatch).loss
            (loss * weight).backward()
            losses[-1] += weight * loss.item()
            scale = len(step) if schedule == "async" else 1  # async: an update per micro-batch
            grads = {(s, n): model.get_parameter(n).grad for (s, n) in slot_stage if n not in shared}
            for (n, s), param in tensors.items():
                key = (owner[(n, s)], n)
                grads[key] = param.grad if key not in grads else grads[key] + param.grad
            for key, grad in grads.items():
                if grad is not None:
                    pending[key] = scale * grad + pending.get(key, 0)
            if schedule == "async":
                _update(history, pending, lr)
            m += 1
        if schedule == "2bw":
            _update(history, pending, lr)
    final = {n: h[-1] for (_, n), h in history.items() if n not in shared}
    for name in shared:
        copies = [h[-1] for (_, n), h in history.items() if n == name]
        final[name] = initial[name] + sum(c - initial[name] for c in copies)
    return losses, final


def _update(history: dict, pending: dict, lr: float) -> None:
    for key, versions in history.items():
        versions.append(versions[-1] - lr * pending.pop(key, 0))
