"""Single-process training that the runtime's pipeline tests compare a pipeline with."""

from __future__ import annotations

import torch

from models import tiny_batch, tiny_model

MICROBATCH = 2
NUM_MICROBATCHES = 2
STEPS = 3
LR = 0.5


def batches(kind: str) -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(kind, MICROBATCH * NUM_MICROBATCHES, seed=step) for step in range(STEPS)]


def reference_run(
    kind: str,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float = 1.0,
    gradients: list[dict[str, torch.Tensor]] | None = None,
):
    """Single process, same micro-batches, gradients accumulated over the mini-batch.

    With ``autocast_dtype`` each forward runs under its own autocast region, as accelerate wraps
    a model's forward (one region around the whole loop would reuse weights cast before a step).
    ``loss_scale`` scales each backward and divides the gradients before the step (float16).
    ``gradients``, where given, gets each step's gradients before the step, under every name of
    each weight (a tied one's aliases too).
    """
    model = tiny_model(kind)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches(kind):
        optimizer.zero_grad()
        total = 0.0
        for m in range(NUM_MICROBATCHES):
            microbatch = {k: v[m * MICROBATCH : (m + 1) * MICROBATCH] for k, v in batch.items()}
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = model(**microbatch).loss
            (loss / NUM_MICROBATCHES * loss_scale).backward()
            total += loss.item() / NUM_MICROBATCHES
        for param in model.parameters():
            param.grad.div_(loss_scale)
        if gradients is not None:
            gradients.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
        losses.append(total)
    return losses, model.state_dict()
