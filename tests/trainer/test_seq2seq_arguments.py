"""PipeSeq2SeqTrainingArguments: `Seq2SeqTrainingArguments`' fields and defaults, read by the
`HfArgumentParser` of run_summarization.py / run_translation.py, beam search included."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments

from hf_ftpipe import PipeSeq2SeqTrainingArguments, PipeTrainingArguments

SEQ2SEQ_FIELDS = {f.name for f in fields(Seq2SeqTrainingArguments)} - {f.name for f in fields(TrainingArguments)}


@dataclass
class ModelArguments:
    """The field names of run_summarization.py's ModelArguments (types and defaults as there)."""

    model_name_or_path: str
    config_name: str | None = None
    tokenizer_name: str | None = None
    cache_dir: str | None = None
    use_fast_tokenizer: bool = True
    model_revision: str = "main"
    token: str | None = None
    trust_remote_code: bool = False
    resize_position_embeddings: bool | None = None


@dataclass
class DataTrainingArguments:
    """The field names of run_summarization.py's DataTrainingArguments (run_translation.py's add
    source_lang/target_lang)."""

    lang: str | None = None
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    text_column: str | None = None
    summary_column: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    test_file: str | None = None
    overwrite_cache: bool = False
    preprocessing_num_workers: int | None = None
    max_source_length: int | None = 1024
    max_target_length: int | None = 128
    val_max_target_length: int | None = None
    pad_to_max_length: bool = False
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    max_predict_samples: int | None = None
    num_beams: int | None = 1
    ignore_pad_token_for_loss: bool = True
    source_prefix: str | None = None
    forced_bos_token: str | None = None
    source_lang: str | None = field(default=None)
    target_lang: str | None = field(default=None)


def test_is_both_a_pipe_and_a_seq2seq_argument_class_with_each_field_once() -> None:
    assert issubclass(PipeSeq2SeqTrainingArguments, PipeTrainingArguments)
    assert issubclass(PipeSeq2SeqTrainingArguments, Seq2SeqTrainingArguments)
    names = [f.name for f in fields(PipeSeq2SeqTrainingArguments)]
    assert len(names) == len(set(names))
    assert SEQ2SEQ_FIELDS == {
        "sortish_sampler",
        "predict_with_generate",
        "generation_max_length",
        "generation_num_beams",
        "generation_config",
    }
    assert SEQ2SEQ_FIELDS | {"pipeline_schedule", "num_microbatches"} <= set(names)


def test_defaults_equal_seq2seq_training_arguments(tmp_path) -> None:
    ours = PipeSeq2SeqTrainingArguments(output_dir=str(tmp_path))
    theirs = Seq2SeqTrainingArguments(output_dir=str(tmp_path))
    for name in sorted(SEQ2SEQ_FIELDS):
        assert getattr(ours, name) == getattr(theirs, name), name
    helps = {f.name: f.metadata.get("help") for f in fields(PipeSeq2SeqTrainingArguments)}
    for f in fields(Seq2SeqTrainingArguments):
        if f.name in ("sortish_sampler", "generation_num_beams", "generation_config"):
            assert helps[f.name] == f.metadata["help"], f.name
    assert "generation_config" in ours.to_dict()


def test_hf_argument_parser_reads_run_summarization_flags(tmp_path) -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, PipeSeq2SeqTrainingArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(
        [
            "--model_name_or_path", "t5-tiny",
            "--train_file", "train.json",
            "--output_dir", str(tmp_path),
            "--do_train", "--do_eval",
            "--predict_with_generate",
            "--generation_max_length", "32",
            "--generation_num_beams", "4",
            "--sortish_sampler",
            "--num_beams", "1",
            "--pipeline_schedule", "1f1b",
            "--num_microbatches", "2",
            "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4",
            "--generation_config", str(tmp_path / "generation_config.json"),
        ]
    )  # fmt: skip
    assert model_args.model_name_or_path == "t5-tiny" and data_args.num_beams == 1
    assert isinstance(args, PipeSeq2SeqTrainingArguments)
    assert (args.predict_with_generate, args.generation_max_length, args.generation_num_beams) == (True, 32, 4)
    assert args.sortish_sampler and args.pipeline_schedule == "1f1b" and args.num_microbatches == 2
    assert str(args.generation_config) == str(tmp_path / "generation_config.json")
