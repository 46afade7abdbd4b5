"""hf_ftpipe/trainer/auto_order.py: the order `pipeline_schedule="zb-auto"` builds for the run's plan (no processes).

The launched run that trains through it, against plain `Trainer`: tests/trainer/test_any_batch.py
(``gpt2-zb-auto``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from cost_tables import tiny_gpt2_traced
from transformers.utils import logging as transformers_logging

from hf_ftpipe import PipeTrainingArguments
from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.schedules import make_schedule
from hf_ftpipe.simulator import plan_auto_schedule, simulate
from hf_ftpipe.trainer import plan_sharing as planning
from hf_ftpipe.trainer.auto_order import ORDER_FILE, engine_schedule

MICROBATCH = {"input_ids": torch.ones(2, 8, dtype=torch.long)}


@pytest.fixture(scope="module")
def traced():  # noqa: ANN201
    return tiny_gpt2_traced(4)


def planned(traced, tmp_path: Path, **fields: object):  # noqa: ANN001, ANN201
    args = PipeTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", pipeline_schedule="zb-auto", num_microbatches=4,
        **fields,
    )  # fmt: skip
    return args, planning._compute_partition(args, traced, get_profile("cpu", count=2), MICROBATCH)


def warnings_of(run) -> list[str]:  # noqa: ANN001
    """What ``run()`` logs at warning level under transformers' logger (`hf_ftpipe.trainer.run_log`)."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = transformers_logging.get_logger()
    root.addHandler(handler)
    try:
        run()
    finally:
        root.removeHandler(handler)
    return records


def test_zb_auto_runs_the_order_built_for_the_plan_from_output_dir(traced, tmp_path: Path) -> None:  # noqa: ANN001
    args, plan = planned(traced, tmp_path)
    # auto plans GPT-2 as Mixed-Pipe [1, 0, 1]: unequal stages, where the costed order beats zb-h1's.
    assert plan.key.schedule == "zb-auto" and plan.stage_device == [1, 0, 1]
    path = engine_schedule(args, plan, traced.cost_graph, 4)
    assert path == str(tmp_path / ORDER_FILE)
    built, result = plan_auto_schedule(plan, num_microbatches=4)
    assert Path(path).read_text(encoding="utf-8") == str(built) != str(make_schedule("zb-h1", [1, 0, 1], 4))
    assert result.step_time_s < simulate(plan, "zb-h1").step_time_s
    assert engine_schedule(dataclasses.replace(args, pipeline_schedule="zb-h1"), plan, traced.cost_graph, 4) == "zb-h1"


def test_zb_auto_runs_zb_h1s_order_where_the_built_one_would_not_fit_or_cannot_be_built(
    traced,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    # A run whose headroom leaves ~no memory (the plan, stored, made for another): the built order does not
    # fit, so zb-h1's runs, the log says why, and no order file is left in output_dir.
    args, plan = planned(traced, tmp_path)
    args = dataclasses.replace(args, partition_memory_headroom=0.999999999)
    logged = warnings_of(lambda: engine_schedule(args, plan, traced.cost_graph, 4))
    assert engine_schedule(args, plan, traced.cost_graph, 4) == "zb-auto"
    assert len(logged) == 1 and "more than its" in logged[0] and "running zb-h1's" in logged[0], logged
    assert list(tmp_path.iterdir()) == []
    # A plan without its recorded stage times (a plan file written by hand): nothing to time an order by.
    bare = dataclasses.replace(plan, predicted=None)
    logged = warnings_of(lambda: engine_schedule(args, bare, traced.cost_graph, 4))
    assert len(logged) == 1 and "carries no prediction" in logged[0], logged
