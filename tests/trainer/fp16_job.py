"""A PipeTrainer job with ``fp16=True`` whose loss scale starts far too high, so that its first step
overflows. Started by `accelerate launch` from `test_fp16.py`: ``fp16_job.py OUTPUT [CHECKPOINT]``
trains STEPS steps (resuming CHECKPOINT when given) and writes, per rank,
``OUTPUT/fp16_rank{r}.json``: the loss scale, skipped steps, learning rate and a checksum of this
rank's weights after every step, and the weights at the start.
"""

import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import TrainerCallback

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.trainer.loss_scale import AgreedLossScaler

from models import tiny_batch, tiny_model

STEPS = 5
BATCH = 4
INIT_SCALE = 2.0**40  # float16 tops out at 65504: the first backward overflows
BACKOFF = 2.0**-30  # one overflow brings the scale to 2**10
GROWTH_INTERVAL = 2  # then it doubles every two steps without an overflow


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.trainer: PipeTrainer | None = None
        self.steps: list[dict] = []
        self.start_checksum: float | None = None

    def _checksum(self) -> float:
        return float(sum(p.detach().double().abs().sum() for p in self.trainer.engine.parameters()))

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_checksum = self._checksum()

    def on_step_end(self, args, state, control, **kwargs):
        scaler = self.trainer.float16.scaler
        self.steps.append(
            {
                "step": state.global_step,
                "scale": scaler.scale,
                "skipped_steps": scaler.skipped_steps,
                "learning_rate": self.trainer.lr_scheduler.get_last_lr()[0],
                "checksum": self._checksum(),
            }
        )


def main(output_dir: str, checkpoint: str = "") -> None:
    args = PipeTrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        fp16=True,
        pipeline_schedule="gpipe",
        per_device_train_batch_size=BATCH,
        num_microbatches=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        seed=0,
    )
    data = tiny_batch("gpt2", BATCH * STEPS, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    recorder = Recorder()
    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args, train_dataset=dataset, callbacks=[recorder])
    recorder.trainer = trainer
    # A checkpoint's scaler.pt replaces this when resuming.
    trainer.float16.scaler = AgreedLossScaler(
        init_scale=INIT_SCALE, backoff_factor=BACKOFF, growth_interval=GROWTH_INTERVAL
    )
    trainer.train(resume_from_checkpoint=checkpoint or None)
    trainer.save_model(str(Path(output_dir) / "final"))
    result = {
        "start_checksum": recorder.start_checksum,
        "steps": recorder.steps,
        "log_history": trainer.state.log_history,
    }
    (Path(output_dir) / f"fp16_rank{trainer.engine.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
