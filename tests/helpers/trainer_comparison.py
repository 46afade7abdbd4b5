"""How a PipeTrainer run is compared with plain `Trainer`'s: logged steps, metrics, outputs and weights
within float32 reordering error (the pipeline sums micro-batches where `Trainer` takes one batch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def short_run_arguments(
    output_dir: str, pipe: bool, batch_size: int, max_steps: int, pipeline: dict[str, Any] | None = None, **fields: Any
) -> Any:
    """The arguments of a short CPU run at learning rate 1e-2 that logs every step and saves nothing, for either
    side of a comparison: `PipeTrainingArguments` (``pipe``: 2 micro-batches, and ``pipeline``'s fields) or
    `TrainingArguments`; ``fields`` go to both."""
    from transformers import TrainingArguments

    from hf_ftpipe import PipeTrainingArguments

    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=batch_size,
        max_steps=max_steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        **fields,
    )
    if not pipe:
        return TrainingArguments(**common)
    return PipeTrainingArguments(**{"num_microbatches": 2, **(pipeline or {})}, **common)


def logged_steps(history: list[dict]) -> list[dict]:
    """The training steps of ``trainer.state.log_history`` (with ``logging_steps=1``: one per step)."""
    return [entry for entry in history if "loss" in entry]


def assert_steps_close(history: list[dict], expected_history: list[dict]) -> None:
    """Same number of logged steps, and each step's loss, gradient norm and learning rate."""
    steps, expected = logged_steps(history), logged_steps(expected_history)
    assert len(steps) == len(expected), f"{len(steps)} steps logged, Trainer logged {len(expected)}"
    for step, (got, want) in enumerate(zip(steps, expected, strict=True)):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), f"step {step + 1} {key}: {got} vs {want}"


def assert_outputs_close(actual: object, expected: object, what: str) -> None:
    """Predictions (an array or a tuple of them), or label ids (``None`` where Trainer has none)."""
    if expected is None:
        assert actual is None, f"{what}: Trainer has None, got {type(actual).__name__}"
        return
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_outputs_close(a, e, f"{what}[{i}]")
        return
    if np.issubdtype(np.asarray(expected).dtype, np.integer):
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), **TOLERANCE, msg=what)


def assert_metrics_close(actual: dict, expected: dict, what: str) -> None:
    """Every number of ``expected`` but times and speeds; a metric Trainer lacks (a loss without
    labels) must be absent too."""
    numbers = {k for k, v in expected.items() if isinstance(v, float) and "runtime" not in k and "per_second" not in k}
    assert numbers <= set(actual), f"{what}: {sorted(numbers - set(actual))} missing from {actual}"
    for key in sorted(numbers):
        assert actual[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), f"{what} {key}"
    losses = {k for k in actual if k.endswith("_loss")} - set(expected)
    assert not losses, f"{what}: {sorted(losses)} reported where Trainer reports none"


def assert_weights_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **TOLERANCE, msg=name)
