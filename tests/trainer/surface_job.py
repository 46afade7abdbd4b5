"""A PipeTrainer job that records what a `Trainer` user sees on each rank: callbacks, the progress
bar, tensorboard logs, throughput, FLOP and token counts; and trainers made with ``model_init``
(`model_init_runs`): two ``train()`` calls, a ``hyperparameter_search``, one with a trial it cannot
run; and ``auto_find_batch_size`` (`auto_batch_runs`). Started by `accelerate launch` from
`test_trainer_surface.py`; each rank writes ``OUTPUT/surface_rank{r}.json``.
"""

import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from hf_ftpipe import PipeTrainer, PipeTrainingArguments

import auto_batch_runs
from model_init_runs import masked_lm_twice, search, train_twice
from models import tiny_batch, tiny_model

STEPS = 4
BATCH = 4


class Recorder(TrainerCallback):
    """Counts the callback events this rank receives and whether its progress bar is open."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.progress_bar_open: list[bool] = []
        self.trainer: PipeTrainer | None = None

    def _count(self, name: str) -> None:
        self.events[name] = self.events.get(name, 0) + 1

    def on_train_begin(self, args, state, control, **kwargs):
        self._count("on_train_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self._count("on_step_end")
        bars = [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback)]
        self.progress_bar_open.append(any(cb.training_bar is not None for cb in bars))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._count("on_log")

    def on_evaluate(self, args, state, control, **kwargs):
        self._count("on_evaluate")

    def on_train_end(self, args, state, control, **kwargs):
        self._count("on_train_end")


def main(output_dir: str, partition_file: str = "") -> None:
    args = PipeTrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_microbatches=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        report_to="tensorboard",
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=False,
        seed=0,
        partition_file=partition_file or None,
    )
    data = tiny_batch("gpt2", BATCH * STEPS, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    # Columns the model does not take: Trainer drops them by the model's forward signature, which
    # PipeTrainer still has although no rank holds the whole model.
    dataset = dataset.add_column("idx", list(range(len(dataset))))
    dataset = dataset.add_column("text", ["unused"] * len(dataset))
    recorder = Recorder()
    trainer = PipeTrainer(
        model=tiny_model("gpt2"), args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=[recorder]
    )
    recorder.trainer = trainer
    output = trainer.train()
    rank = trainer.engine.rank
    result = {
        "rank": rank,
        "events": recorder.events,
        "progress_bar_open": recorder.progress_bar_open,
        "metrics": output.metrics,
        "total_flos": trainer.state.total_flos,
        "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
        "log_history": trainer.state.log_history,
    }
    result["model_init"] = train_twice(str(Path(output_dir) / "model_init"), pipe=True)
    result["model_init_masked_lm"] = masked_lm_twice(str(Path(output_dir) / "model_init_masked_lm"), pipe=True)
    result["search"] = search(str(Path(output_dir) / "search"), pipe=True, settings=[0, 1])
    result["search_refused"] = search(str(Path(output_dir) / "search_refused"), pipe=True, settings=[2])
    profile = auto_batch_runs.fitting_profile(str(Path(output_dir) / f"fitting_profile{rank}.json"))
    result["auto_batch"] = auto_batch_runs.train(str(Path(output_dir) / "auto_batch"), True, profile)
    (Path(output_dir) / f"surface_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
