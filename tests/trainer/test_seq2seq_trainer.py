"""PipeSeq2SeqTrainer's surface, on one process (nothing runs through a pipeline): Seq2SeqTrainer's
constructor and evaluate/predict keywords, and settings the pipeline cannot run refused before any
batch runs. Its generated tokens (greedy at evaluate, beams at predict) against Seq2SeqTrainer's: the
``t5`` case of test_any_batch.py."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import GenerationConfig

from hf_ftpipe import PipeSeq2SeqTrainer, PipeSeq2SeqTrainingArguments
from hf_ftpipe.errors import PipelineError

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
        ("evaluate", r"`prompt_lookup_num_tokens=3` \(assisted generation\)"),
        ("predict", r"`penalty_alpha=0.5` \(contrastive search\)"),
    ],
)
def test_what_the_pipeline_cannot_run_is_refused_before_any_batch(tmp_path, call: str, message: str) -> None:
    made = trainer(tmp_path)
    rows = Dataset.from_dict({"input_ids": [[5, 6, 1]], "labels": [[7, 1]]})
    with pytest.raises(ValueError, match=message):
        if call == "evaluate":
            made.evaluate(rows, max_length=5, prompt_lookup_num_tokens=3, metric_key_prefix="eval")
        else:
            made.predict(rows, max_length=5, penalty_alpha=0.5, top_k=4)
    assert made.engine is None  # refused before the pipeline was built or any batch ran


def test_beams_from_the_arguments_and_the_generation_config_are_kept(tmp_path) -> None:
    made = trainer(tmp_path, generation_num_beams=3)
    made._use_gen_kwargs({"max_length": 6})
    assert made._gen_kwargs == {"max_length": 6, "num_beams": 3}
    made = trainer(tmp_path, generation_config=GenerationConfig(num_beams=4, decoder_start_token_id=0, pad_token_id=0))
    made._use_gen_kwargs({"do_sample": True})
    assert made._gen_kwargs == {"do_sample": True} and made.model.generation_config.num_beams == 4


def test_generate_without_a_pipeline_or_data_to_build_one_says_what_to_pass(tmp_path) -> None:
    made = trainer(tmp_path)
    prompt = {"input_ids": torch.tensor([[5, 6, 1]])}
    with pytest.raises(ValueError, match=r"`num_beam_groups=2` \(group beam search\)"):
        made.generate(**prompt, num_beams=4, num_beam_groups=2)  # refused before anything is built
    with pytest.raises(PipelineError, match="the trainer has no `train_dataset` or `eval_dataset`: pass one"):
        made.generate(**prompt, num_beams=2)
    assert made.engine is None
