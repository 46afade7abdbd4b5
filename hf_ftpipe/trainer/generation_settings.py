"""What `PipeSeq2SeqTrainer` generates with: `Seq2SeqTrainer`'s settings, resolved as it resolves them.

`Seq2SeqTrainer` passes ``gen_kwargs`` (``evaluate(max_length=..., num_beams=...)``, else
``generation_max_length`` / ``generation_num_beams`` of the arguments) to ``model.generate``, which
lays them over ``model.generation_config`` (``generation_config`` of the arguments, if given), whose
unset fields take transformers' defaults. The same layering gives the `GreedySettings` here. The
pipeline decodes greedily (`hf_ftpipe.trainer.generation`), so a setting that would change what
greedy search picks (beams, sampling, a logits processor) is refused with what to use instead,
rather than silently ignored.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

__all__ = ["GreedySettings", "greedy_settings", "seq2seq_gen_kwargs"]

_CHANGES_GREEDY_OUTPUT = (
    "min_length",
    "min_new_tokens",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "sequence_bias",
    "num_return_sequences",
)
"""GenerationConfig fields whose non-default values make ``generate`` pick other tokens than plain
greedy search (or return more rows); the pipeline's greedy decoding does not apply them."""

_HARMLESS_KWARGS = ("synced_gpus",)
"""``generate`` keywords that are no generation setting and change no token (`Seq2SeqTrainer` passes one)."""


_NONE_DROPPED = ("max_length", "num_beams")
"""`Seq2SeqTrainer.prediction_step` drops these when ``None`` (``generate`` then takes the model's)."""


@dataclass(frozen=True)
class GreedySettings:
    """Greedy decoding as ``model.generate`` would run it, and how `Seq2SeqTrainer` pads what it returns."""

    max_new_tokens: int
    decoder_start_token_id: int
    pad_token_id: int
    eos_token_id: int | list[int] | None
    padded_max_length: int
    padded_max_new_tokens: int | None
    """The model's generation config's ``max_length`` and ``max_new_tokens`` (not the requested ones):
    what `Seq2SeqTrainer` pads generated tokens and labels to (`padded_width`)."""

    def padded_width(self, length: int) -> int:
        """The width `Seq2SeqTrainer.prediction_step` pads a ``length``-long batch of tokens or labels to."""
        if length < self.padded_max_length:
            return self.padded_max_length
        if self.padded_max_new_tokens is not None and length < self.padded_max_new_tokens + 1:
            return self.padded_max_new_tokens + 1
        return length


def seq2seq_gen_kwargs(gen_kwargs: dict[str, Any], args: Any) -> dict[str, Any]:
    """``evaluate``/``predict``'s ``gen_kwargs`` with the arguments' ``generation_max_length`` and
    ``generation_num_beams`` filled in where not given, as `Seq2SeqTrainer.evaluate` fills them."""
    gen_kwargs = dict(gen_kwargs)
    max_length = getattr(args, "generation_max_length", None)
    if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length is not None:
        gen_kwargs["max_length"] = max_length
    num_beams = getattr(args, "generation_num_beams", None)
    if gen_kwargs.get("num_beams") is None and num_beams is not None:
        gen_kwargs["num_beams"] = num_beams
    return {name: value for name, value in gen_kwargs.items() if value is not None or name not in _NONE_DROPPED}


def greedy_settings(gen_kwargs: dict[str, Any], model: Any) -> GreedySettings:
    """The greedy decoding ``model.generate(**gen_kwargs)`` would run for an encoder-decoder ``model``,
    or a `ValueError` naming each setting the pipeline cannot honour and what to use instead."""
    model_config = getattr(model, "generation_config", None) or GenerationConfig()
    config = copy.deepcopy(model_config)
    unused = config.update(**{k: v for k, v in gen_kwargs.items() if k not in _HARMLESS_KWARGS})
    defaults = GenerationConfig()._get_default_generation_params()

    def value(name: str, of: GenerationConfig = config) -> Any:
        given = getattr(of, name, None)
        return defaults.get(name) if given is None else given

    problems = [f"`{name}={v!r}` is not a generation setting" for name, v in unused.items()]
    if value("num_beams") > 1:
        problems.append(
            f"`num_beams={value('num_beams')}`: generation through the pipeline is greedy only (beam search is "
            "not implemented yet); use num_beams=1 (`generation_num_beams=1`, or evaluate/predict(num_beams=1))"
        )
    if value("do_sample"):
        problems.append(
            "`do_sample=True`: generation through the pipeline is greedy only (sampling is not implemented yet); "
            "use do_sample=False with num_beams=1"
        )
    for name in _CHANGES_GREEDY_OUTPUT:
        if value(name) != defaults.get(name):
            problems.append(f"`{name}={value(name)!r}` (greedy decoding through the pipeline does not apply it)")
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(
            "generation through the pipeline cannot honour these settings (from evaluate/predict's keywords, "
            f"the arguments' generation_* fields or the model's generation_config):\n{listed}\n"
            "drop them, or generate with `model.generate` on one process"
        )
    model_settings = getattr(model, "config", None)
    start = value("decoder_start_token_id")
    start = getattr(model_settings, "decoder_start_token_id", None) if start is None else start
    pad = value("pad_token_id")
    pad = getattr(model_settings, "pad_token_id", None) if pad is None else pad
    max_new_tokens = value("max_new_tokens")
    if max_new_tokens is None:
        max_new_tokens = value("max_length") - 1  # an encoder-decoder's max_length counts the decoder start token
    if max_new_tokens < 1:
        raise ValueError(
            f"generation with max_length={value('max_length')} leaves no room for a generated token after the "
            "decoder start token; use max_length=2 or more (or max_new_tokens)"
        )
    if start is None or pad is None:
        raise ValueError(
            f"generation needs the model's `decoder_start_token_id` and `pad_token_id` (got {start} and {pad}); "
            "set them in its config or generation_config"
        )
    return GreedySettings(
        max_new_tokens=max_new_tokens,
        decoder_start_token_id=start,
        pad_token_id=pad,
        eos_token_id=value("eos_token_id"),
        padded_max_length=value("max_length", model_config),
        padded_max_new_tokens=getattr(model_config, "max_new_tokens", None),
    )
