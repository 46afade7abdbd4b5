"""What each rank of ``benchmarks/runtime.py`` does: one runner's stages, steps, memory and stage times.

Every runner (hf_ftpipe with a schedule, or torch.distributed.pipelining with one) runs in fresh
rank processes: it builds the model of ``_gpt2_split.py`` from the same seed, splits it the same
way, times its steps, measures its peak memory and times each stage's forward + backward alone.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
import transformers
from _gpt2_split import (
    GPT2Stage,
    Placement,
    Setup,
    build_model,
    causal_lm_loss,
    first_microbatch,
    make_batch,
    split_graph,
    stage_inputs,
)
from torch import nn

ACCUMULATION_STEPS = 4
"""The ``hf_ftpipe/gradient_accumulation`` runner's G: batches per optimizer step."""
Split = Literal["one", "v", "looped"]
RUNNER_SPLITS: dict[str, Split] = {
    "hf_ftpipe/gpipe-v": "v",
    "hf_ftpipe/1f1b-v": "v",
    "hf_ftpipe/zbv": "v",
    "hf_ftpipe/zb-auto": "v",
    "hf_ftpipe/interleaved-1f1b": "looped",
    "torch/interleaved-1f1b": "looped",
    "torch/zbv": "v",
    "torch/dualpipev": "v",
}
"""Runners with two stages per rank: ``v`` puts stage s on rank min(s, 2P − 1 − s) (ZB-V, DualPipeV,
Mixed-Pipe's [0, 1, 1, 0]), ``looped`` on rank s mod P (interleaved 1F1B). Every other runner: one
stage per rank."""


def runner_schedule(runner: str) -> tuple[str, str]:
    """(``hf_ftpipe`` or ``torch``, the schedule): ``hf_ftpipe/1f1b-v`` runs ``1f1b`` on the V split."""
    kind, name = runner.split("/")
    if kind == "hf_ftpipe" and name.endswith("-v"):
        name = name[: -len("-v")]
    return kind, name


def runner_setup(setup: Setup, runner: str) -> Setup:
    """``setup`` with the runner's split: 2P stages on P ranks for a V or looped runner."""
    split = RUNNER_SPLITS.get(runner, "one")
    if split == "one":
        return dataclasses.replace(setup, stage_rank=())
    ranks, stages = setup.num_ranks, 2 * setup.num_ranks
    if split == "v":
        return dataclasses.replace(setup, stage_rank=tuple(min(s, stages - 1 - s) for s in range(stages)))
    return dataclasses.replace(setup, stage_rank=tuple(s % ranks for s in range(stages)))


def flushes(schedule: str) -> bool:
    """Whether hf_ftpipe's ``schedule`` (a name or a schedule file) leaves the optimizer step to the caller."""
    from hf_ftpipe.schedules.registry import schedule_traits

    return schedule == "gradient_accumulation" or schedule_traits(schedule).flushes


def unique_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def fastest_time_s(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Shortest wall time of ``run`` after one untimed call: its cost when nothing else competes."""
    run()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- runners --------------------------------------------------------------------------------


class HfFtpipeRunner:
    """hf_ftpipe's `PipelineEngine` with one schedule, on the scope split (any stages per rank)."""

    def __init__(self, rank: int, setup: Setup, model: transformers.GPT2LMHeadModel, schedule: str) -> None:
        from hf_ftpipe.graph import capture_model

        self.rank, self.setup, self.model = rank, setup, model
        # gradient_accumulation: 1F1B over ACCUMULATION_STEPS batches of a quarter of the micro-batches each,
        # in one flush (the same samples per optimizer step as 1F1B over the whole batch).
        self.batches = ACCUMULATION_STEPS if schedule == "gradient_accumulation" else 1
        self.schedule = "1f1b" if schedule == "gradient_accumulation" else setup.schedule_file or schedule
        self.synchronous = flushes(self.schedule)
        self.device = _device(setup, rank)
        self.traced = capture_model(model, first_microbatch(setup, make_batch(setup, 0)))
        self.placement = Placement(split_graph(self.traced.cost_graph, setup), setup.ranks_of_stages())

    def build(self) -> None:
        import inspect

        from hf_ftpipe.runtime import PipelineEngine

        keywords: dict[str, Any] = {}
        if "schedule" in inspect.signature(PipelineEngine.__init__).parameters:
            keywords["schedule"] = self.schedule
        if self.batches > 1:
            keywords["batches_per_step"] = self.batches
        self.engine = PipelineEngine(
            self.traced,
            self.placement,
            num_microbatches=self.setup.num_microbatches // self.batches,
            device=self.device,
            **keywords,
        )
        self.optimizer = torch.optim.SGD(self.engine.parameters(), lr=self.setup.lr)
        if not self.synchronous:
            self.engine.attach_optimizer(self.optimizer)

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if self.batches > 1:  # the G batches' losses add up to the whole batch's mean
            pieces = [dict(zip(batch, values)) for values in zip(*(v.chunk(self.batches) for v in batch.values()))]
            loss = self.engine.train_step(pieces).sum()
        else:
            loss = self.engine.train_step(batch)
        if self.synchronous:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def finish(self) -> None:
        if not self.synchronous:
            self.engine.drain()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.engine.parameters()

    def stage_time_s(self, batch: dict[str, torch.Tensor]) -> float:
        """This rank's stages, built from the same traced graph, run on real inputs without communication:
        the sum of each one's forward + backward of one micro-batch."""
        from hf_ftpipe.runtime import build_stage_module, plan_stages

        graph, traced, cpu = self.traced.cost_graph, self.traced, torch.device("cpu")
        specs = plan_stages(graph, self.placement.node_stage)
        microbatch = first_microbatch(self.setup, batch)
        own = self.setup.stages_of(self.rank)
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():  # the inputs of this rank's stages; other stages' weights stay on the CPU
            for spec in specs[: own[-1]]:
                module = build_stage_module(traced.graph_module, spec, traced.canonical_names, traced.tensors, cpu)
                outputs = module(*stage_inputs(traced, spec, microbatch), *[values[n] for n in spec.received])
                values.update(zip(spec.sent, outputs))
        return sum(self._forward_backward_s(specs[s], microbatch, values) for s in own)

    def _forward_backward_s(self, spec: Any, microbatch: dict[str, torch.Tensor], values: dict[str, Any]) -> float:
        from hf_ftpipe.runtime import build_stage_module

        graph, traced = self.traced.cost_graph, self.traced
        module = build_stage_module(traced.graph_module, spec, traced.canonical_names, traced.tensors, self.device)
        batch_inputs = [v.to(self.device) if torch.is_tensor(v) else v for v in stage_inputs(traced, spec, microbatch)]
        received = [values[n].to(self.device) for n in spec.received]

        def forward_backward() -> None:
            leaves = [
                v.detach().requires_grad_(bool(graph.node(n)["requires_grad"]) and v.is_floating_point())
                for n, v in zip(spec.received, received)
            ]
            outputs = module(*batch_inputs, *leaves)
            roots, grads = [], []
            for value, tensor in zip(spec.sent, outputs):
                if not tensor.requires_grad:
                    continue
                if spec.model_outputs.get("loss") == value:  # as the engine does: d(mean loss) = 1/M
                    roots.append(tensor)
                    grads.append(torch.full_like(tensor, 1.0 / self.setup.num_microbatches))
                elif spec.consumers.get(value):
                    roots.append(tensor)
                    grads.append(torch.ones_like(tensor))
            torch.autograd.backward(roots, grads)

        return fastest_time_s(forward_backward, self.device, self.setup.stage_repeats)


class TorchRunner:
    """torch.distributed.pipelining's `PipelineStage`s on `GPT2Stage`s and one of its schedules."""

    def __init__(self, rank: int, setup: Setup, model: transformers.GPT2LMHeadModel, schedule: str) -> None:
        self.rank, self.setup, self.model, self.schedule = rank, setup, model, schedule
        self.device = _device(setup, rank)
        self.loss_fn = causal_lm_loss(model)
        self.stage_indices = setup.stages_of(rank)

    def build(self) -> None:
        from torch.distributed import pipelining

        schedule_class = {
            "gpipe": pipelining.ScheduleGPipe,
            "1f1b": pipelining.Schedule1F1B,
            "interleaved-1f1b": pipelining.ScheduleInterleaved1F1B,
            "zbv": pipelining.ScheduleZBVZeroBubble,
            "dualpipev": pipelining.ScheduleDualPipeV,
        }[self.schedule]
        self.modules = [GPT2Stage(self.model, s, self.setup).to(self.device) for s in self.stage_indices]
        stages = [
            pipelining.PipelineStage(module, s, self.setup.num_stages, self.device)
            for module, s in zip(self.modules, self.stage_indices)
        ]
        # scale_grads: the loss is a mean per micro-batch, so gradients are divided by num_microbatches,
        # which makes the update the same as hf_ftpipe's. The multi-stage schedules take the list of
        # this rank's stages and place them themselves (V or looped), the others one stage.
        self.pipeline = schedule_class(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=self.setup.num_microbatches,
            loss_fn=self.loss_fn,
            scale_grads=True,
        )
        self.optimizer = torch.optim.SGD(self.parameters(), lr=self.setup.lr)

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        is_first = 0 in self.stage_indices
        is_last = self.setup.num_stages - 1 in self.stage_indices
        args = (batch["input_ids"].to(self.device),) if is_first else ()
        losses: list[torch.Tensor] = []
        if is_last:
            self.pipeline.step(*args, target=batch["labels"].to(self.device), losses=losses, return_outputs=False)
        else:
            self.pipeline.step(*args, return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean() if losses else None

    def finish(self) -> None:
        pass

    def parameters(self) -> Iterator[nn.Parameter]:
        return itertools.chain.from_iterable(module.parameters() for module in self.modules)

    def stage_time_s(self, batch: dict[str, torch.Tensor]) -> float:
        """The sum of this rank's stages' forward + backward of one micro-batch, without communication."""
        microbatch = first_microbatch(self.setup, batch)
        inputs, x = [], microbatch["input_ids"]
        with torch.no_grad():
            for s in range(self.stage_indices[-1] + 1):
                inputs.append(x.to(self.device))
                x = GPT2Stage(self.model, s, self.setup)(x)
        labels = microbatch["labels"].to(self.device)
        grad = torch.ones(x.shape[0], self.setup.seq_len, self.setup.d_model, device=self.device)
        total_s = 0.0
        for module, s in zip(self.modules, self.stage_indices):

            def forward_backward(module: GPT2Stage = module, x: torch.Tensor = inputs[s]) -> None:
                output = module(x.detach().requires_grad_(x.is_floating_point()))
                if module.is_last:
                    (self.loss_fn(output, labels) / self.setup.num_microbatches).backward()
                else:
                    output.backward(grad)

            total_s += fastest_time_s(forward_backward, self.device, self.setup.stage_repeats)
        return total_s


# -- one rank of one runner -----------------------------------------------------------------


def _device(setup: Setup, rank: int) -> torch.device:
    return torch.device("cuda", rank) if setup.device == "cuda" else torch.device("cpu")


def make_runner(rank: int, setup: Setup, runner: str) -> HfFtpipeRunner | TorchRunner:
    """This rank's part of ``runner`` ("hf_ftpipe/async", "torch/gpipe"...) on a fresh model, not yet built."""
    kind, schedule = runner_schedule(runner)
    runner_class = HfFtpipeRunner if kind == "hf_ftpipe" else TorchRunner
    return runner_class(rank, setup, build_model(setup), schedule)


def run_rank(rank: int, setup: Setup, runner: str) -> dict[str, Any]:
    """Build ``runner``, step it, and return this rank's figures."""
    from hf_ftpipe.runtime.peak_memory import PeakMemory

    pipe = make_runner(rank, setup, runner)
    batches = [make_batch(setup, step) for step in range(2)]
    gc.collect()
    dist.barrier()
    memory = PeakMemory(pipe.device)
    losses: list[float | None] = []
    with memory:  # construction and warm-up: what the CPU profiler sees
        pipe.build()
        memory.own(pipe.parameters())
        for step in range(setup.warmup):
            losses.append(_value(pipe.step(batches[step % 2])))
        # Streaming schedules carry micro-batches into the next step; with micro-batches still in
        # flight when the CPU profiler stopped, the ranks died of heap corruption (torch 2.13).
        pipe.finish()
    dist.barrier()
    step_times_s, cpu_times_s, loss = [], [], None
    for step in range(setup.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = pipe.step(batches[(setup.warmup + step) % 2])
        _synchronize(pipe.device)
        step_times_s.append(time.perf_counter() - start)
        cpu_times_s.append(time.process_time() - cpu_start)
    dist.barrier()
    losses.append(_value(loss))
    weight_bytes = unique_bytes(pipe.parameters())
    peak_bytes = memory.peak_bytes()
    pipe.finish()
    dist.barrier()  # stages are timed alone, but at the same moment on every rank, as in the pipeline
    stage_time_s = pipe.stage_time_s(batches[0])
    return {
        "rank": rank,
        "step_time_s": statistics.median(step_times_s),
        "step_cpu_s": statistics.median(cpu_times_s),
        "peak_bytes": peak_bytes,
        "weight_bytes": weight_bytes,
        "stage_time_s": stage_time_s,
        "losses": losses,
    }


def _value(loss: Any) -> float | None:
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
