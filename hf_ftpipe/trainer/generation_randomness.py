"""Sampling through the pipeline draws as one process would: from rank 0's random state, on every rank.

Every rank runs ``model.generate`` on identical logits (`hf_ftpipe.trainer.generation`), and
sampling draws from torch's global generator (the CPU one, or the device's when the logits live on
a GPU). Each rank's generator is where its own share of the run left it (dropout draws on different
layers), so the ranks would draw different tokens and their ``generate`` loops would part. So rank
0's states are copied to every rank for the call: every rank then draws rank 0's tokens, the
tokens one process seeded as rank 0 draws. After it, a rank whose states were not rank 0's gets its
own back (only rank 0 advances, as one process would); a rank whose states were rank 0's already
(PipeTrainer's data states, identical on every rank during evaluation) ends where rank 0 ends, so
they stay identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hf_ftpipe.runtime import Watchdog

__all__ = ["rank0_random_state"]


@contextmanager
def rank0_random_state(device: torch.device, watchdog: Watchdog) -> Iterator[None]:
    """Run the body on rank 0's generator states (torch's CPU one, and ``device``'s if it is a GPU);
    every rank must enter it. Each wait is bounded by ``watchdog``."""
    own = _states(device)
    # A collective's tensors live where the backend moves them: the GPU for NCCL, the CPU for gloo.
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
    shared = []
    for state in own:
        buffer = state.to(wire, copy=True)  # never the state itself: the broadcast writes into it
        with watchdog.waiting("sharing rank 0's random state for generation", collective=True):
            dist.broadcast(buffer, src=0)
        shared.append(buffer.cpu())
    followed = [torch.equal(mine, rank0) for mine, rank0 in zip(own, shared, strict=True)]
    _set_states(shared, device)
    try:
        yield
    finally:
        kept = [mine if not same else now for mine, same, now in zip(own, followed, _states(device), strict=True)]
        _set_states(kept, device)


def _states(device: torch.device) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def _set_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
