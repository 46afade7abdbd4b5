"""What generation through the pipeline runs with, and what it cannot run.

`Seq2SeqTrainer` passes ``gen_kwargs`` (``evaluate(max_length=..., num_beams=...)``, else
``generation_max_length`` / ``generation_num_beams`` of the arguments) to ``model.generate``, which
lays them over ``model.generation_config`` (``generation_config`` of the arguments, if given), whose
unset fields take transformers' defaults. `seq2seq_gen_kwargs` resolves them as it does, and
`seq2seq_padded_width` pads what comes back as it pads. Generation through the pipeline is
``generate``'s own code (`hf_ftpipe.trainer.generation`), so beams, sampling and logits processors
need nothing here; `check_pipeline_generation` refuses only the modes that need more of the model
than the logits the pipeline returns, each with the reason and what to use instead.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import GenerationConfig

__all__ = [
    "check_pipeline_generation",
    "resolved_generation_config",
    "seq2seq_gen_kwargs",
    "seq2seq_padded_width",
    "settled_generation_config",
]

_NONE_DROPPED = ("max_length", "num_beams")
"""`Seq2SeqTrainer.prediction_step` drops these when ``None`` (``generate`` then takes the model's)."""

_NEEDS_A_CROPPED_CACHE = (
    "assisted generation verifies draft tokens and rolls the key/value cache back past the rejected ones"
)
_FROM_THE_HUB = (
    "transformers runs this mode from code it loads from the Hub (`custom_generate`), which calls the model in its "
    "own way"
)


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


def resolved_generation_config(model: Any, gen_kwargs: dict[str, Any]) -> GenerationConfig:
    """The settings ``model.generate(**gen_kwargs)`` runs with: the keywords over ``generation_config``
    (the keyword, else the model's), over transformers' defaults, as ``generate`` lays them."""
    own = getattr(model, "generation_config", None) or GenerationConfig()
    config = copy.deepcopy(gen_kwargs.get("generation_config") or GenerationConfig())
    config.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**own._get_default_generation_params(), defaults_only=True)
    config.update(**{name: value for name, value in gen_kwargs.items() if name != "generation_config"})
    return config


def check_pipeline_generation(model: Any, gen_kwargs: dict[str, Any]) -> None:
    """A `ValueError` naming each setting of ``model.generate(**gen_kwargs)`` that generation through
    the pipeline cannot run, why, and what to use instead; nothing for the rest (greedy and beam
    search, sampling, logits processors, stopping criteria: ``generate``'s own code)."""
    config = resolved_generation_config(model, gen_kwargs)
    problems = []
    assisted = [
        f"`{name}={value!r}`"
        for name, value in (
            ("assistant_model", gen_kwargs.get("assistant_model")),
            ("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens),
            ("assistant_early_exit", config.assistant_early_exit),
            ("use_mtp", getattr(config, "use_mtp", None)),
        )
        if value not in (None, False)
    ]
    if assisted:
        problems.append(
            f"{', '.join(assisted)} (assisted generation): {_NEEDS_A_CROPPED_CACHE}, and the pipeline's caches "
            "cannot be rolled back; drop it (plain greedy search or sampling generates the same kind of tokens)"
        )
    if (config.penalty_alpha or 0) > 0 and (config.top_k or 0) > 1 and not config.do_sample:
        problems.append(
            f"`penalty_alpha={config.penalty_alpha}` (contrastive search): {_FROM_THE_HUB}, reading its hidden states, "
            "which the pipeline does not return; drop it, or use beam search or sampling"
        )
    if config.dola_layers is not None:
        problems.append(
            f"`dola_layers={config.dola_layers!r}` (DoLa decoding): {_FROM_THE_HUB}, reading the hidden states of "
            "early layers, which the pipeline does not return; drop it"
        )
    if (config.num_beam_groups or 1) > 1:
        problems.append(
            f"`num_beam_groups={config.num_beam_groups}` (group beam search): {_FROM_THE_HUB}; drop it (plain beam "
            "search with `num_beams` runs through the pipeline)"
        )
    if config.constraints is not None or config.force_words_ids is not None:
        problems.append(
            "`constraints` / `force_words_ids` (constrained beam search): "
            f"{_FROM_THE_HUB}; drop them, or steer plain beam search with a logits processor"
        )
    if gen_kwargs.get("custom_generate") is not None:
        problems.append(
            "`custom_generate`: a decoding loop of its own calls the model in ways the pipeline was not checked "
            "against; drop it, or generate with `model.generate` on one process"
        )
    for name in ("output_hidden_states", "output_attentions"):
        if getattr(config, name, None):
            problems.append(
                f"`{name}=True`: the pipeline returns the model's logits only, not its hidden states or "
                "attentions; drop it (`output_scores` / `output_logits` work)"
            )
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(
            "generation through the pipeline cannot run these settings (from the call's keywords, the arguments' "
            f"generation_* fields or the model's generation_config):\n{listed}"
        )


def settled_generation_config(model: Any) -> GenerationConfig:
    """``model.generation_config`` as `Seq2SeqTrainer.prediction_step` leaves it after generating: no
    longer marked as made from the model's config, transformers' defaults written into its unset
    fields (it pads to them, and `save_model` writes them)."""
    config = model.generation_config
    if config._from_model_config:
        config._from_model_config = False
    config.update(**config._get_default_generation_params(), defaults_only=True)
    return config


def seq2seq_padded_width(config: GenerationConfig, length: int) -> int:
    """The width `Seq2SeqTrainer.prediction_step` pads a ``length``-long batch of generated tokens or
    labels to: the (settled) generation config's ``max_length`` (not the requested one), else its
    ``max_new_tokens`` + 1, else as long as it is."""
    if length < config.max_length:
        return config.max_length
    if config.max_new_tokens is not None and length < config.max_new_tokens + 1:
        return config.max_new_tokens + 1
    return length
