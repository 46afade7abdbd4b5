"""What a model's attention must be for the pipeline to run it one piece of a sequence at a time.

Token slicing (TeraPipe) and key/value-cached decoding both replace every
``scaled_dot_product_attention`` call by one over the keys and values of the sequence so far.
That equals attention over the whole sequence only when the model calls sdpa at all, rotates each
position the same whatever else a call holds (not dynamic-NTK RoPE, which rescales by the longest
position a call sees), and lets each token see every earlier one (no sliding window shorter than
the sequence). One home for the three rules; each caller names its own fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["PrefixAttentionProblem", "prefix_attention_problem"]

PrefixAttentionProblem = tuple[Literal["attention", "dynamic_rope", "sliding_window"], str]
"""Which rule a model breaks, and the sentence saying how (without the fix)."""


def prefix_attention_problem(
    config: Any, name: str, *, piece: str, replacer: str, longest: int | None = None
) -> PrefixAttentionProblem | None:
    """The first rule ``config`` breaks, or ``None``.

    Args:
        config: the model's config.
        name (`str`): the model, as the message names it.
        piece (`str`): what one call runs, for the RoPE sentence ("a slice", "a cached step").
        replacer (`str`): what replaces sdpa and would not apply a window ("token slicing", ...).
        longest (`int`, *optional*): the longest sequence trained; a window at least this long changes
            nothing (``None``: any window is refused).
    """
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return "attention", (
            f"{name} runs attention with {implementation!r}; {replacer} replaces each "
            'scaled_dot_product_attention call, so load the model with `attn_implementation="sdpa"`'
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, Mapping) and "dynamic" in (rope.get("rope_type"), rope.get("type")):
        return "dynamic_rope", (
            f"{name} uses dynamic-NTK RoPE scaling, which rescales by the longest position each call sees: "
            f"{piece} would be rotated unlike the whole sequence"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        if longest is None or longest > window:
            return (
                "sliding_window",
                f"{name} attends within a sliding window of {window} tokens, which {replacer} does not apply",
            )
    return None
