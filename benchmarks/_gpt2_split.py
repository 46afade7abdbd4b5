"""The GPT-2 that ``runtime.py`` and ``terapipe.py`` train, and its one split: the same for every runner.

Every runner builds this model from the same seed and splits it the same way (blocks divided
evenly; embeddings on the first stage; ln_f, lm_head and the loss on the last), so that runners
differ only in how they run the stages: hf_ftpipe's split is made from each op's module scope
(`split_graph`), torch's from the same modules (`GPT2Stage`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import transformers
from torch import nn

Device = Literal["cpu", "cuda"]
_BLOCK_SCOPE = re.compile(r"^transformer\.h\.(\d+)(\.|$)")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One benchmark configuration; every rank of every runner gets the same."""

    num_ranks: int
    """Processes (one per GPU on CUDA)."""
    num_microbatches: int
    microbatch_size: int
    steps: int
    warmup: int
    device: Device
    threads_per_rank: int
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    lr: float = 1e-3
    stage_repeats: int = 5
    """Forward + backward runs of one micro-batch per stage for its time alone (the fastest is taken)."""
    stage_rank: tuple[int, ...] = ()
    """Stage → rank when a rank holds several stages (a V: ``(0, 1, 1, 0)``; looped: ``(0, 1, 0, 1)``);
    empty: one stage per rank, stage s on rank s."""
    schedule_file: str = ""
    """hf_ftpipe runners: a schedule file run instead of the runner's named schedule (``hf_ftpipe/zb-auto``:
    the order built for the split's stage times, `_runtime_simulation.zb_auto_order`)."""

    @classmethod
    def of_arguments(cls, args: argparse.Namespace, **fields: Any) -> Setup:
        """The setup of `add_model_arguments`' flags, with the fields they do not set (``num_ranks``,
        ``device``, ``threads_per_rank``, ``warmup`` where a script needs at least one) given."""
        parsed = {
            "num_microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "n_layer": args.layers,
            "d_model": args.d_model,
            "n_head": args.heads,
            "seq_len": args.seq_len,
            "vocab_size": args.vocab,
        }
        return cls(**{**parsed, **fields})

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank) or self.num_ranks

    def ranks_of_stages(self) -> list[int]:
        """Stage → rank, one entry per stage (the engine's ``stage_device``)."""
        return list(self.stage_rank) or list(range(self.num_ranks))

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in stage order."""
        return [s for s, r in enumerate(self.ranks_of_stages()) if r == rank]

    def blocks_of(self, stage_index: int) -> range:
        """The transformer blocks of a stage: layers divided evenly, in order."""
        n = self.num_stages
        return range(stage_index * self.n_layer // n, (stage_index + 1) * self.n_layer // n)


@dataclass
class Placement:
    """The ``StagePlacement`` the engine takes: node → stage, stage → rank."""

    node_stage: dict[str, int]
    stage_device: list[int]


def add_model_arguments(
    parser: argparse.ArgumentParser, *, microbatches: int, microbatches_help: str | None = None
) -> None:
    """The flags of the model and the steps that ``runtime.py``, ``simulator.py`` and ``hybrid.py`` share
    (the fields of `Setup` they fill)."""
    parser.add_argument("--microbatches", type=int, default=microbatches, help=microbatches_help)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median taken)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (CPU memory is measured on them)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary; larger loads the last stage more")


def build_model(setup: Setup) -> transformers.GPT2LMHeadModel:
    """GPT-2 without dropout and with untied embeddings (torch's pipelining cannot split shared weights)."""
    config = transformers.GPT2Config(
        vocab_size=setup.vocab_size,
        n_positions=setup.seq_len,
        n_embd=setup.d_model,
        n_layer=setup.n_layer,
        n_head=setup.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # what transformers picks anyway, without its warning
    return model


def make_batch(setup: Setup, step: int) -> dict[str, torch.Tensor]:
    """A mini-batch of random tokens (num_microbatches × microbatch_size rows); labels = input_ids."""
    generator = torch.Generator().manual_seed(step)
    shape = (setup.num_microbatches * setup.microbatch_size, setup.seq_len)
    input_ids = torch.randint(0, setup.vocab_size, shape, generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def first_microbatch(setup: Setup, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value[: setup.microbatch_size] for name, value in batch.items()}


def stage_inputs(traced: Any, spec: Any, microbatch: dict[str, torch.Tensor]) -> list[Any]:
    """A stage module's leading arguments for ``microbatch`` (`build_stage_module`'s order: batch inputs,
    then the sizes it reads, from the traced graph's shape formulas as the engine finds them); the
    received values follow."""
    from hf_ftpipe.runtime.shapes import ShapeBook

    sizes: dict[str, Any] = {}
    if spec.size_inputs:
        sizes = ShapeBook(traced.shapes, traced.cost_graph, values=(), sizes=spec.size_inputs).of(microbatch).sizes
    return [*(microbatch[n] for n in spec.batch_inputs), *(sizes[n] for n in spec.size_inputs)]


def split_graph(graph: Any, setup: Setup) -> dict[str, int]:
    """node → stage by module scope, so that it matches `GPT2Stage`.

    Ops of block i go to the stage of block i; embeddings to stage 0; ln_f and lm_head to the last
    stage. Every other op (position ids, the causal mask, the loss) follows its neighbours: the
    latest stage among its inputs, or, when it reads only model inputs, the earliest stage among
    its readers.
    """
    last = setup.num_stages - 1
    block_stage = {b: s for s in range(setup.num_stages) for b in setup.blocks_of(s)}
    fixed = {"transformer.wte": 0, "transformer.wpe": 0, "transformer.drop": 0, "transformer.ln_f": last}
    order = graph.topological_order()
    stage: dict[str, int | None] = {}
    for name in order:
        scope = graph.node(name)["scope"]
        match = _BLOCK_SCOPE.match(scope)
        if match:
            stage[name] = block_stage[int(match[1])]
        elif scope in fixed or scope.startswith("lm_head"):
            stage[name] = fixed.get(scope, last)
        else:
            inputs = [stage[p] for p in graph.graph.predecessors(name) if stage[p] is not None]
            stage[name] = max(inputs) if inputs else None
    for name in reversed(order):
        if stage[name] is None:
            readers = [stage[s] for s in graph.graph.successors(name)]
            stage[name] = min((s for s in readers if s is not None), default=0)
    return {name: s for name, s in stage.items() if s is not None}


class GPT2Stage(nn.Module):
    """One stage of the torch runner: the same GPT-2 modules as hf_ftpipe's stage (shared, not copied).

    ``forward(input_ids or hidden) -> hidden or logits``; the loss is the schedule's ``loss_fn``.
    The causal mask is passed explicitly, as the exported graph does, so both runners run the
    same attention kernel.
    """

    def __init__(self, model: transformers.GPT2LMHeadModel, stage_index: int, setup: Setup) -> None:
        super().__init__()
        transformer = model.transformer
        self.is_first = stage_index == 0
        self.is_last = stage_index == setup.num_stages - 1
        if self.is_first:
            self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop
        self.h = nn.ModuleList(transformer.h[i] for i in setup.blocks_of(stage_index))
        if self.is_last:
            self.ln_f, self.lm_head = transformer.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        if self.is_first:  # x: (B, T) token ids
            positions = torch.arange(seq_len, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions)[None])
        # x: (B, T, d_model)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).tril()
        mask = mask[None, None].expand(x.shape[0], 1, seq_len, seq_len)
        for block in self.h:
            x = block(x, attention_mask=mask)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return x


def causal_lm_loss(model: transformers.GPT2LMHeadModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own loss (shift, cross-entropy, mean): what the traced graph computes."""
    vocab_size = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits, labels, vocab_size=vocab_size)

    return loss_fn


def simulation_plan(setup: Setup, graph: Any, node_stage: dict[str, int], schedule: str) -> Any:
    """The split as a plan `hf_ftpipe.simulate` takes: float32, the `cpu` profile, the setup's placement."""
    from hf_ftpipe.plan import Partition, PartitionKey

    key = PartitionKey.from_graph(
        graph,
        dtype="float32",
        schedule=schedule,
        num_microbatches=setup.num_microbatches,
        gpu_profile="cpu",
        num_gpus=setup.num_ranks,
    )
    return Partition(node_stage=node_stage, stage_device=setup.ranks_of_stages(), partitioner="benchmark", key=key)
