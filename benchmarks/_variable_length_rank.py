"""One runner of ``benchmarks/variable_length.py`` on one rank: fine-tune through PipeTrainer, time the epoch.

Started by torchrun (2 processes, one torch thread each), never by hand::

    torchrun --standalone --nproc_per_node 2 benchmarks/_variable_length_rank.py FOLDER RUNNER RESULT

``FOLDER`` holds what `variable_length.py` prepared once for every runner (``config.json``, the
sentences, the tokenizer); rank 0 writes every rank's figures to ``RESULT`` (JSON). Runners:

- ``max_length``: rows padded to ``max_length`` when tokenized, `default_data_collator` (what
  ``run_glue.py --pad_to_max_length`` does);
- ``dynamic``: rows truncated only, `DataCollatorWithPadding` pads each batch to its longest row;
- ``dynamic_group_by_length``: the same, with ``train_sampling_strategy="group_by_length"``
  (`LengthGroupedSampler`: batches of similar lengths).

Before the timed epoch, two steps of the data's longest rows padded to the planned length run on
the engine (untimed, their gradients dropped), so every runner starts warm at its largest shape.
After training, the ``dynamic`` runner measures the first step of a batch length the run has not
seen against a step of a known one.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from datasets import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    TrainerCallback,
    default_data_collator,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_ftpipe

from hf_ftpipe import PipeTrainer, PipeTrainingArguments  # noqa: E402
from hf_ftpipe.runtime.shapes import ShapeBook  # noqa: E402

WARMUP_STEPS = 2
PROBE_TARGETS = (8, 16, 24, 36, 52, 72, 96, 120)
"""Lengths near which the new-length probe looks for lengths the run has not seen."""


def cpu_s() -> float:
    """CPU seconds this process (every thread) has used: unlike wall time, not stretched by other load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def maxrss_mb() -> float:
    """This process's peak resident set size so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RecordingPipeTrainer(PipeTrainer):
    """PipeTrainer that records each training step's batch shape, real tokens and pipeline time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, Any]] = []
        self.shapes_seen = 0
        """Micro-batch shapes the engine's ShapeBook held after the last recorded step."""

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        rows, length = inputs["input_ids"].shape
        self.steps.append(
            {
                "rows": rows,
                "length": length,
                "real_tokens": int(inputs["attention_mask"].sum()),
                "time_s": time.perf_counter() - started,
                "new_shape": self.engine.shape_book.cached > self.shapes_seen,
            }
        )
        self.shapes_seen = self.engine.shape_book.cached
        return loss


class EpochClock(TrainerCallback):
    """Warms the engine up when training begins (the longest rows, padded to the planned length);
    times each epoch (wall and this process's CPU time); notes peak RSS and when each phase ended."""

    def __init__(
        self, trainer: RecordingPipeTrainer, tokenizer: PreTrainedTokenizerFast, longest: list[dict[str, Any]]
    ) -> None:
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.longest = longest
        self.epochs_s: list[float] = []
        self.epochs_cpu_s: list[float] = []
        self.rss_at_start_mb = 0.0
        self.phases: dict[str, float] = {}
        """Wall-clock time (``time.time()``) at the end of each phase of the launch."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases["traced_and_planned"] = time.time()
        engine = self.trainer.engine
        batch = padded_batch(self.tokenizer, self.longest, engine.graph.inputs["input_ids"].shape[1])
        for _ in range(WARMUP_STEPS):
            engine.train_step(batch)
            engine.module.zero_grad(set_to_none=True)
        self.trainer.shapes_seen = engine.shape_book.cached
        self.rss_at_start_mb = maxrss_mb()
        self.phases["warmed_up"] = time.time()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dist.barrier()
        self._started = time.perf_counter()
        self._started_cpu = cpu_s()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.epochs_s.append(time.perf_counter() - self._started)
        self.epochs_cpu_s.append(cpu_s() - self._started_cpu)
        self.phases["trained"] = time.time()


def build_model(config: dict[str, Any], vocab_size: int) -> BertForSequenceClassification:
    torch.manual_seed(config["seed"])
    bert = BertConfig(
        vocab_size=vocab_size,
        hidden_size=config["hidden"],
        num_hidden_layers=config["layers"],
        num_attention_heads=config["heads"],
        intermediate_size=4 * config["hidden"],
        max_position_embeddings=config["max_length"],
        num_labels=2,
    )
    return BertForSequenceClassification(bert)


def tokenized(tokenizer: PreTrainedTokenizerFast, texts: list[str], labels: list[int], pad: bool, max_length: int):
    """The rows as run_glue.py makes them: truncated, padded to ``max_length`` only when ``pad``."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length, padding="max_length" if pad else False)
    return Dataset.from_dict({**encoded, "label": labels})


def padded_batch(tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, Any]], length: int) -> dict[str, Any]:
    """``rows`` collated as `DataCollatorWithPadding` collates them, padded to ``length``."""
    return dict(DataCollatorWithPadding(tokenizer, padding="max_length", max_length=length)(rows))


def probe_new_lengths(
    trainer: RecordingPipeTrainer, dataset: Dataset, tokenizer: PreTrainedTokenizerFast, seen: set[int]
) -> list[dict[str, Any]]:
    """For lengths the run has not seen: the engine's train_step on a batch of that length
    (the first), then twice more on the same batch (known). The batch: the first rows of the
    data, cut or padded to the length.

    Also the cost of the shape formulas alone: `ShapeBook.of` on a fresh book (the evaluation a new
    length needs) and again (the cached look-up)."""
    engine = trainer.engine
    batch_size = trainer.args.per_device_train_batch_size
    seen = set(seen)
    lengths: list[int] = []
    for target in PROBE_TARGETS:
        candidates = [n for n in range(8, engine.graph.inputs["input_ids"].shape[1] + 1) if n not in seen]
        if not candidates:
            break
        chosen = min(candidates, key=lambda n: (abs(n - target), n))
        seen.add(chosen)
        lengths.append(chosen)
    results = []
    for length in lengths:
        rows = [
            {name: value[:length] if isinstance(value, list) else value for name, value in dataset[i].items()}
            for i in range(batch_size)
        ]
        batch = padded_batch(tokenizer, rows, length)
        book = ShapeBook(engine.formulas, engine.graph, engine.shape_book.values, engine.shape_book.sizes)
        microbatch = {name: value[: batch_size // engine.num_microbatches] for name, value in batch.items()}
        started = time.perf_counter()
        book.of(microbatch)
        formulas_new_s = time.perf_counter() - started
        started = time.perf_counter()
        book.of(microbatch)
        formulas_cached_s = time.perf_counter() - started
        times, cpu_times = [], []
        cached_before = engine.shape_book.cached
        for _ in range(3):
            dist.barrier()
            started, started_cpu = time.perf_counter(), cpu_s()
            engine.train_step(batch)
            times.append(time.perf_counter() - started)
            cpu_times.append(cpu_s() - started_cpu)
            engine.module.zero_grad(set_to_none=True)
        results.append(
            {
                "length": length,
                "rows": len(rows),
                "new_shapes": engine.shape_book.cached - cached_before,
                "first_s": times[0],
                "known_s": times[1:],
                "cpu_s": cpu_times,
                "formulas_new_s": formulas_new_s,
                "formulas_cached_s": formulas_cached_s,
            }
        )
    return results


def main() -> None:
    folder, runner, result_path = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    phases = {"imported": time.time()}
    config = json.loads((folder / "config.json").read_text())
    torch.set_num_threads(config["threads_per_rank"])
    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_ftpipe").setLevel(logging.WARNING)
    data = json.loads((folder / "sentences.json").read_text())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    max_length, batch_size = config["max_length"], config["batch_size"]
    dataset = tokenized(tokenizer, data["texts"], data["labels"], runner == "max_length", max_length)
    collator = default_data_collator if runner == "max_length" else DataCollatorWithPadding(tokenizer)
    args = PipeTrainingArguments(
        output_dir=str(folder / f"output-{runner}"),
        use_cpu=True,
        per_device_train_batch_size=batch_size,
        num_microbatches=config["num_microbatches"],
        plan_max_length=max_length,  # one plan for every runner (by default a run plans for its data's longest row)
        pipeline_schedule=config["schedule"],
        partitioner=config["partitioner"],
        num_train_epochs=1,
        learning_rate=5e-5,
        train_sampling_strategy="group_by_length" if runner == "dynamic_group_by_length" else "random",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=config["seed"],
        dataloader_drop_last=False,
    )
    trainer = RecordingPipeTrainer(
        model=build_model(config, len(tokenizer)),
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
    )
    phases["trainer_built"] = time.time()
    longest = sorted(range(len(dataset)), key=lambda i: -len(dataset[i]["input_ids"]))[:batch_size]
    clock = EpochClock(trainer, tokenizer, [dataset[i] for i in longest])
    trainer.add_callback(clock)
    trainer.train()
    rank_result: dict[str, Any] = {
        "rank": dist.get_rank(),
        "epoch_s": clock.epochs_s,
        "epoch_cpu_s": clock.epochs_cpu_s,
        "rss_at_start_mb": clock.rss_at_start_mb,
        "peak_memory_mb": maxrss_mb(),
        "steps": trainer.steps,
        "shapes_cached": trainer.engine.shape_book.cached,
        "planned": {n: list(i.shape) for n, i in trainer.engine.graph.inputs.items() if i.shape is not None},
        "stages": trainer.partition.stages_on(dist.get_rank()),
        "samples": len(dataset),
    }
    if runner == "dynamic" and config["probe"]:
        seen = {step["length"] for step in trainer.steps} | {trainer.engine.graph.inputs["input_ids"].shape[1]}
        rank_result["probe"] = probe_new_lengths(trainer, dataset, tokenizer, seen)
        clock.phases["probed"] = time.time()
    rank_result["phases"] = {**phases, **clock.phases}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rank_result)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps(everyone))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
