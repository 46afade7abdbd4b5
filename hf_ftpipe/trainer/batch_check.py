"""Proof that every rank trains on the same batch: a digest per step, compared across ranks.

Ranks are pipeline stages, and each reads its own copy of the batch (inputs on the first stage,
labels and masks wherever they are used). Copies that differ train silently wrong: the loss is
computed on labels that do not belong to the inputs. So each step every rank hashes the batch it
is about to train on and the ranks compare one 64-bit number; the first difference stops the run
on every rank, naming the step and the fields that differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.watchdog import Watchdog

__all__ = ["batch_digests", "check_same_batch", "combined_digest"]


def batch_digests(batch: Mapping[str, Any]) -> dict[str, str]:
    """A hex digest of each field of ``batch`` (its dtype, shape and values)."""
    return {name: _digest(value).hexdigest() for name, value in sorted(batch.items())}


def combined_digest(digests: Mapping[str, str]) -> str:
    """One 16-hex-digit digest of every field's name and digest."""
    text = "\n".join(f"{name}={digest}" for name, digest in sorted(digests.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def check_same_batch(
    batch: Mapping[str, Any], step: int, watchdog: Watchdog, device: torch.device | str = "cpu"
) -> str:
    """Every rank calls it with its own copy of step ``step``'s batch; returns the batch's digest.

    Raises `PipelineError` on every rank if any two copies differ (one extra gather, of the
    per-field digests, then names the fields and what each rank had).
    """
    digests = batch_digests(batch)
    digest = combined_digest(digests)
    mine = torch.tensor([int.from_bytes(bytes.fromhex(digest), "big", signed=True)], device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with watchdog.waiting(f"comparing the batch of step {step} across ranks", collective=True):
        dist.all_gather(everyone, mine)
    if all(torch.equal(other, mine) for other in everyone):
        return digest
    per_rank: list[dict[str, str] | None] = [None] * dist.get_world_size()
    with watchdog.waiting(f"naming the fields that differ in the batch of step {step}", collective=True):
        dist.all_gather_object(per_rank, digests)
    raise PipelineError(_difference(step, per_rank))


def _difference(step: int, per_rank: list[dict[str, str] | None]) -> str:
    reference = per_rank[0] or {}
    fields = sorted({name for digests in per_rank for name in (digests or {})})
    differing = [name for name in fields if len({(digests or {}).get(name) for digests in per_rank}) > 1]
    detail = "; ".join(
        f"`{name}`: " + ", ".join(f"rank {r} {_short((d or {}).get(name))}" for r, d in enumerate(per_rank))
        for name in differing
    )
    missing = [name for name in fields if any(name not in (d or {}) for d in per_rank)]
    return (
        f"step {step}: the ranks built different batches ({detail or 'no field differs'}"
        f"{'; fields not on every rank: ' + ', '.join(missing) if missing else ''}; "
        f"rank 0 has {sorted(reference)}). Every rank reads its own copy of each batch, so all must build the "
        "same one: give every rank the same `seed` and `data_seed`, the same dataset in the same order (no "
        "per-rank shuffling or sharding), and a collator whose randomness comes from torch's, numpy's or "
        "Python's global generators (PipeTrainer loads batches under a data generator of its own, seeded "
        "from `seed`) or from a generator it seeds itself, never from the time or the process."
    )


def _short(digest: str | None) -> str:
    return "(missing)" if digest is None else digest[:12]


def _digest(value: Any) -> Any:
    """A running blake2b over ``value``'s kind, dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"ndarray {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    else:
        digest.update(f"{type(value).__name__} {value!r}".encode())
    return digest
