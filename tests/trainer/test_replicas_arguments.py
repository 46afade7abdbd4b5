"""``data_parallel_size`` checked without processes: values, the schedules that refuse replicas, and
the world size it must divide."""

from __future__ import annotations

import pytest

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.schedules.registry import SCHEDULES
from hf_ftpipe.trainer.replicas import check_data_parallel_size, pipeline_size


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
