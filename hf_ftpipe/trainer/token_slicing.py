"""PipeTrainer's ``token_slices``: the slicing of every sequence length, and the capture the pipeline trains on.

With ``token_slices`` set, every rank captures the model with `capture_token_slices` on the
micro-batch it would otherwise capture whole, measured at the planned (longest) micro-batch: one
graph with a symbolic sequence length serves the whole sequence and every slice. The engine then
cuts each step's sequences by the step's length (TeraPipe) and the partition is planned on the
sliced model's whole-sequence graph.

- A list of lengths is for the planned length (they may add up to more; less is an error naming
  both): a shorter batch keeps the leading slices that fit and cuts the last to what is left
  (`hf_ftpipe.graph.token_slices.fit_slices`).
- ``"auto"``: TeraPipe's dynamic program (`SlicingByLength`) over the cost model's latency, as
  ``hf-ftpipe slices`` uses it, for one micro-batch on as many equal stages as processes, re-planned
  for each new length and kept. Rank 0 builds the latency model and sends it to every rank once;
  each rank then plans every length from it alike, without a message per length. Rank 0 logs the
  slicing of the planned length (info, through transformers' logging: `hf_ftpipe.trainer.run_log`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch import nn

from hf_ftpipe.costmodel import GPUProfile
from hf_ftpipe.costmodel.roofline_latency import cost_model_slice_time
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.token_slices import SlicedModel, capture_token_slices, fit_slices, sequence_inputs
from hf_ftpipe.graph.trace import TracedModel, capture_model
from hf_ftpipe.partitioners.slicing import LatencyFn, Slicing, SlicingByLength, slicing_step
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.trainer.arguments import PipeTrainingArguments
from hf_ftpipe.trainer.launched_gpus import named_pipeline_profile
from hf_ftpipe.trainer.replicas import launched_pipeline_size
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
    """The model captured on ``microbatch``, measured at the ``planned`` shapes (any batch shape up
    to them runs): whole, or for the token slices ``args.token_slices`` says.

    Raises:
        `ValueError`: the slice lengths add up to less than the planned sequence length.
        `TraceError`: the model cannot be sliced (`hf_ftpipe.graph.token_slices.check_sliceable`).
    """
    if args.token_slices is None:
        return capture_model(model, microbatch, planned=planned)
    sample_len = int(sequence_inputs(microbatch)["input_ids"].shape[1])  # refuses a batch without labels
    seq_len = int(planned["input_ids"][1]) if planned is not None and "input_ids" in planned else sample_len
    if args.token_slices != "auto":
        lengths = list(args.token_slices)
        if sum(lengths) < seq_len:
            raise ValueError(
                f"`token_slices={lengths}` add up to {sum(lengths)} tokens, but the pipeline is planned for "
                f"sequences of {seq_len} (the longest of the run, or `plan_max_length`); pass lengths that add up "
                f"to at least {seq_len} (shorter batches keep the leading slices that fit), or token_slices='auto'"
            )
        return capture_token_slices(model, microbatch, list(fit_slices(lengths, seq_len)), planned=planned)
    whole = capture_token_slices(model, microbatch, [seq_len], planned=planned)
    slicer = SlicingByLength(
        _share_latency(args, model, whole.full.cost_graph, watchdog),
        launched_pipeline_size(args.data_parallel_size),
        _microbatch_size(args),
    )
    if whole.by_length:  # fixed shapes (the model cannot vary its length): the one length's slices
        lengths = list(slicer(seq_len))
        return capture_token_slices(model, microbatch, lengths, full=whole.full, planned=planned)
    _log_choice(slicer.plan(seq_len), args)
    return replace(whole, slice_lengths=slicer(seq_len), slices_for=slicer)


def choose_token_slices(
    graph: CostGraph, profile: GPUProfile, *, num_stages: int, hidden_size: int, microbatch_size: int
) -> Slicing:
    """TeraPipe's slicing of one micro-batch of ``microbatch_size`` sequences of the graph's planned length."""
    seq_len = int(graph.inputs["input_ids"].shape[1])
    latency = cost_model_slice_time(graph, profile, num_stages=num_stages, hidden_size=hidden_size)
    return SlicingByLength(latency, num_stages, microbatch_size).plan(seq_len)


def _microbatch_size(args: PipeTrainingArguments) -> int:
    return max(1, args.per_device_train_batch_size // args.num_microbatches)


def _share_latency(args: PipeTrainingArguments, model: nn.Module, graph: CostGraph, watchdog: Watchdog) -> LatencyFn:
    """Rank 0 builds the latency model from the cost model; every rank receives it (or rank 0's error),
    so that every rank plans each length from the same numbers."""
    payload: list[bytes | str | None] = [None]
    if dist.get_rank() == 0:
        try:
            num_stages = launched_pipeline_size(args.data_parallel_size)
            latency = cost_model_slice_time(
                graph,
                named_pipeline_profile(args.gpu_profile, num_stages),  # a topology's pipeline too
                num_stages=num_stages,
                hidden_size=int(model.config.hidden_size),
            )
            payload[0] = pickle.dumps(latency)
        except Exception as error:  # the other ranks must not wait for a latency model that never comes
            payload[0] = f"{type(error).__name__}: {error}"
            watchdog.broadcast_from_rank0(payload, "sharing the token slices' latency model from rank 0")
            raise
    watchdog.broadcast_from_rank0(payload, "sharing the token slices' latency model from rank 0")
    if isinstance(payload[0], str) or payload[0] is None:
        raise PipelineError(f"[rank {dist.get_rank()}] rank 0 could not model the token slices' latency: {payload[0]}")
    return pickle.loads(payload[0])


def _log_choice(slicing: Slicing, args: PipeTrainingArguments) -> None:
    if dist.get_rank() == 0:
        logger.info(
            "token_slices='auto': %s (TeraPipe DP, micro-batches of %d on %d stages, %.3g ms per micro-batch "
            "predicted; re-planned for each shorter length)",
            list(slicing.slices),
            _microbatch_size(args),
            launched_pipeline_size(args.data_parallel_size),
            slicing.step_time_s * 1e3,
        )
