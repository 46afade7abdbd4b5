"""What the cost model predicts for a plan: per stage, per GPU and for the whole pipeline.

Plain data, so that a plan file can carry its prediction and be read back without the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GPUCost", "Prediction", "StageCost"]


@dataclass(kw_only=True)
class StageCost:
    """Predicted figures of one stage, per micro-batch.

    Communication counts only traffic to or from stages on other GPUs: stages that share a GPU
    hand tensors over in memory.
    """

    device: int
    forward_s: float
    backward_s: float
    fwd_in_bytes: int
    """Activations received from stages on other GPUs (each producer's output once per stage)."""
    fwd_out_bytes: int
    """Activations sent to stages on other GPUs (each output once per destination stage)."""
    comm_fwd_in_s: float
    comm_fwd_out_s: float
    comm_bwd_in_s: float
    """Receiving the gradients of the activations this stage sent."""
    comm_bwd_out_s: float
    """Sending the gradients of the activations this stage received."""
    memory_bytes: int
    """Weights, gradients, optimizer state and activations of this stage alone."""


@dataclass(kw_only=True)
class GPUCost:
    """Predicted figures of one GPU (all the stages it runs), per micro-batch (DESIGN.md, "Cost of a GPU")."""

    compute_s: float
    """C_g: forward + backward compute of every op on the GPU."""
    comm_fwd_out_s: float
    comm_bwd_in_s: float
    cost_s: float
    """C_g + max(0, comm_fwd_out − C_g) + max(0, comm_bwd_in − C_g): communication is hidden
    behind compute when it is not longer (CCO)."""
    weights_bytes: int
    """Distinct parameters and buffers (a weight tied between two stages on the GPU once), times
    the weight versions the schedule keeps."""
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """What autograd keeps of the GPU's ops (``saved_bytes``) times the micro-batches in flight;
    with recomputation, each stage's inputs per micro-batch in flight plus one micro-batch of the
    GPU's largest stage in full (it recomputes one stage at a time)."""
    memory_bytes: int
    """The sum of the four above."""
    capacity_bytes: int
    """The device's raw memory (``GPUProfile.memory_bytes``); plans are made to fit it less the
    headroom (``estimate.usable_capacity``)."""


@dataclass(kw_only=True)
class Prediction:
    """What the cost model predicts for a partition (see ``estimate.estimate``)."""

    schedule: str
    num_microbatches: int
    microbatch_size: int
    optimizer: str
    stages: list[StageCost]
    gpus: list[GPUCost]
    step_time_s: float
    """max_g cost_g: time per micro-batch in the steady state of the pipeline (no fill/drain)."""
    ideal_step_time_s: float
    """Total compute / number of GPUs: a perfectly balanced plan without communication."""
    recompute: bool = False
    """Whether the times include recomputation's second forward (``MemoryOptions.recompute``)."""
    dtype: str | None = None
    """The compute dtype the ops were priced in; None: each op's own."""
    stage_edges: list[list[int]] = field(default_factory=list)
    """``[source, destination, bytes]`` for every pair of stages where an op of the first feeds
    an op of the second, stages on the same GPU included: activation bytes per micro-batch. The
    stage graph, so that a plan can be drawn without its model (``hf-ftpipe show --plot``);
    empty in files written before it was recorded."""

    @property
    def throughput_samples_per_s(self) -> float:
        """Samples per second in the steady state: ``microbatch_size / step_time_s``."""
        return self.microbatch_size / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def imbalance(self) -> float:
        """``step_time_s / ideal_step_time_s``: 1.0 is perfect; FTPipe reports ~1.09 on T5-3B."""
        return self.step_time_s / self.ideal_step_time_s if self.ideal_step_time_s > 0 else 1.0

    @property
    def worst_over_ideal(self) -> float:
        """The worst GPU's cost over the ideal: the name ``compare`` reports ``imbalance`` under."""
        return self.imbalance

    @property
    def max_memory_fraction(self) -> float:
        """max over GPUs of memory / raw capacity; a plan with headroom h keeps it ≤ 1 − h."""
        return max((g.memory_bytes / g.capacity_bytes for g in self.gpus if g.capacity_bytes > 0), default=0.0)
