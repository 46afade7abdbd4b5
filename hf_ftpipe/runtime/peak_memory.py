"""Peak tensor memory of this process over a block of code, on CUDA or on the CPU.

For checking a plan's memory prediction against what a rank really holds: the runtime benchmark
prints both side by side, and a test holds the prediction to the measurement.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["PeakMemory"]


class PeakMemory:
    """Peak tensor memory of this process while the ``with`` block runs, read with `peak_bytes`.

    CUDA: ``torch.cuda.max_memory_allocated`` since ``__enter__`` (read at `peak_bytes`, so what
    runs after the block counts too). The CPU has no such counter, so torch's profiler records
    every CPU allocation and free while the block runs (``profile_memory=True``) and the peak is
    the highest running total of their sizes: only tensors allocated inside the block count (no
    interpreter, libraries or allocator caching). The profiler also drops the free of a tensor
    allocated before it started, so call `own` on the weights first: weight stashing frees a
    parameter's original storage when it copies it on write, and that storage would otherwise be
    counted for the rest of the block. Drain an ``async`` or ``2bw`` engine inside the block: with
    micro-batches still in flight when the profiler stopped, ranks died of heap corruption (torch
    2.13)::

        with PeakMemory(device) as memory:
            memory.own(engine.parameters())
            for batch in batches:
                engine.train_step(batch)
            engine.drain()
        peak = memory.peak_bytes()
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cpu_peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            return
        self.profiler.__exit__(*exc)
        if exc[0] is None:
            # The exported trace, not the profiler's event tree: walking that tree crashed ranks.
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "trace.json")
                self.profiler.export_chrome_trace(path)
                with open(path) as file:
                    trace = json.load(file)
            events = sorted(
                (event["ts"], event["args"].get("Ev Idx", 0), event["args"]["Bytes"])
                for event in trace["traceEvents"]
                if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0  # 0: CPU
            )
            # A running sum of the events themselves: their "Total Allocated" field misses frees
            # made under activation checkpointing (measured +3.5 MiB of 4 MiB freed, torch 2.13).
            total = peak = 0
            for _, _, num_bytes in events:
                total += num_bytes
                peak = max(peak, total)
            self._cpu_peak_bytes = peak
        del self.profiler

    def own(self, parameters: Iterable[nn.Parameter]) -> None:
        """Move ``parameters`` to fresh storage allocated inside the block, so that the CPU peak
        counts them and sees their storage freed (on CUDA nothing to do)."""
        if self.device.type == "cuda":
            return
        with torch.no_grad():
            for param in {id(p): p for p in parameters}.values():
                param.data = param.data.clone()

    def peak_bytes(self) -> int:
        """Highest tensor bytes held: on the CPU inside the block, on CUDA since it began."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._cpu_peak_bytes
