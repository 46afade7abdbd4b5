"""Small PipeTrainer jobs on a tiny GPT-2, started by `accelerate launch` from the tests.

``pipe_job.py RUNS_JSON`` trains each run of the JSON list in turn, in the same processes (one
launch instead of one per run: a launch's imports and first trace cost more than a run). A run is
``{"output_dir": ..., "weights_path": ..., "schedule": ...}`` (the last two optional). Each run
plans with a plan cache of its own, ``OUTPUT/hf_home``, as a launch of its own would: no run reuses
the plan of the one before. Each rank writes the weights of its own stages to ``OUTPUT/rank{r}.pt``
so the test can check that the saved checkpoint holds exactly what the pipeline trained.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import init_empty_weights
from datasets import Dataset

from hf_ftpipe import PipeTrainer, PipeTrainingArguments

from models import tiny_batch, tiny_model


def main(output_dir: str, weights_path: str | None = None, schedule: str = "gpipe") -> None:
    os.environ["HF_HOME"] = str(Path(output_dir) / "hf_home")
    args = PipeTrainingArguments(
        pipeline_schedule=schedule,
        weights_path=weights_path,
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_microbatches=2,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        max_grad_norm=1.0,
    )
    data = tiny_batch("gpt2", 26, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    if weights_path is None:
        model = tiny_model("gpt2")
    else:  # every rank reads only its own stages' weights from the checkpoint
        with init_empty_weights():
            model = tiny_model("gpt2")
    trainer = PipeTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    rank = trainer.engine.rank
    torch.save(trainer.engine.state_dict(), Path(output_dir) / f"rank{rank}.pt")
    if rank == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (Path(output_dir) / "result.json").write_text(json.dumps({"losses": losses, "metrics": metrics}))


if __name__ == "__main__":
    for run in json.loads(sys.argv[1]):
        main(**run)
