"""Check 1 of ``gpu_checks.py``: every schedule, all stages on one rank, against one process.

Each model of the sizes is captured once; for every schedule and dtype (float32, and bfloat16
under autocast) the engine trains a few SGD steps from the model's initial weights, and a plain
copy of the model trains the same steps in this process on the same device:

- ``gpipe``, ``1f1b`` (flushing): the micro-batches' gradients accumulated, one update per step
  (`tests/helpers/engine_runs.py` does the same on the CPU).
- ``async``, ``2bw`` (streaming): the reference replays the schedule's update rule from the
  engine's version log (`PipelineEngine.version_log`: the weight version each stage ran each
  micro-batch on), as ``tests/runtime/test_streaming.py`` does: micro-batch m's gradient is taken
  at the logged versions; ``async`` applies one micro-batch's gradient per update (scaled by the
  number of micro-batches, the engine's rule for a mean loss), ``2bw`` one mini-batch's.

Figures: the largest difference of a step loss and of a parameter after the last step. Tolerances
from ``gpu-checks.md``: float32 1e-4 absolute; bfloat16 losses 1e-2 relative, parameters 1e-2.
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _gpu_check_models import Captured, CaptureFailure, ModelSize, Sizes, microbatches
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "async", "2bw")
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
LR = 1e-3
"""Small enough that rounding does not grow into the figures: the random T5's losses start near 130,
and at 1e-2 async's twelve updates (each a micro-batch's gradient x 4) amplified float32 rounding
to 3.7e-4 in the weights on an H200, while the same run in float64 on the CPU equals the replay
exactly (T5 d 512, 4 + 4 layers, 3 stages on one rank: every weight 0.0 apart)."""
TOLERANCE = {"float32": (1e-4, 1e-5, 1e-4), "bfloat16": (0.0, 1e-2, 1e-2)}
"""dtype → (loss absolute, loss relative, parameter absolute). float32 losses also get 1e-5 relative:
the random T5's losses are near 140, where summing in another order moves the mean by 1e-4 alone."""


def check_correctness(
    captures: list[Captured | CaptureFailure], sizes: Sizes, device: torch.device, log: Callable[[str], None]
) -> dict[str, Any]:
    runs = []
    for captured in captures:
        size = captured.size
        if isinstance(captured, CaptureFailure):  # every run of the model fails, with the capture's error
            error = f"capture failed: {captured.error}"
            runs.append({"model": size.name, "schedule": "all", "dtype": "all", "ok": False, "error": error})
            log(f"correctness {size.name}: FAILED ({error})")
            continue
        reference = copy.deepcopy(captured.model).to(device)  # one per model, reset per run
        for schedule, dtype_name in sizes.correctness_runs or [(s, d) for s in SCHEDULES for d in DTYPES]:
            try:
                run = one_run(captured, reference, sizes, schedule, dtype_name, device)
            except Exception as error:  # a CUDA-only failure of one schedule: the other runs still report
                run = {"model": size.name, "schedule": schedule, "dtype": dtype_name, "ok": False}
                run["error"] = f"{type(error).__name__}: {error}"
                log(traceback.format_exc())
            runs.append(run)
            log(f"correctness {size.name} {schedule} {dtype_name}: {'ok' if run['ok'] else 'FAILED'}")
        del reference
    return {
        "check": "correctness",
        "ok": all(run["ok"] for run in runs),
        "max_loss_diff": max((run["max_loss_diff"] for run in runs if "error" not in run), default=None),
        "max_param_diff": max((run["max_param_diff"] for run in runs if "error" not in run), default=None),
        "runs": runs,
    }


def one_run(
    captured: Captured, reference: nn.Module, sizes: Sizes, schedule: str, dtype_name: str, device: torch.device
) -> dict[str, Any]:
    """The engine and the one-process reference (reset to the initial weights) on the same steps, compared."""
    dtype, data = DTYPES[dtype_name], captured.data
    captured.reset()
    losses, state, version_log, stage_params = engine_run(
        captured.traced, captured.placement, sizes, schedule, dtype, device, data
    )
    reference.load_state_dict(captured.initial)
    reference.zero_grad(set_to_none=True)
    if schedule in ("gpipe", "1f1b"):
        expected_losses = flushing_reference(reference, data, sizes, dtype, device)
    else:
        expected_losses = streaming_reference(
            reference, data, sizes, schedule, version_log, stage_params, dtype, device
        )
    return compare(captured.size, schedule, dtype_name, losses, state, expected_losses, reference)


def engine_run(
    traced: Any,
    placement: Any,
    sizes: Sizes,
    schedule: str,
    dtype: torch.dtype | None,
    device: torch.device,
    data: list[dict[str, torch.Tensor]],
) -> tuple[list[float], dict[str, torch.Tensor], list[tuple[int, ...]], dict[int, list[str]]]:
    """SGD steps of the engine over ``data``: each step's loss, the last weights (on the CPU), the
    version log and each stage's parameter names."""
    from hf_ftpipe.runtime import PipelineEngine

    engine = PipelineEngine(
        traced,
        placement,
        num_microbatches=sizes.num_microbatches,
        schedule=schedule,
        device=device,
        autocast_dtype=dtype,
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    if engine.streaming:
        engine.attach_optimizer(optimizer)
    losses = []
    for batch in data:
        losses.append(engine.train_step(batch).item())
        if not engine.streaming:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if engine.streaming:
        engine.drain()
    state = {name: value.detach().float().cpu() for name, value in engine.state_dict().items()}
    stage_params = {s: sorted(dict(module.named_parameters())) for s, module in engine.modules.items()}
    return losses, state, list(engine.version_log), stage_params


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    # One region per forward, as accelerate wraps a model's forward (engine_runs.reference_run).
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _loss_and_grads(
    model: nn.Module, microbatch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype | None
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with _autocast(device, dtype):
        loss = model(**{name: value.to(device) for name, value in microbatch.items()}).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def flushing_reference(
    model: nn.Module, data: list[dict[str, torch.Tensor]], sizes: Sizes, dtype: torch.dtype | None, device: torch.device
) -> list[float]:
    """One process: each step's micro-batches accumulated (mean loss), one SGD update per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for microbatch in microbatches(batch, sizes.num_microbatches):
            with _autocast(device, dtype):
                loss = model(**{name: value.to(device) for name, value in microbatch.items()}).loss
            (loss / sizes.num_microbatches).backward()
            total += loss.item() / sizes.num_microbatches
        optimizer.step()
        losses.append(total)
    return losses


def streaming_reference(
    model: nn.Module,
    data: list[dict[str, torch.Tensor]],
    sizes: Sizes,
    schedule: str,
    version_log: list[tuple[int, ...]],
    stage_params: dict[int, list[str]],
    dtype: torch.dtype | None,
    device: torch.device,
) -> list[float]:
    """Replay ``async`` or ``2bw`` from the engine's version log; leaves the last weights in ``model``.

    Stage s's version k is its weights after k updates: an update per micro-batch (``async``: its
    gradient, × num_microbatches × its 1 / num_microbatches weight) or per mini-batch (``2bw``: the
    mean of its micro-batches' gradients). A weight read by several stages (T5's shared embedding)
    is one tensor on one rank, versioned with its owner, the first stage holding it: every reader
    runs micro-batch m on the owner's version for m, and each update applies every reader's gradient
    (docs/schedules.md, "Tied weights"; `tests/helpers/streaming_replay.py` adds the copies of
    several ranks). Versions no later micro-batch reads are dropped, so a full-size model keeps a
    few copies, not one per update.
    """
    owner: dict[str, int] = {}
    for s in sorted(stage_params):
        for name in stage_params[s]:
            owner.setdefault(name, s)
    used = {(s, m): v for s, m, v, *_ in version_log}
    stages = sorted({s for s, _ in used})
    owner = {n: owner.get(n, stages[0]) for n, _ in model.named_parameters()}
    last_read: dict[tuple[int, int], int] = {}
    for (s, m), v in used.items():
        last_read[s, v] = max(m, last_read.get((s, v), -1))
    history = {s: {0: {n: p.detach().clone() for n, p in model.named_parameters() if owner[n] == s}} for s in stages}
    newest = dict.fromkeys(stages, 0)

    def update(gradients: dict[str, torch.Tensor]) -> None:
        for s in stages:
            latest = history[s][newest[s]]
            newest[s] += 1
            history[s][newest[s]] = {n: v - LR * gradients[n] if n in gradients else v for n, v in latest.items()}

    step_losses, m = [], 0
    for batch in data:
        step_losses.append(0.0)
        summed: dict[str, torch.Tensor] = {}
        for microbatch in microbatches(batch, sizes.num_microbatches):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(history[owner[name]][used[owner[name], m]][name])
            loss, grads = _loss_and_grads(model, microbatch, device, dtype)
            step_losses[-1] += loss / sizes.num_microbatches
            if schedule == "async":
                update(grads)
            else:
                for name, grad in grads.items():
                    summed[name] = summed.get(name, 0) + grad / sizes.num_microbatches
            for s in stages:  # versions no later micro-batch reads
                for v in [v for v in history[s] if v != newest[s] and last_read.get((s, v), -1) <= m]:
                    del history[s][v]
            m += 1
        if schedule == "2bw":
            update(summed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(history[owner[name]][newest[owner[name]]][name])
    return step_losses


def compare(
    size: ModelSize,
    schedule: str,
    dtype_name: str,
    losses: list[float],
    state: dict[str, torch.Tensor],
    expected_losses: list[float],
    reference: nn.Module,
) -> dict[str, Any]:
    loss_abs, loss_rel, param_abs = TOLERANCE[dtype_name]
    loss_diffs = [abs(a - b) for a, b in zip(losses, expected_losses, strict=True)]
    loss_ok = all(d <= loss_abs + loss_rel * abs(b) for d, b in zip(loss_diffs, expected_losses, strict=True))
    expected = {name: value.detach().float().cpu() for name, value in reference.state_dict().items()}
    trainable = {name for name, _ in reference.named_parameters()}
    missing = sorted(trainable - set(state))
    param_diff = max((state[n] - expected[n]).abs().max().item() for n in state if n in expected)
    finite = all(math.isfinite(x) for x in losses)
    return {
        "model": size.name,
        "schedule": schedule,
        "dtype": dtype_name,
        "losses": [round(x, 6) for x in losses],
        "max_loss_diff": max(loss_diffs),
        "max_param_diff": param_diff,
        "missing_params": missing,
        "ok": loss_ok and param_diff <= param_abs and not missing and finite,
    }
