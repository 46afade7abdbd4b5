"""Check 1 of ``gpu_checks.py``: every schedule, all stages on one rank, against one process.

Each model of the sizes is captured once (and once more from float64 weights for the float64 runs);
for every schedule and precision (float32, bfloat16 under autocast, float64) the engine trains a few
SGD steps from the model's initial weights, and a plain copy of the model trains the same steps in
this process on the same device:

- ``gpipe``, ``1f1b`` (flushing): the micro-batches' gradients accumulated, one update per step
  (`tests/helpers/engine_runs.py` does the same on the CPU).
- ``async``, ``2bw`` (streaming): the reference replays the schedule's update rule from the
  engine's version log (`PipelineEngine.version_log`: the weight version each stage ran each
  micro-batch on), as ``tests/runtime/test_streaming.py`` does: micro-batch m's gradient is taken
  at the logged versions; ``async`` applies one micro-batch's gradient per update (scaled by the
  number of micro-batches, the engine's rule for a mean loss), ``2bw`` one mini-batch's.

Figures: the largest difference of a step loss and of a parameter after the last step, against one
process at the same precision and against one process in float64. The verdict:

- float64: the engine equals one process (`EXACT`): the schedule's arithmetic is the same.
- float32 and bfloat16: the engine is no further from float64 than one process at its precision
  is, twice over, plus ``TOLERANCE``. A fixed tolerance alone cannot judge them: on a random T5
  whose losses start near 140, float32 rounding grows over twelve async updates until one process
  in float32 is 0.07 from itself in float64 (an H200, benchmarks/README.md), while the pipeline in
  float64 equals it to 1e-14.
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _gpu_check_models import Captured, CaptureFailure, ModelSize, Sizes, capture, microbatches
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "async", "2bw")
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    # name -> (the weights' dtype, autocast's dtype or None)
    "float32": (torch.float32, None),
    "bfloat16": (torch.float32, torch.bfloat16),
    "float64": (torch.float64, None),
}
LR = 1e-3
"""The random T5's losses start near 130: a larger rate makes float32's own error (one process
against itself in float64) larger still, and the check's figures say less."""
TOLERANCE = {"float32": (1e-4, 1e-5, 1e-4), "bfloat16": (0.0, 1e-2, 1e-2)}
"""precision → (loss absolute, loss relative, parameter absolute), allowed on top of twice one
process's own error. float32 losses get 1e-5 relative: near 140, summing in another order moves
the mean by 1e-4 alone."""
EXACT = (0.0, 1e-6, 1e-9)
"""float64's (loss absolute, loss relative, parameter absolute): the engine reports its loss in
float32 (1e-6 of it is rounding); the weights agree to 1e-14 on an H200."""


@dataclass
class Reference:
    """One process's run of a schedule: its step losses and its last weights (CPU, float64)."""

    losses: list[float]
    state: dict[str, torch.Tensor]


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
        runs.extend(model_runs(captured, sizes, device, log))
    return {
        "check": "correctness",
        "ok": all(run["ok"] for run in runs),
        "max_loss_diff": max((run["max_loss_diff"] for run in runs if "error" not in run), default=None),
        "max_param_diff": max((run["max_param_diff"] for run in runs if "error" not in run), default=None),
        "runs": runs,
    }


def model_runs(
    captured: Captured, sizes: Sizes, device: torch.device, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every (schedule, precision) run of one model; the float64 one-process run of a schedule is
    made once, from the first run's version log (the same for every precision), and judges them all."""
    size, runs = captured.size, []
    weight_dtypes = {dtype for dtype, _ in PRECISIONS.values()}
    references = {dtype: copy.deepcopy(captured.model).to(dtype).to(device) for dtype in weight_dtypes}
    captures = {torch.float32: captured}
    exact: dict[str, Reference] = {}
    for schedule, precision in sizes.correctness_runs or [(s, p) for s in SCHEDULES for p in PRECISIONS]:
        try:
            weights_dtype = PRECISIONS[precision][0]
            if weights_dtype not in captures:
                captures[weights_dtype] = capture(size, sizes, weights_dtype)
            run = one_run(captures[weights_dtype], references, exact, sizes, schedule, precision, device)
        except Exception as error:  # a CUDA-only failure of one schedule: the other runs still report
            run = {"model": size.name, "schedule": schedule, "dtype": precision, "ok": False}
            run["error"] = f"{type(error).__name__}: {error}"
            log(traceback.format_exc())
        runs.append(run)
        figures = run.get("error") or ", ".join(f"{key} {run[key]:.2e}" for key in run if key.endswith("_diff"))
        log(f"correctness {size.name} {schedule} {precision}: {'ok' if run['ok'] else 'FAILED'} ({figures})")
    return runs


def one_run(
    captured: Captured,
    references: dict[torch.dtype, nn.Module],
    exact: dict[str, Reference],
    sizes: Sizes,
    schedule: str,
    precision: str,
    device: torch.device,
) -> dict[str, Any]:
    """The engine and one process (at ``precision``, and in float64) on the same steps, compared."""
    weights_dtype, autocast_dtype = PRECISIONS[precision]
    captured.reset()
    losses, state, version_log, stage_params = engine_run(
        captured.traced, captured.placement, sizes, schedule, autocast_dtype, device, captured.data
    )
    log = (version_log, stage_params)
    same = reference_run(references[weights_dtype], captured, sizes, schedule, log, autocast_dtype, device)
    if schedule not in exact:
        exact.clear()  # one schedule's float64 weights at a time: a full-size T5's are 6 GB
        exact[schedule] = (
            same
            if precision == "float64"
            else reference_run(references[torch.float64], captured, sizes, schedule, log, None, device)
        )
    return compare(captured.size, schedule, precision, losses, state, same, exact[schedule])


def reference_run(
    model: nn.Module,
    captured: Captured,
    sizes: Sizes,
    schedule: str,
    log: tuple[list[tuple[int, ...]], dict[int, list[str]]],
    autocast_dtype: torch.dtype | None,
    device: torch.device,
) -> Reference:
    """One process from ``captured``'s initial weights (cast to ``model``'s dtype) on its data."""
    model.load_state_dict(captured.initial)
    model.zero_grad(set_to_none=True)
    if schedule in ("gpipe", "1f1b"):
        losses = flushing_reference(model, captured.data, sizes, autocast_dtype, device)
    else:
        losses = streaming_reference(model, captured.data, sizes, schedule, *log, autocast_dtype, device)
    trainable = {name for name, _ in model.named_parameters()}
    state = {name: value.detach().double().cpu() for name, value in model.state_dict().items()}
    return Reference(losses, {name: value for name, value in state.items() if name in trainable})


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
    state = {name: value.detach().double().cpu() for name, value in engine.state_dict().items()}
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
    precision: str,
    losses: list[float],
    state: dict[str, torch.Tensor],
    same: Reference,
    exact: Reference,
) -> dict[str, Any]:
    """The engine against one process at its precision and in float64, and the verdict (module docstring)."""
    loss_abs, loss_rel, param_abs = EXACT if precision == "float64" else TOLERANCE[precision]
    own_losses = [abs(a - b) for a, b in zip(same.losses, exact.losses, strict=True)]
    exact_losses = [abs(a - b) for a, b in zip(losses, exact.losses, strict=True)]
    loss_ok = all(
        d <= loss_abs + loss_rel * abs(e) + 2 * own for d, e, own in zip(exact_losses, exact.losses, own_losses)
    )
    own_param = _param_diff(same.state, exact.state)
    exact_param = _param_diff(state, exact.state)
    missing = sorted(set(exact.state) - set(state))
    return {
        "model": size.name,
        "schedule": schedule,
        "dtype": precision,
        "losses": [round(x, 6) for x in losses],
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, same.losses, strict=True)),
        "max_param_diff": _param_diff(state, same.state),
        "float64_loss_diff": max(exact_losses),
        "float64_param_diff": exact_param,
        "own_loss_diff": max(own_losses),
        "own_param_diff": own_param,
        "missing_params": missing,
        "ok": loss_ok and exact_param <= param_abs + 2 * own_param and not missing and all(map(math.isfinite, losses)),
    }


def _param_diff(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[name] - expected[name]).abs().max().item() for name in expected if name in state)
