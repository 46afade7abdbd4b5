"""The models, batches and one-rank placements that ``gpu_checks.py`` runs its checks on.

A GPT-2 and a T5 built from configs with random weights (no download), random token batches,
and plans that put every stage on rank 0: with one GPU, NCCL cannot run two ranks, so the
engine runs several stages in one process (`PipelineEngine` with ``stage_device=[0, 0, ...]``),
which exercises the same executor, stage modules and schedules as a multi-rank run, without
the messages between ranks.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import transformers
from torch import nn

Kind = Literal["gpt2", "t5"]


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """One model of the correctness, memory and speed checks, and how it is fed and split."""

    kind: Kind
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    target_len: int = 0
    """T5's label tokens per row (0 for GPT-2)."""
    num_stages: int
    """Stages, every one on rank 0 (from 3 on, rank 0 also holds non-adjacent ones: 0 and 2)."""

    @property
    def name(self) -> str:
        return f"{self.kind} {self.layers}L d{self.hidden}, {self.num_stages} stages"


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Everything the checks size: ``QUICK`` for the CPU test, ``FULL`` for a GPU."""

    models: tuple[ModelSize, ...]
    microbatch_size: int
    num_microbatches: int
    steps: int
    """Optimizer steps per correctness run (2BW needs 3 to run on a stale version)."""
    timed_steps: int
    """Steps timed per side of split_vs_eager (after as many untimed)."""
    block_repeats: int
    """Timed forward + backward runs per block of the cost model check (after one untimed)."""
    correctness_runs: tuple[tuple[str, str], ...] = ()
    """(schedule, dtype) pairs of the correctness check; empty: every schedule in every dtype."""
    memory_runs: tuple[tuple[str, bool], ...] = ()
    """(schedule, recompute) pairs of the memory check; empty: every schedule with and without."""
    cost_layers: int = 3
    """Layers per stack of the cost-model models: block 1 (a middle layer) is the one timed."""
    cost_overrides: dict[str, dict[str, int]] = field(default_factory=dict)
    """Shipped config name → fields to change besides the layers (none: the shipped sizes)."""
    cost_shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Shipped config name → (micro-batch, sequence, target) of the timed block; empty: the
    cost model times the correctness models' layer 1 instead (``--quick``)."""


QUICK = Sizes(
    # One model: the test's time budget pays for one capture; the T5 path runs in FULL.
    models=(ModelSize(kind="gpt2", layers=3, hidden=32, heads=2, vocab=96, seq_len=8, num_stages=3),),
    microbatch_size=2,
    num_microbatches=2,
    steps=3,
    timed_steps=3,
    block_repeats=5,
    # Each schedule and each dtype at least once, in the test's time budget.
    correctness_runs=(
        ("gpipe", "float32"),
        ("1f1b", "bfloat16"),
        ("async", "bfloat16"),
        ("async", "float64"),
        ("2bw", "float32"),
    ),
    memory_runs=(("async", True),),  # streaming, recomputation and the CPU profiler at once
)
FULL = Sizes(
    models=(
        # gpu-checks.md: GPT-2 24 layers d 1024, T5 of t5-large's shapes (24 + 24 layers, d 1024).
        ModelSize(kind="gpt2", layers=24, hidden=1024, heads=16, vocab=50257, seq_len=512, num_stages=2),
        ModelSize(kind="t5", layers=24, hidden=1024, heads=16, vocab=32128, seq_len=256, target_len=32, num_stages=3),
    ),
    microbatch_size=4,
    num_microbatches=4,
    steps=3,
    timed_steps=10,
    block_repeats=10,
    cost_shapes={"t5-3b": (4, 512, 4), "gpt2-xl": (1, 1024, 0)},  # hub/setups.py: BoolQ, WikiText-2
)


def build_model(size: ModelSize, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``size``'s model in ``dtype``, random weights from ``seed``, no dropout (runs compare exactly), untied
    GPT-2 embeddings; T5's shared embedding stays shared by encoder and decoder, and by its lm_head too:
    transformers 5.24 ties T5's output layer whatever ``tie_word_embeddings`` says, so three stages read it."""
    torch.manual_seed(seed)
    if size.kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=size.vocab,
            n_positions=max(size.seq_len, 32),
            n_embd=size.hidden,
            n_layer=size.layers,
            n_head=size.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=1,
        )
        model: nn.Module = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # what transformers picks anyway, without its warning
    else:
        config = transformers.T5Config(
            vocab_size=size.vocab,
            d_model=size.hidden,
            d_ff=4 * size.hidden,
            d_kv=size.hidden // size.heads,
            num_layers=size.layers,
            num_decoder_layers=size.layers,
            num_heads=size.heads,
            dropout_rate=0.0,
            tie_word_embeddings=False,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        model = transformers.T5ForConditionalGeneration(config)
    return model.to(dtype).train()


def make_batch(size: ModelSize, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """``rows`` rows of random tokens with the labels ``size.kind`` trains on (CPU tensors)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, size.vocab, (rows, size.seq_len), generator=generator)
    if size.kind == "t5":
        labels = torch.randint(3, size.vocab, (rows, size.target_len), generator=generator)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def microbatches(batch: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``count`` micro-batches, as the engine cuts it (`torch.tensor_split`)."""
    pieces = {name: value.tensor_split(count) for name, value in batch.items()}
    return [{name: value[m] for name, value in pieces.items()} for m in range(count)]


@dataclass
class Captured:
    """A model of the sizes captured once (the export is the slow part), shared by checks 1-3: its
    initial weights, its one-rank placement and the mini-batches every run trains on."""

    size: ModelSize
    model: nn.Module
    initial: dict[str, torch.Tensor]
    traced: Any
    placement: OneRankPlacement
    data: list[dict[str, torch.Tensor]]

    def reset(self) -> None:
        """Back to the initial weights, no gradients: on the CPU an engine trains the model's own tensors."""
        self.model.load_state_dict(self.initial)
        for param in self.model.parameters():
            param.grad = None


def capture(size: ModelSize, sizes: Sizes, dtype: torch.dtype = torch.float32) -> Captured:
    """Build, capture and split ``size``'s model with ``dtype`` weights; ``sizes.steps`` mini-batches
    of data (the same for every dtype). A float64 model is captured apart from the float32 one: its
    graph is exported from float64 weights, so no op of it is fixed to float32."""
    from hf_ftpipe.graph import capture_model

    model = build_model(size, dtype=dtype)
    initial = copy.deepcopy(model.state_dict())
    rows = sizes.microbatch_size * sizes.num_microbatches
    data = [make_batch(size, rows, seed=step) for step in range(sizes.steps)]
    traced = capture_model(model, microbatches(data[0], sizes.num_microbatches)[0])
    placement = one_rank_placement(traced.cost_graph, size.num_stages)
    return Captured(size, model, initial, traced, placement, data)


@dataclass(frozen=True)
class CaptureFailure:
    """A model of the sizes whose capture raised: every check that needs it reports it failed."""

    size: ModelSize
    error: str

    def raise_error(self) -> None:
        raise RuntimeError(f"capturing {self.size.name} failed: {self.error}")


def capture_all(sizes: Sizes, log: Callable[[str], None]) -> list[Captured | CaptureFailure]:
    """Every model of ``sizes``, captured, or the error its capture raised (the others still capture)."""
    captures: list[Captured | CaptureFailure] = []
    for size in sizes.models:
        try:
            captures.append(capture(size, sizes))
        except Exception as error:  # one model's export failing must not hide the other's figures
            captures.append(CaptureFailure(size, f"{type(error).__name__}: {error}"))
            log(traceback.format_exc())
    return captures


def captured(item: Captured | CaptureFailure) -> Captured:
    """``item`` for a check that needs its model; a failed capture raises, naming the model and its error."""
    if isinstance(item, CaptureFailure):
        item.raise_error()
    assert isinstance(item, Captured)
    return item


@dataclass
class OneRankPlacement:
    """The engine's ``StagePlacement``: node → stage, and every stage on rank 0."""

    node_stage: dict[str, int]
    stage_device: list[int]


def one_rank_placement(graph: object, num_stages: int) -> OneRankPlacement:
    """DeepSpeed's ``uniform`` split into ``num_stages`` (`hf_ftpipe.partitioners.partition_uniform`:
    equal numbers of layers, the ops around them with their neighbours), every stage on rank 0."""
    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.partitioners.baselines import partition_uniform

    # A large profile: the plan is only cut here, never checked against a device's memory.
    profile = get_profile("h200", num_stages)
    plan = partition_uniform(graph, profile, num_stages=num_stages, num_microbatches=1, microbatch_size=1)
    return OneRankPlacement(dict(plan.node_stage), [0] * num_stages)


@contextlib.contextmanager
def single_process_group(device: torch.device, backend: str = "nccl") -> Iterator[None]:
    """A process group of this one process (the engine needs one): gloo on the CPU; on CUDA
    ``backend`` for CUDA tensors (NCCL as a GPU job runs; ``gloo`` to rule NCCL out) with gloo
    beside it for the CPU objects some collectives exchange."""
    if dist.is_initialized():
        yield
        return
    backend = f"cpu:gloo,cuda:{backend}" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
