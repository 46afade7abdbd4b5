"""The attention rules token slicing and cached decoding share, on real tiny models' configs."""

from __future__ import annotations

import pytest

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.prefix_attention_rules import prefix_attention_problem
from hf_ftpipe.runtime.decoding_stages import check_cacheable

from models import tiny_model


def _problem(config: object, longest: int | None = None) -> str | None:
    found = prefix_attention_problem(config, "Llama", piece="a slice", replacer="token slicing", longest=longest)
    return None if found is None else found[0]


def test_each_rule_is_named_and_a_window_as_long_as_the_sequence_is_allowed() -> None:
    config = tiny_model("llama").config
    assert _problem(config) is None
    config.sliding_window = 4
    assert _problem(config, longest=4) is None  # every token still sees every earlier one
    assert _problem(config, longest=5) == "sliding_window"
    assert _problem(config) == "sliding_window"  # cached decoding: no bound on the length
    config.sliding_window = None
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert _problem(config) == "dynamic_rope"
    config._attn_implementation = "eager"
    assert _problem(config) == "attention"  # the first rule broken is the one named


def test_cached_decoding_refuses_what_token_slicing_refuses_with_its_own_fix() -> None:
    windowed = tiny_model("llama")
    windowed.config.sliding_window = 4
    with pytest.raises(PipelineError, match="sliding window of 4 tokens, which the pipeline's key/value cache"):
        check_cacheable(windowed)
    dynamic = tiny_model("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(PipelineError, match="dynamic-NTK RoPE.*a cached step would be rotated"):
        check_cacheable(dynamic)
