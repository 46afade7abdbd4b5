"""PipeSeq2SeqTrainer's generation settings: resolved as `Seq2SeqTrainer` resolves them
(call keywords > the arguments' generation_* > the model's generation_config), greedy only."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from hf_ftpipe import PipeSeq2SeqTrainingArguments
from hf_ftpipe.trainer.generation_settings import greedy_settings, seq2seq_gen_kwargs

from models import tiny_model


@pytest.fixture(scope="module")
def t5():
    return tiny_model("t5")  # decoder start 0, pad 0, EOS 1; generation_config.max_length unset: 20


def arguments(tmp_path, **fields) -> PipeSeq2SeqTrainingArguments:
    return PipeSeq2SeqTrainingArguments(output_dir=str(tmp_path), **fields)


def test_call_keywords_over_arguments_over_generation_config(tmp_path, t5) -> None:
    args = arguments(tmp_path, generation_max_length=7, generation_num_beams=1)
    assert seq2seq_gen_kwargs({}, args) == {"max_length": 7, "num_beams": 1}
    assert seq2seq_gen_kwargs({"max_length": 4, "num_beams": None}, args) == {"max_length": 4, "num_beams": 1}
    # max_new_tokens given: the arguments' max_length is not added (generate would prefer max_new_tokens anyway)
    assert seq2seq_gen_kwargs({"max_new_tokens": 3}, args) == {"max_new_tokens": 3, "num_beams": 1}
    # nothing anywhere: None keywords dropped, generate falls back on the model's generation_config
    assert seq2seq_gen_kwargs({"max_length": None, "num_beams": None}, arguments(tmp_path)) == {}

    assert greedy_settings({"max_length": 7}, t5).max_new_tokens == 6  # max_length counts the decoder start
    assert greedy_settings({"max_new_tokens": 3, "max_length": 7}, t5).max_new_tokens == 3
    settings = greedy_settings({}, t5)
    assert (settings.max_new_tokens, settings.decoder_start_token_id, settings.pad_token_id) == (19, 0, 0)
    assert settings.eos_token_id == 1

    own = tiny_model("t5")
    own.generation_config = GenerationConfig(max_length=9, eos_token_id=5, decoder_start_token_id=0, pad_token_id=0)
    assert greedy_settings({}, own).max_new_tokens == 8 and greedy_settings({}, own).eos_token_id == 5
    assert greedy_settings({"max_length": 4}, own).max_new_tokens == 3


def test_padded_as_seq2seq_trainer_pads_to_the_models_max_length(t5) -> None:
    settings = greedy_settings({"max_length": 5}, t5)  # asked 5, but Seq2SeqTrainer pads to the config's 20
    assert [settings.padded_width(n) for n in (3, 5, 20, 23)] == [20, 20, 20, 23]
    own = tiny_model("t5")
    own.generation_config = GenerationConfig(max_length=4, max_new_tokens=6, decoder_start_token_id=0, pad_token_id=0)
    settings = greedy_settings({}, own)
    assert settings.max_new_tokens == 6
    assert [settings.padded_width(n) for n in (2, 4, 5, 7, 9)] == [4, 7, 7, 7, 9]


@pytest.mark.parametrize(
    ("gen_kwargs", "message"),
    [
        ({"num_beams": 4}, r"`num_beams=4`: generation through the pipeline is greedy only.*use num_beams=1"),
        ({"do_sample": True, "top_k": 5}, r"`do_sample=True`.*use do_sample=False with num_beams=1"),
        ({"no_repeat_ngram_size": 3}, r"`no_repeat_ngram_size=3` \(greedy decoding through the pipeline does not"),
        ({"forced_bos_token_id": 7}, r"`forced_bos_token_id=7`"),
        ({"not_a_setting": 1}, r"`not_a_setting=1` is not a generation setting"),
        ({"max_length": 1}, r"max_length=1 leaves no room for a generated token"),
    ],
)
def test_what_greedy_decoding_cannot_honour_is_refused(t5, gen_kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        greedy_settings(gen_kwargs, t5)


def test_beams_from_the_models_generation_config_are_refused_too() -> None:
    model = tiny_model("t5")
    model.generation_config = GenerationConfig(num_beams=3, decoder_start_token_id=0, pad_token_id=0)
    with pytest.raises(ValueError, match=r"`num_beams=3`.*greedy only"):
        greedy_settings({}, model)
    assert greedy_settings({"num_beams": 1, "synced_gpus": False}, model).max_new_tokens == 19
