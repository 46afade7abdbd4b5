"""PipeSeq2SeqTrainer's surface, on one process (nothing runs through a pipeline): Seq2SeqTrainer's
constructor and evaluate/predict keywords, and greedy-only refusals before any batch runs.
Its generated tokens against Seq2SeqTrainer's: the ``t5`` case of test_any_batch.py."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import GenerationConfig

from hf_ftpipe import PipeSeq2SeqTrainer, PipeSeq2SeqTrainingArguments

from models import tiny_model


def trainer(tmp_path, **fields) -> PipeSeq2SeqTrainer:
    args = PipeSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", predict_with_generate=True, **fields
    )
    return PipeSeq2SeqTrainer(model=tiny_model("t5"), args=args)


def test_generation_config_of_the_arguments_replaces_the_models(tmp_path) -> None:
    config = GenerationConfig(max_length=7, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    made = trainer(tmp_path, generation_config=config)
    assert made.model.generation_config.max_length == 7 and made.model.generation_config is not config


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("evaluate", r"`num_beams=3`: generation through the pipeline is greedy only.*use num_beams=1"),
        ("predict", r"`do_sample=True`.*use do_sample=False with num_beams=1"),
    ],
)
def test_beams_and_sampling_are_refused_before_any_batch(tmp_path, call: str, message: str) -> None:
    made = trainer(tmp_path)
    rows = Dataset.from_dict({"input_ids": [[5, 6, 1]], "labels": [[7, 1]]})
    with pytest.raises(ValueError, match=message):
        if call == "evaluate":
            made.evaluate(rows, max_length=5, num_beams=3, metric_key_prefix="eval")
        else:
            made.predict(rows, max_length=5, do_sample=True)
    assert made.engine is None  # refused before the pipeline was built or any batch ran


def test_beams_from_the_models_generation_config_are_refused_at_evaluate(tmp_path) -> None:
    made = trainer(tmp_path, generation_config=GenerationConfig(num_beams=4, decoder_start_token_id=0, pad_token_id=0))
    with pytest.raises(ValueError, match=r"`num_beams=4`"):
        made.evaluate(Dataset.from_dict({"input_ids": [[5, 1]], "labels": [[7, 1]]}))
    made.args.generation_num_beams = 1  # the arguments' num_beams over the model's config: accepted
    made._use_gen_kwargs({})
    assert made._gen_kwargs == {"num_beams": 1}
