"""The training setups that hf_ftpipe ships plans for: FTPipe's paper setups and a few current boxes.

Plain data, shared by ``benchmarks/partition_quality.py`` and the ``partitions/`` folder (see
``hf_ftpipe.hub.catalog``), so that both plan exactly the same thing.

The paper's setups (Eliad et al., ATC'21, §6, and FTPipe's public configs; ``REFERENCE.md``):
T5-3B with Adafactor on BoolQ (input/target 512/4, async micro-batch 4), RTE (320/8, 8), WiC
(64/4, 64) and MultiRC (512/4, 4); GPT2-XL on WikiText-2 (1024 tokens, micro-batch 1) and
BERT-large on SQuAD 1.1 (384, 24), both with AdamW. They ran on 8 × RTX 2080 Ti (11 GB, PCIe 3.0)
with the async schedule (PipeDream weight stashing). We plan them with 8 micro-batches in flight
and activation recomputation: FTPipe's T5-3B runs recompute, and without it T5-3B's activations
and stashed weights fit no partition of 8 × 11 GB. Every plan is for fp32 compute (what the
runtime runs today) and a weight update after every micro-batch (PipeDream's rule, the most
stashed versions; FTPipe updates every 2-5 micro-batches, which needs less memory).

MultiRC has BoolQ's shapes, so the two get the same key and the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PAPER_SETUPS", "SHIPPED_PLANS", "FineTuningTask", "PlanSpec", "setup_named"]


@dataclass(frozen=True, kw_only=True)
class FineTuningTask:
    """One fine-tuning task of a model: what one micro-batch looks like and the optimizer."""

    name: str
    """Short task name, e.g. ``"boolq"``; unique within ``PAPER_SETUPS``."""
    dataset: str
    """How the paper names the dataset, e.g. ``"BoolQ"``."""
    model: str
    """A shipped model short name (``hf_ftpipe.graph.sources.shipped_models()``)."""
    microbatch_size: int
    seq_len: int
    target_len: int | None
    """Target length of an encoder-decoder; ``None`` for the others."""
    optimizer: str

    @property
    def shape(self) -> str:
        """``"512/4"`` or ``"1024"``: input (and target) length, as the card prints it."""
        return f"{self.seq_len}" + (f"/{self.target_len}" if self.target_len else "")


PAPER_SETUPS: tuple[FineTuningTask, ...] = (
    FineTuningTask(name="boolq", dataset="BoolQ", model="t5-3b", microbatch_size=4, seq_len=512, target_len=4,
                   optimizer="adafactor"),
    FineTuningTask(name="rte", dataset="RTE", model="t5-3b", microbatch_size=8, seq_len=320, target_len=8,
                   optimizer="adafactor"),
    FineTuningTask(name="wic", dataset="WiC", model="t5-3b", microbatch_size=64, seq_len=64, target_len=4,
                   optimizer="adafactor"),
    FineTuningTask(name="multirc", dataset="MultiRC", model="t5-3b", microbatch_size=4, seq_len=512, target_len=4,
                   optimizer="adafactor"),
    FineTuningTask(name="wikitext2", dataset="WikiText-2", model="gpt2-xl", microbatch_size=1, seq_len=1024,
                   target_len=None, optimizer="adamw"),
    FineTuningTask(name="squad", dataset="SQuAD 1.1", model="bert-large", microbatch_size=24, seq_len=384,
                   target_len=None, optimizer="adamw"),
)  # fmt: skip


def setup_named(name: str) -> FineTuningTask:
    """The paper setup called ``name``; a `KeyError` listing the valid names otherwise."""
    for setup in PAPER_SETUPS:
        if setup.name == name:
            return setup
    raise KeyError(f"unknown setup {name!r}; choose one of {[s.name for s in PAPER_SETUPS]}")


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """A setup on a box of GPUs with the pipeline options: everything a shipped plan is made from."""

    setup: FineTuningTask
    gpu_profile: str
    """A built-in profile name (``hf-ftpipe profiles``)."""
    num_gpus: int
    schedule: str = "async"
    num_microbatches: int = 8
    recompute: bool = True
    headroom: float = 0.1

    @property
    def name(self) -> str:
        """``"t5-3b/rtx2080ti-x8-boolq"``: the plan's path in ``partitions/`` without ``.json``."""
        return f"{self.setup.model}/{self.gpu_profile}-x{self.num_gpus}-{self.setup.name}"


def _on(profile: str, num_gpus: int, *names: str) -> list[PlanSpec]:
    return [PlanSpec(setup=setup_named(n), gpu_profile=profile, num_gpus=num_gpus) for n in names]


_ALL = tuple(s.name for s in PAPER_SETUPS)
SHIPPED_PLANS: tuple[PlanSpec, ...] = (
    # The paper's box.
    *_on("rtx2080ti", 8, *_ALL),
    # Current boxes, one task per model (the most demanding T5-3B shape, BoolQ's 512/4).
    *_on("a100-80gb", 8, "boolq", "wikitext2", "squad"),
    *_on("rtx4090", 4, "boolq", "wikitext2", "squad"),
    *_on("l4", 8, "boolq", "wikitext2", "squad"),
)
"""Every plan in ``partitions/``, in the order of its README table."""
