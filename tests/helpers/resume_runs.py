"""One PipeTrainer run of a tiny GPT-2 that saves checkpoints every 3 steps or resumes from one.

Run by tests/trainer/resume_job.py (the runs of test_checkpoint.py), tests/faults/crash_save_job.py and
tests/faults/errors_resume_job.py. A run is ``{"output_dir", "partitioner", "schedule", "dropout", "resume",
"empty_weights", "model_seed", "expect_error", "best", "save_total_limit", "timeout_s"}``. Each writes ``result.json``
(rank 0: the logged loss of every step) and ``rank{r}.pt`` (each rank's stage weights after training)
into its ``output_dir``; a run that expects an error writes its `CheckpointError` message to
``error.txt`` instead (every rank fails the same way, so the processes can go on).
"""

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from datasets import Dataset
from transformers import TrainerCallback

from hf_ftpipe import CheckpointError, PipeTrainer, PipeTrainingArguments

from models import tiny_batch, tiny_model

# 18 samples, mini-batches of 4 (the last 2 dropped): 4 steps an epoch, so a checkpoint at step 3
# resumes mid-epoch (Trainer skips 3 batches) and steps 5-6 run in a reshuffled second epoch.
SAMPLES = 18


def run(spec: dict, trainer_class: type[PipeTrainer] = PipeTrainer, callbacks: list[TrainerCallback] = ()) -> None:
    """Train (or resume) the run ``spec`` describes, in these processes; see the module's docstring.

    ``trainer_class`` and ``callbacks``: a fault to inject, or what to record as the run goes."""
    args = PipeTrainingArguments(
        output_dir=spec["output_dir"],
        pipeline_schedule=spec.get("schedule", "gpipe"),
        partitioner=spec.get("partitioner", "params"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_microbatches=2,
        max_steps=6,
        learning_rate=1e-2,
        weight_decay=0.01,  # two param groups (biases and norms are not decayed) with different settings
        lr_scheduler_type="linear",
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=spec.get("save_total_limit"),
        pipeline_timeout_s=spec.get("timeout_s", 300.0),
        report_to="none",
        seed=0,
        max_grad_norm=1.0,
        # "best": evaluate at each checkpoint and end on the best one, here the *highest* eval
        # loss (checkpoint-3), so that loading it is told apart from keeping the final weights.
        **(
            {"eval_strategy": "steps", "eval_steps": 3, "load_best_model_at_end": True, "greater_is_better": True}
            if spec.get("best")
            else {}
        ),
    )
    data = tiny_batch("gpt2", SAMPLES, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    if spec.get("empty_weights"):  # every rank reads its stages' weights from the resumed checkpoint
        with init_empty_weights():
            model = tiny_model("gpt2", dropout=spec.get("dropout", 0.0))
    else:
        model = tiny_model("gpt2", dropout=spec.get("dropout", 0.0), seed=spec.get("model_seed", 0))
    trainer = trainer_class(
        model=model, args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=list(callbacks)
    )
    if spec.get("expect_error"):
        try:
            trainer.train(resume_from_checkpoint=spec["resume"])
        except CheckpointError as error:
            Path(spec["output_dir"]).mkdir(parents=True, exist_ok=True)
            (Path(spec["output_dir"]) / "error.txt").write_text(str(error))
            return
        raise AssertionError("resuming should have failed")
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    trainer.save_model()
    rank = trainer.engine.rank
    torch.save(trainer.engine.state_dict(), Path(spec["output_dir"]) / f"rank{rank}.pt")
    if rank == 0:
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        result = {"losses": losses, "best_model_checkpoint": trainer.state.best_model_checkpoint}
        (Path(spec["output_dir"]) / "result.json").write_text(json.dumps(result))
