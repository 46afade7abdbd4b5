"""PipeTrainer's ``token_slices``: which slice lengths, and the capture the pipeline trains on.

With ``token_slices`` set, every rank captures the model with `capture_token_slices` on the
micro-batch it would otherwise capture whole; the engine then runs each micro-batch as slices
(TeraPipe) and the partition is planned on the sliced model's whole-sequence graph.

``"auto"``: rank 0 chooses the lengths with TeraPipe's dynamic program (`plan_slicing`) over the
cost model's latency, as ``hf-ftpipe slices`` does, for one micro-batch on as many equal stages as
processes, logs them (info, through transformers' logging: `hf_ftpipe.trainer.run_log`) and sends
them to every rank, so the ranks cannot disagree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from hf_ftpipe.costmodel import GPUProfile, get_profile
from hf_ftpipe.costmodel.latency import cost_model_slice_time
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.token_slices import SlicedModel, capture_token_slices, sequence_inputs
from hf_ftpipe.graph.trace import TracedModel, capture_model
from hf_ftpipe.partitioners.slicing import Slicing, plan_slicing
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.trainer.arguments import PipeTrainingArguments
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["capture_for_pipeline", "choose_token_slices", "slicing_step"]

logger = get_logger(__name__)


def capture_for_pipeline(
    args: PipeTrainingArguments,
    model: nn.Module,
    microbatch: Mapping[str, Any],
    watchdog: Watchdog,
    planned: Mapping[str, tuple[int, ...]] | None = None,
) -> TracedModel | SlicedModel:
    """The model captured on ``microbatch``: whole (measured at the ``planned`` shapes: any batch
    shape up to them runs), or sliced as ``args.token_slices`` says (fixed shapes: every batch
    must have ``microbatch``'s sequence length).

    Raises:
        `ValueError`: the slice lengths do not add up to the batches' sequence length.
        `TraceError`: the model cannot be sliced (`hf_ftpipe.graph.token_slices.check_sliceable`).
    """
    if args.token_slices is None:
        return capture_model(model, microbatch, planned=planned)
    seq_len = int(sequence_inputs(microbatch)["input_ids"].shape[1])  # refuses a batch without labels
    if args.token_slices != "auto":
        lengths = list(args.token_slices)
        if sum(lengths) != seq_len:
            raise ValueError(
                f"`token_slices={lengths}` add up to {sum(lengths)} tokens, but the batches hold sequences of "
                f"{seq_len}; pass lengths that add up to {seq_len} (pad every batch to one length), or "
                "token_slices='auto'"
            )
        return capture_token_slices(model, microbatch, lengths)
    whole = capture_token_slices(model, microbatch, [seq_len])
    lengths = _share_auto_lengths(args, model, whole.full.cost_graph, watchdog)
    return capture_token_slices(model, microbatch, lengths, full=whole.full)


def slicing_step(seq_len: int) -> int:
    """Slice lengths are multiples of this: TeraPipe's 8 tokens, finer for a short sequence so the
    DP still has at least 8 steps to place cuts between (always a divisor of ``seq_len``)."""
    step = math.gcd(seq_len, 8)
    while step > 1 and seq_len // step < 8:
        step //= 2
    return step


def choose_token_slices(
    graph: CostGraph, profile: GPUProfile, *, num_stages: int, hidden_size: int, microbatch_size: int
) -> Slicing:
    """TeraPipe's slicing of one micro-batch of ``microbatch_size`` sequences, the graph's length.

    Every micro-batch is cut alike, so the DP plans a batch of one unit: the latency of a slice is
    that of ``microbatch_size`` sequences (it does not split the micro-batch further).
    """
    seq_len = int(graph.inputs["input_ids"].shape[1])
    latency = cost_model_slice_time(graph, profile, num_stages=num_stages, hidden_size=hidden_size)
    return plan_slicing(
        lambda slice_len, context_len, _: latency(slice_len, context_len, microbatch_size),
        seq_len,
        num_stages,
        batch_size=1,
        step=slicing_step(seq_len),
    )


def _share_auto_lengths(
    args: PipeTrainingArguments, model: nn.Module, graph: CostGraph, watchdog: Watchdog
) -> list[int]:
    """Rank 0 chooses the lengths and logs them; every rank receives them (or rank 0's error)."""
    payload: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            num_stages = dist.get_world_size()
            microbatch_size = args.per_device_train_batch_size // args.num_microbatches
            slicing = choose_token_slices(
                graph,
                get_profile(args.gpu_profile, count=num_stages),
                num_stages=num_stages,
                hidden_size=int(model.config.hidden_size),
                microbatch_size=microbatch_size,
            )
            payload[0] = json.dumps(list(slicing.slices))
            logger.info(
                "token_slices='auto': %s (TeraPipe DP, micro-batches of %d on %d stages, %.3g ms per micro-batch "
                "predicted)",
                list(slicing.slices),
                microbatch_size,
                num_stages,
                slicing.step_time_s * 1e3,
            )
        except Exception as error:  # the other ranks must not wait for lengths that never come
            payload[0] = json.dumps({"error": f"{type(error).__name__}: {error}"})
            _broadcast(payload, watchdog)
            raise
    _broadcast(payload, watchdog)
    data = json.loads(payload[0] or "{}")
    if isinstance(data, dict):
        raise PipelineError(f"[rank {dist.get_rank()}] rank 0 could not choose the token slices: {data.get('error')}")
    return [int(length) for length in data]


def _broadcast(payload: list[str | None], watchdog: Watchdog) -> None:
    with watchdog.waiting("sharing the token slices from rank 0", collective=True):
        dist.broadcast_object_list(payload, src=0)
