"""A tiny GPT-2 traced on meta, and cost tables made by hand from its roofline (a block made slow at will)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import transformers

from hf_ftpipe.costmodel.measured import BlockTime, CostKey, CostTable
from hf_ftpipe.costmodel.op_time import node_costs
from hf_ftpipe.costmodel.profiles import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.graph.trace import TracedModel, capture_model
from hf_ftpipe.plan.blocks import blocks_of

_TRACED: dict[int, TracedModel] = {}


def tiny_gpt2_traced(num_layers: int = 4) -> TracedModel:
    """A ``num_layers``-layer GPT-2 (hidden 32) built on meta and captured at 2 × 8 tokens, once per session."""
    if num_layers not in _TRACED:
        config = transformers.GPT2Config(
            vocab_size=96, n_positions=32, n_embd=32, n_layer=num_layers, n_head=2, bos_token_id=1, eos_token_id=1
        )
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        ids = torch.ones(2, 8, dtype=torch.long, device="meta")
        _TRACED[num_layers] = capture_model(model, {"input_ids": ids, "labels": ids})
    return _TRACED[num_layers]


def roofline_table(graph: CostGraph, profile: GPUProfile, slower: Mapping[str, float] | None = None) -> CostTable:
    """The table a profile would write if the device ran every op at ``profile``'s roofline, with the
    time of each block named in ``slower`` multiplied by its factor."""
    costs = node_costs(graph, profile, "float32")
    blocks, shares = [], {}
    for block in blocks_of(graph):
        forward = math.fsum(costs[n].forward_s for n in block.nodes)
        backward = math.fsum(costs[n].backward_s for n in block.nodes)
        factor = (slower or {}).get(block.name, 1.0)
        blocks.append(BlockTime(block.name, list(block.nodes), forward * factor, backward * factor))
        for n in block.nodes:
            shares[n] = [
                costs[n].forward_s / forward if forward else 0.0,
                costs[n].backward_s / backward if backward else 0.0,
            ]
    key = CostKey.of(graph, dtype="float32", device=profile.name)
    return CostTable(key=key, blocks=blocks, shares=shares, repeats=1, warmup=0)
