"""What transformers' ``run_glue.py`` does, with `PipeTrainer` swapped in, recording which rank writes.

Started by `torchrun` from `test_launch.py` without ``use_cpu`` on a machine without a GPU. The
arguments log at info as ``--log_level info`` asks (rank 0; the others at ``log_level_replica``),
set up as the official scripts do. The model is a tiny GPT-2 cut into ``token_slices="auto"``, so
the same run shows the slice lengths the dynamic program chose. Every write into ``OUTPUT`` is
recorded on the rank that made it: Python's ``open`` through an audit hook, `torch.save` and
safetensors' ``save_file`` (which write from C++ and Rust) through thin wrappers around the real
functions. Each rank writes what it saw to ``RECORDS/rank{r}.json``.

    torchrun --standalone --nproc_per_node 2 tests/trainer/writers_job.py OUTPUT RECORDS
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
import transformers
from datasets import Dataset

from hf_ftpipe import PipeTrainer, PipeTrainingArguments

from models import tiny_batch, tiny_model

BATCH = 4


def record_writes(folder: Path) -> list[str]:
    """The paths under ``folder`` this process writes from now on, one entry per write."""
    written: list[str] = []
    root = str(folder.resolve())

    def note(path: object) -> None:
        path = os.path.realpath(os.fspath(path)) if isinstance(path, str | os.PathLike) else ""
        if path.startswith(root + os.sep):
            written.append(os.path.relpath(path, root))

    def on_event(event: str, args: tuple) -> None:
        if event == "open" and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            note(args[0])

    sys.addaudithook(on_event)
    save, save_file = torch.save, safetensors.torch.save_file

    def recorded_save(obj, f, *args, **kwargs):
        note(f)
        return save(obj, f, *args, **kwargs)

    def recorded_save_file(tensors, filename, *args, **kwargs):
        note(filename)
        return save_file(tensors, filename, *args, **kwargs)

    torch.save = recorded_save
    transformers.modeling_utils.safe_save_file = recorded_save_file
    return written


def main(output_dir: str, records_dir: str) -> None:
    output, records = Path(output_dir), Path(records_dir)
    written = record_writes(output)
    args = PipeTrainingArguments(  # no use_cpu
        output_dir=output_dir,
        do_train=True,
        do_eval=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_microbatches=2,
        max_steps=2,
        save_strategy="no",
        report_to="none",
        log_level="info",
        seed=0,
        token_slices="auto",
    )
    # run_glue.py's logging set-up
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    transformers.utils.logging.set_verbosity(args.get_process_log_level())
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    rank = int(os.environ["RANK"])
    marker = records / "main_process_went_first"
    with args.main_process_first(desc="dataset map pre-processing"):
        saw_marker = marker.exists()  # true on rank 1 only if rank 0 left this block before it entered
        if args.process_index == 0:
            time.sleep(0.5)
            marker.touch()
        dataset = Dataset.from_dict({k: v.tolist() for k, v in tiny_batch("gpt2", 2 * BATCH, seed=1).items()})

    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args, train_dataset=dataset, eval_dataset=dataset)
    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(dataset)
    trainer.save_model()
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    metrics = trainer.evaluate()
    metrics["eval_samples"] = len(dataset)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    seen = {
        "rank": rank,
        "written": written,
        "saw_marker_on_entry": saw_marker,
        "is_world_process_zero": trainer.is_world_process_zero(),
        "is_local_process_zero": trainer.is_local_process_zero(),
        "process_index": args.process_index,
        "world_size": args.world_size,
        "should_save": args.should_save,
        "should_log": args.should_log,
    }
    (records / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])
