"""A 2-rank PipeTrainer job on a tiny GPT-2 with ``partition_repo`` set, started by tests/hub/test_trainer_hub.py.

Rank 0 writes ``OUTPUT/result.json``: where its plan came from (``trainer.partition_source``), the
plan itself, and how many times the partitioner ran, so the test can tell a pulled plan from a
computed one.
"""

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from datasets import Dataset

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.partitioners import partition_seq_greedy, register_partitioner
from hf_ftpipe.plan import Partition

from models import tiny_batch, tiny_model

PARTITIONER = "counted-seq-greedy"
calls: list[int] = []


@register_partitioner(PARTITIONER)
def counted_seq_greedy(*args, **kwargs) -> Partition:
    """seq-greedy, counting its calls; the plan names this partitioner, as stored plans must."""
    calls.append(1)
    return replace(partition_seq_greedy(*args, **kwargs), partitioner=PARTITIONER)


def main(output_dir: str, repo: str, push: str, model_repo: str = "") -> None:
    """``model_repo``: also Trainer's own ``push_to_hub`` of the trained model to that model repo, and of
    the checkpoint of the last step (``hub_strategy="checkpoint"``) as its ``last-checkpoint/``."""
    logging.basicConfig(level=logging.INFO)
    args = PipeTrainingArguments(
        push_to_hub=bool(model_repo),
        hub_model_id=model_repo or None,
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_microbatches=2,
        partitioner=PARTITIONER,
        partition_repo=repo,
        push_partition_to_hub=push == "push",
        max_steps=2,
        save_strategy="steps" if model_repo else "no",
        save_steps=2,
        hub_strategy="checkpoint",
        report_to="none",
        log_level="info",  # rank 0 logs the plan it used (transformers' logging)
        seed=0,
    )
    data = tiny_batch("gpt2", 8, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    trainer = PipeTrainer(model=tiny_model("gpt2"), args=args, train_dataset=dataset)
    trainer.train()
    if model_repo:
        trainer.push_to_hub()  # every rank: it saves the gathered model, rank 0 uploads it
    if trainer.engine.rank == 0:
        result = {
            "source": trainer.partition_source,
            "partition": trainer.partition.to_dict(),
            "partitioner_calls": len(calls),
        }
        (Path(output_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
