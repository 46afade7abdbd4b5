"""``data_parallel_size`` checked without processes: values (``"auto"`` from Python and the command
line), the schedules that refuse replicas, the world size it must divide, and what ``"auto"`` means
for the batch."""

from __future__ import annotations

import pytest
from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.schedules.registry import SCHEDULES
from hf_ftpipe.trainer.replicas import Replicas, check_data_parallel_size, global_batch_size, pipeline_size


def _args(**kwargs: object) -> PipeTrainingArguments:
    return PipeTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_data_parallel_size_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValueError, match=rf"`data_parallel_size={value!r}` must be a positive integer"):
        _args(data_parallel_size=value)


def test_async_refuses_replicas_and_names_the_schedules_that_take_them() -> None:
    refused = r"data_parallel_size=2` with pipeline_schedule='async'.*stale weights.*'2bw', gpipe or 1f1b"
    with pytest.raises(ValueError, match=refused):
        _args(data_parallel_size=2, pipeline_schedule="async")
    assert _args(data_parallel_size=2, pipeline_schedule="2bw").data_parallel_size == 2
    assert _args(data_parallel_size=1, pipeline_schedule="async").data_parallel_size == 1


def test_the_launched_world_must_divide_into_replicas() -> None:
    with pytest.raises(ValueError, match=r"does not divide the 6 processes launched.*one of \[1, 2, 3, 6\]"):
        check_data_parallel_size(4, SCHEDULES["gpipe"], world_size=6)
    check_data_parallel_size(3, SCHEDULES["gpipe"], world_size=6)
    check_data_parallel_size(
        4, SCHEDULES["gpipe"], world_size=None
    )  # not launched yet: checked when the pipeline is built


def test_pipeline_size_is_the_world_over_the_replicas() -> None:
    assert pipeline_size(2, 4) == 2
    assert pipeline_size(4, 4) == 1  # plain data parallelism: one stage per rank
    with pytest.raises(PipelineError, match=r"^\[rank 1\] data_parallel_size=4 does not divide the 6 processes"):
        pipeline_size(4, 6, rank=1)


@pytest.mark.parametrize(("given", "parsed"), [("auto", "auto"), ("2", 2), ("1", 1)])
def test_the_command_line_takes_auto_or_a_number(given: str, parsed: object) -> None:
    command = ["--output_dir", "unused", "--use_cpu", "--report_to", "none", "--data_parallel_size", given]
    (args,) = HfArgumentParser(PipeTrainingArguments).parse_args_into_dataclasses(command)
    assert args.data_parallel_size == parsed


@pytest.mark.parametrize("value", ["two", "0", "auto2", None, 2.0])
def test_a_data_parallel_size_neither_a_number_nor_auto_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=rf"`data_parallel_size={value!r}` must be a positive integer or 'auto'"):
        _args(data_parallel_size=value)


def test_under_auto_the_global_batch_is_per_device_and_the_replicas_share_its_microbatches() -> None:
    args = _args(data_parallel_size="auto", per_device_train_batch_size=8, num_microbatches=4)
    assert global_batch_size(args.per_device_train_batch_size, args) == 8  # whatever D the planner picks
    assert Replicas.of(args, 2) == Replicas(2, 2)  # 2 replicas of 2 micro-batches of 2 rows
    assert Replicas.of(args, 4).num_microbatches == 1
    given = _args(data_parallel_size=2, per_device_train_batch_size=8, num_microbatches=4)
    assert global_batch_size(8, given) == 16  # DDP's meaning: one replica's mini-batch
    assert Replicas.of(given) == Replicas(2, 4)


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ({"partition_file": "plan.json"}, "a partition file fixes the pipeline's GPUs"),
        ({"token_slices": "auto"}, "token_slices='auto' is planned for a known number of stages"),
    ],
)
def test_auto_refuses_what_fixes_the_pipelines_size(arguments: dict, why: str) -> None:
    with pytest.raises(ValueError, match=rf"`data_parallel_size='auto'` with `.*{why}.*give data_parallel_size"):
        _args(data_parallel_size="auto", **arguments)
