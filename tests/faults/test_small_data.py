"""A training set smaller than one mini-batch under a streaming schedule (async, 2bw: whole
mini-batches only): a clear error before anything is built, naming the sample count and a batch
size that works. gpipe and 1f1b train it, as `Trainer` does (tests/trainer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Dataset

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.errors import PipelineError

from models import tiny_batch, tiny_model


def train_on(rows: int, tmp_path: Path, batch_size: int = 8, num_microbatches: int = 4) -> None:
    data = tiny_batch("gpt2", rows)
    args = PipeTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=batch_size,
        num_microbatches=num_microbatches,
        pipeline_schedule="async",
        max_steps=1,
        report_to="none",
    )
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    PipeTrainer(model=tiny_model("gpt2"), args=args, train_dataset=dataset).train()


def test_fewer_samples_than_a_mini_batch_names_the_count_and_a_batch_size_that_works(tmp_path: Path) -> None:
    with pytest.raises(PipelineError) as caught:
        train_on(6, tmp_path)
    message = str(caught.value)
    assert message.startswith(
        "the training set has 6 samples, fewer than one mini-batch of per_device_train_batch_size=8"
    )
    assert "pipeline_schedule='async' trains on whole mini-batches only" in message
    assert "Use per_device_train_batch_size=4 (a multiple of num_microbatches=4), or more data" in message


def test_fewer_samples_than_micro_batches_suggests_fewer_micro_batches(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="Use per_device_train_batch_size=3 with num_microbatches=3, or more data"):
        train_on(3, tmp_path)
