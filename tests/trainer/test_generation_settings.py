"""Generation settings: resolved as `Seq2SeqTrainer` resolves them (call keywords > the arguments'
generation_* > the model's generation_config), padded as it pads, and refused only where generation
through the pipeline cannot run them (each message literal)."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from hf_ftpipe import PipeSeq2SeqTrainingArguments
from hf_ftpipe.trainer.generation_settings import (
    check_pipeline_generation,
    resolved_generation_config,
    seq2seq_gen_kwargs,
    seq2seq_padded_width,
    settled_generation_config,
)

from models import tiny_model


@pytest.fixture(scope="module")
def t5():
    return tiny_model("t5")  # decoder start 0, pad 0, EOS 1; generation_config.max_length unset: 20


def arguments(tmp_path, **fields) -> PipeSeq2SeqTrainingArguments:
    return PipeSeq2SeqTrainingArguments(output_dir=str(tmp_path), **fields)


def test_call_keywords_over_arguments_over_generation_config(tmp_path, t5) -> None:
    args = arguments(tmp_path, generation_max_length=7, generation_num_beams=3)
    assert seq2seq_gen_kwargs({}, args) == {"max_length": 7, "num_beams": 3}
    assert seq2seq_gen_kwargs({"max_length": 4, "num_beams": None}, args) == {"max_length": 4, "num_beams": 3}
    # max_new_tokens given: the arguments' max_length is not added (generate would prefer max_new_tokens anyway)
    assert seq2seq_gen_kwargs({"max_new_tokens": 3}, args) == {"max_new_tokens": 3, "num_beams": 3}
    # nothing anywhere: None keywords dropped, generate falls back on the model's generation_config
    assert seq2seq_gen_kwargs({"max_length": None, "num_beams": None}, arguments(tmp_path)) == {}

    own = tiny_model("t5")
    own.generation_config = GenerationConfig(max_length=9, num_beams=2, decoder_start_token_id=0, pad_token_id=0)
    config = resolved_generation_config(own, {"num_beams": 4})
    assert (config.max_length, config.num_beams, config.top_k) == (9, 4, 50)  # keyword > model's > default
    given = GenerationConfig(max_length=5)
    config = resolved_generation_config(own, {"generation_config": given, "do_sample": True})
    assert (config.max_length, config.num_beams, config.do_sample) == (5, 2, True)


def test_padded_as_seq2seq_trainer_pads_to_the_models_max_length() -> None:
    model = tiny_model("t5")
    config = settled_generation_config(
        model
    )  # unset max_length: transformers' default, written in as Seq2SeqTrainer does
    assert config is model.generation_config and config.max_length == 20 and not config._from_model_config
    assert [seq2seq_padded_width(config, n) for n in (3, 5, 20, 23)] == [20, 20, 20, 23]
    own = GenerationConfig(max_length=4, max_new_tokens=6)
    assert [seq2seq_padded_width(own, n) for n in (2, 4, 5, 7, 9)] == [4, 7, 7, 7, 9]


def test_beams_sampling_and_logits_processors_are_accepted(t5) -> None:
    check_pipeline_generation(t5, {"num_beams": 4, "length_penalty": 0.5, "early_stopping": True})
    check_pipeline_generation(t5, {"do_sample": True, "top_k": 5, "top_p": 0.9, "temperature": 0.7})
    check_pipeline_generation(
        t5, {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2, "num_beams": 2, "num_return_sequences": 2}
    )
    check_pipeline_generation(t5, {"output_scores": True, "return_dict_in_generate": True, "synced_gpus": False})


ASSISTED = (
    "assisted generation verifies draft tokens and rolls the key/value cache back past the rejected ones, and the "
    "pipeline's caches cannot be rolled back; drop it"
)
FROM_THE_HUB = "transformers runs this mode from code it loads from the Hub (`custom_generate`)"


@pytest.mark.parametrize(
    ("gen_kwargs", "message"),
    [
        ({"prompt_lookup_num_tokens": 3}, f"`prompt_lookup_num_tokens=3` (assisted generation): {ASSISTED}"),
        ({"assistant_model": "draft"}, f"`assistant_model='draft'` (assisted generation): {ASSISTED}"),
        ({"penalty_alpha": 0.6, "top_k": 4}, f"`penalty_alpha=0.6` (contrastive search): {FROM_THE_HUB}"),
        ({"dola_layers": "low"}, f"`dola_layers='low'` (DoLa decoding): {FROM_THE_HUB}"),
        ({"num_beams": 4, "num_beam_groups": 2}, f"`num_beam_groups=2` (group beam search): {FROM_THE_HUB}"),
        ({"force_words_ids": [[5]]}, f"`constraints` / `force_words_ids` (constrained beam search): {FROM_THE_HUB}"),
        ({"custom_generate": "some/repo"}, "`custom_generate`: a decoding loop of its own calls the model"),
        ({"output_hidden_states": True}, "`output_hidden_states=True`: the pipeline returns the model's logits only"),
    ],
)
def test_what_the_pipeline_cannot_run_is_refused_with_the_reason(t5, gen_kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        check_pipeline_generation(t5, gen_kwargs)
    assert str(raised.value).startswith("generation through the pipeline cannot run these settings")
    assert message in str(raised.value)


def test_settings_from_the_models_generation_config_are_refused_too() -> None:
    model = tiny_model("t5")
    model.generation_config = GenerationConfig(prompt_lookup_num_tokens=2, decoder_start_token_id=0, pad_token_id=0)
    with pytest.raises(ValueError, match=r"`prompt_lookup_num_tokens=2` \(assisted generation\)"):
        check_pipeline_generation(model, {})
