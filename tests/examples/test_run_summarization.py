"""examples/run_summarization_pipe.py: one real 2-process run against `Seq2SeqTrainer` on one process, and its pieces.

The run is the summarization case of the shared T5 launch (t5_examples_job.py, started by
tests/examples/conftest.py): docs/examples.md's command, shortened to 4 steps, with Trainer's
gradient accumulation and label smoothing, greedy generation of at most 12 tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from datasets import load_dataset
from transformers import AutoTokenizer, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_ftpipe.metrics import load_metric, split_sentences

from example_modules import DATA, load_example, regenerate_fixtures
from trainer_comparison import assert_metrics_close, assert_steps_close


@pytest.fixture(scope="module")
def summarization() -> ModuleType:
    return load_example("run_summarization_pipe")


@pytest.fixture(scope="module")
def run(t5_examples_run: Path) -> Path:
    return t5_examples_run / "summarization"


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reference(run: Path, summarization: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Seq2SeqTrainer:
    """Plain `Seq2SeqTrainer` on one process, as run_summarization.py builds it, from the same tiny T5
    (same seed), the tokenizer the run trained and the run's data and flags: trained, then evaluated."""
    tokenizer = AutoTokenizer.from_pretrained(run / "tokenizer")
    model = summarization.tiny_t5(tokenizer, seed=42)
    # the splits as the run read them: the first 64 training rows, 8 validation and 8 test rows (the
    # lengths span them all)
    files = {split: str(DATA / f"news_{split}.jsonl") for split in ("train", "validation", "test")}
    raw = load_dataset("json", data_files=files)
    for split, size in (("train", 64), ("validation", 8), ("test", 8)):
        raw[split] = raw[split].select(range(size))
    data_args = summarization.DataTrainingArguments()
    source, target = summarization.lengths(data_args, tokenizer, raw, "document", "summary", tiny=True)

    def features(split: str):
        def tokenize(batch):
            return summarization.tokenize_pairs(
                batch, tokenizer, "document", "summary", "", source, target, False, ignore_pad_token_for_loss=True
            )

        return raw[split].map(tokenize, batched=True, remove_columns=["document", "summary"])

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("seq2seq_reference")),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=42,
        learning_rate=3e-3,
        warmup_steps=8,
        max_steps=4,
        logging_steps=1,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        label_smoothing_factor=0.1,
        per_device_eval_batch_size=8,
        predict_with_generate=True,
        generation_max_length=12,
        generation_num_beams=1,
    )
    # the launch ran offline (HF_HUB_OFFLINE=1): load_metric("rouge") was the shipped rouge_mean
    compute_metrics = summarization.rouge_metrics(tokenizer, load_metric("rouge_mean", keep_in_memory=True))
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=features("train"),
        eval_dataset=features("validation"),
        processing_class=tokenizer,
        data_collator=summarization.data_collator(data_args, args, tokenizer, model),
        compute_metrics=compute_metrics,
    )
    trainer.train()
    trainer.state.eval_metrics = trainer.evaluate()
    return trainer


def test_losses_and_rouge_equal_seq2seq_trainer_on_one_process(run, reference):
    state = _json(run / "trainer_state.json")
    assert state["global_step"] == 4 and _json(run / "train_results.json")["train_samples"] == 64
    # every step's loss (label-smoothed over 2 accumulated batches), gradient norm and learning rate
    assert_steps_close(state["log_history"], reference.state.log_history)
    evaluation = _json(run / "eval_results.json")
    expected = reference.state.eval_metrics
    # the generated summaries are the same tokens, so every ROUGE score and gen_len are equal
    assert_metrics_close(evaluation, expected, "eval")
    for key in ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum", "eval_gen_len"):
        assert evaluation[key] == expected[key], key
    assert evaluation["eval_samples"] == 8
    assert 0 < evaluation["eval_gen_len"] <= 12  # --generation_max_length, through the pipeline


def test_predictions_are_written_and_scored_as_run_summarization_does(run):
    results = _json(run / "predict_results.json")
    lines = (run / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()
    assert results["predict_samples"] == len(lines) == 8
    rows = [json.loads(line) for line in (DATA / "news_test.jsonl").read_text(encoding="utf-8").splitlines()[:8]]
    tokenizer = AutoTokenizer.from_pretrained(run)
    # the references as the metric saw them: tokenized (truncated to the summaries' length) and decoded
    references = [tokenizer.decode(tokenizer(row["summary"]).input_ids, skip_special_tokens=True) for row in rows]
    scores = load_metric("rouge_mean").compute(
        predictions=["\n".join(split_sentences(line)) for line in lines],
        references=["\n".join(split_sentences(text)) for text in references],
        use_stemmer=True,
    )
    for name, value in scores.items():
        assert results[f"predict_{name}"] == pytest.approx(round(100 * value, 4)), name
    assert math.isfinite(results["predict_loss"])
    everything = _json(run / "all_results.json")
    assert everything == {**_json(run / "train_results.json"), **_json(run / "eval_results.json"), **results}


def test_pairs_missing_a_side_are_left_out_and_padding_is_ignored(summarization):
    tokenizer = load_example("local_tokenizer").build_t5_tokenizer(["anna opened a bakery"], vocab_size=512)
    batch = {"document": ["anna opened a bakery", "", "a bakery"], "summary": ["a bakery", "anna", None]}
    features = summarization.tokenize_pairs(batch, tokenizer, "document", "summary", "summarize: ", 16, 4, True, True)
    assert len(features["input_ids"]) == len(features["labels"]) == 1
    assert tokenizer.decode(features["input_ids"][0], skip_special_tokens=True) == "summarize: anna opened a bakery"
    assert len(features["input_ids"][0]) == 16 and len(features["labels"][0]) == 4
    assert features["labels"][0][-1] == -100  # "a bakery" + EOS is 3 tokens: the 4th is padding, ignored
    assert tokenizer.decode([t for t in features["labels"][0] if t >= 0], skip_special_tokens=True) == "a bakery"


def test_columns_come_from_the_flags_the_dataset_or_the_first_two(summarization):
    names = ["text", "abstract", "id"]
    assert summarization.columns(names) == ("text", "abstract")
    assert summarization.columns(names, summary_column="id") == ("text", "id")
    assert summarization.columns(["id", "summary", "document"], "EdinburghNLP/xsum") == ("document", "summary")
    with pytest.raises(ValueError, match=r"`--text_column` 'body' is not a column of the data; its columns are"):
        summarization.columns(names, text_column="body")
    with pytest.raises(ValueError, match=r"x\.parquet: a data file must be JSON lines"):
        summarization.DataTrainingArguments(train_file="x.parquet")


def test_fixture_has_xsum_columns_and_two_sentence_summaries():
    for split, size in (("train", 256), ("validation", 16), ("test", 16)):
        rows = [json.loads(line) for line in (DATA / f"news_{split}.jsonl").read_text(encoding="utf-8").splitlines()]
        assert len(rows) == size
        for row in rows:
            assert list(row) == ["document", "summary"]
            assert row["summary"].count(". ") == 1 and row["summary"].endswith(".")  # ROUGE-Lsum has 2 sentences


def test_make_news_regenerates_the_shipped_files(tmp_path):
    regenerate_fixtures("make_news.py", tmp_path)
    for split in ("train", "validation", "test"):
        name = f"news_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: rerun make_news.py"
