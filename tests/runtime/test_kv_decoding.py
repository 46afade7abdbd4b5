"""Decoding a causal LM through the pipeline with each stage's keys and values kept on its rank gives
the logits of the eager model with a `DynamicCache`: left-padded prompts of different lengths, a
prefill, one-token steps and a beam-search reorder, on two gloo ranks with one stage each and
with Mixed-Pipe's non-adjacent stages on one rank (stages [0, 1, 1, 0]). T5's cache: in
test_variable_shapes.py's launch (its capture is there); which models are refused: here."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.decoding_stages import check_cacheable

from distributed import run_ranks, values_or_raise
from models import VOCAB, tiny_batch, tiny_model
from placements import contiguous_placement

ROWS = 4
PROMPT = 6
PADDING = [2, 0, 3, 1]
"""Left padding of each row: prompts of 4, 6, 3 and 5 tokens."""
REORDERS = [None, None, [1, 0, 3, 3], None]
"""Before each one-token step: the beam-search reorder, if any (rows 1 and 3 take two rows each)."""
MAX_LENGTH = PROMPT + len(REORDERS) + 2
PLANS = {"one stage per rank": ([0, 1], 2, 0), "mixed": ([0, 1, 1, 0], 3, 2)}
"""Stage → rank, micro-batches the rows are split into (3: rows of 2, 1 and 1), and the logits kept
(``logits_to_keep``: 0 for all, 2 for the last two positions of the prompt)."""


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    for row, pad in enumerate(PADDING):
        mask[row, :pad] = 0
    return ids, mask


def positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """The new tokens' positions as ``model.generate`` counts them (0 at left padding)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -new:]


def decode(step, reorder) -> list[torch.Tensor]:
    """Prefill, then a greedy token per row per step, reordering rows where `REORDERS` says."""
    ids, mask = prompts()
    logits = [step(ids, mask, positions(mask, PROMPT))]
    for beams in REORDERS:
        if beams is not None:
            reorder(torch.tensor(beams))
        token = logits[-1][:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(ROWS, 1, dtype=torch.long)], dim=1)
        logits.append(step(token, mask, positions(mask, 1)))
    return logits


def pipeline_run(rank: int, world_size: int) -> dict:
    from hf_ftpipe.graph.trace import capture_model
    from hf_ftpipe.runtime import PipelineEngine
    from hf_ftpipe.runtime.kv_decoding import KVDecoder

    model = tiny_model("gpt2")
    traced = capture_model(model, tiny_batch("gpt2", 2))
    results = {}
    for name, (stage_rank, num_microbatches, keep) in PLANS.items():
        placement = contiguous_placement(traced.cost_graph, stage_rank)
        engine = PipelineEngine(traced, placement, num_microbatches=num_microbatches)
        decoder = KVDecoder(engine, model=model, rows=ROWS, max_length=MAX_LENGTH)
        lengths = []

        def step(ids, mask, position_ids, decoder=decoder, lengths=lengths, keep=keep):
            logits = decoder.forward(ids, mask, position_ids, logits_to_keep=keep)
            lengths.append(decoder.seq_length)
            return logits

        results[name] = decode(step, decoder.reorder), lengths
        decoder.close()
    return results


def reference() -> list[torch.Tensor]:
    model = tiny_model("gpt2").eval()
    cache = DynamicCache(config=model.config)
    # transformers 5.24 names it `cache`; 5.23 `past_key_values` (and ignores a `cache` keyword)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def step(ids, mask, position_ids):
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **{name: cache}).logits

    return decode(step, cache.reorder_cache)


def test_cached_decoding_equals_the_eager_model_with_a_dynamic_cache() -> None:
    expected = reference()
    for rank_results in values_or_raise(run_ranks(pipeline_run, 2)):
        for name, (logits, lengths) in rank_results.items():
            kept = PLANS[name][2] or PROMPT
            assert lengths == [PROMPT + step for step in range(len(REORDERS) + 1)], name
            assert [tuple(t.shape) for t in logits] == [(ROWS, kept, VOCAB)] + [(ROWS, 1, VOCAB)] * len(REORDERS)
            for step, (got, want) in enumerate(zip(logits, expected, strict=True)):
                want = want[:, -got.shape[1] :]
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (name, step, (got - want).abs().max())


def test_models_the_cache_cannot_keep_are_refused_with_the_reason() -> None:
    with pytest.raises(PipelineError) as error:
        check_cacheable(tiny_model("bart"))
    assert str(error.value) == (
        "BartForConditionalGeneration is an encoder-decoder of type 'bart': the pipeline keeps an encoder-decoder's "
        "keys and values for T5-family models (t5, mt5) only, whose decoder's positions are one relative bias it "
        "applies to each new token; generate without the pipeline's key/value cache (every new token then runs the "
        "whole prefix again)"
    )
    eager = tiny_model("t5")
    eager.config._attn_implementation = "eager"
    with pytest.raises(PipelineError, match="T5ForConditionalGeneration runs attention with 'eager'; the pipeline"):
        check_cacheable(eager)
    check_cacheable(tiny_model("t5"))  # sdpa: cached
