"""The run's plan line, worked out by hand from a plan with round numbers, and the logger it goes
through (the 2-rank run at ``log_level="info"`` is in test_launch.py, the default level in
test_trainer_surface.py)."""

from __future__ import annotations

import logging

import pytest
import transformers

from hf_ftpipe.costmodel.prediction import GPUCost, Prediction
from hf_ftpipe.hub.sources import Resolved
from hf_ftpipe.plan import Partition
from hf_ftpipe.plan.reanchor import Reanchored
from hf_ftpipe.trainer.run_log import PlanUsed, get_logger, plan_line

GiB, MiB = 2**30, 2**20


def _gpu(memory_bytes: int) -> GPUCost:
    return GPUCost(
        compute_s=0.01,
        comm_fwd_out_s=0.0,
        comm_bwd_in_s=0.0,
        cost_s=0.01,
        weights_bytes=memory_bytes,
        gradient_bytes=0,
        optimizer_bytes=0,
        activation_bytes=0,
        memory_bytes=memory_bytes,
        capacity_bytes=11 * GiB,
    )


# Mixed-Pipe's shape: GPU 0 runs stages 0 and 2, GPU 1 stage 1; micro-batches of 8 in 0.02 s.
PLAN = Partition(
    node_stage={"a": 0, "b": 1, "c": 2},
    stage_device=[0, 1, 0],
    partitioner="mixed",
    key=None,
    predicted=Prediction(
        schedule="gpipe",
        num_microbatches=4,
        microbatch_size=8,
        optimizer="adamw",
        stages=[],
        gpus=[_gpu(3 * GiB), _gpu(512 * MiB)],
        step_time_s=0.02,
        ideal_step_time_s=0.015,
    ),
)
GPUS = "GPU 0: stages 0, 2, peak 3.00 GiB of 11.00 GiB; GPU 1: stage 1, peak 512.0 MiB of 11.00 GiB"


@pytest.mark.parametrize(
    ("source", "location", "asked", "origin"),
    [
        ("computed", "", "auto", "computed by auto (chose mixed)"),
        ("computed", "", "mixed", "computed by mixed"),
        ("file", "plan.json", "auto", "from the file plan.json (made by mixed)"),
        ("cache", "cache/ab12.json", "auto", "from the local cache, cache/ab12.json (made by mixed)"),
        ("hub", "hf://datasets/o/p@main/x.json", "auto", "from the Hub, hf://datasets/o/p@main/x.json (made by mixed)"),
    ],
)
def test_the_line_names_the_source_the_partitioner_and_each_gpu(
    source: str, location: str, asked: str, origin: str
) -> None:
    line = plan_line(PlanUsed(Resolved(PLAN, source, location), 1.234, asked))
    # 8 samples per micro-batch / 0.02 s on the slowest GPU = 400 samples/s
    assert line == f"pipeline plan: {origin} in 1.23 s; 3 stages on 2 GPUs; predicted 400 samples/s; {GPUS}"


def test_token_slices_end_the_line_and_say_when_auto_chose_them() -> None:
    given = plan_line(PlanUsed(Resolved(PLAN, "computed", ""), 0.5, "auto", (3, 1, 4)))
    assert given.endswith(f"{GPUS}; token slices [3, 1, 4]")
    auto = plan_line(PlanUsed(Resolved(PLAN, "computed", ""), 0.5, "auto", (4, 4), token_slices_auto=True))
    assert auto.endswith(f"{GPUS}; token slices [4, 4] (chosen by token_slices='auto')")


def test_a_re_anchored_plan_says_so_after_its_source() -> None:
    reanchored = Reanchored(
        partition=PLAN, matched=3, by_module=0, by_producer=0, moved=0, dropped=1, new_scopes=(),
        made_under="5.23.0", step_time_s=0.02,
    )  # fmt: skip
    line = plan_line(PlanUsed(Resolved(PLAN, "cache", "c.json", reanchored), 0.5, "auto"))
    assert line.startswith(
        "pipeline plan: from the local cache, c.json (made by mixed) in 0.50 s; made under transformers 5.23.0, "
        f"re-anchored onto this graph (transformers {transformers.__version__}): 3 of 3 ops matched, 1 of the "
        "plan's gone; predicted step 20 ms (the plan's own: 20 ms); 3 stages on 2 GPUs; "
    )


def test_a_plan_without_prediction_says_so_and_still_lists_the_stages() -> None:
    bare = Partition(node_stage={"a": 0, "b": 1}, stage_device=[0, 1], partitioner="uniform", key=None)
    line = plan_line(PlanUsed(Resolved(bare, "file", "p.json"), 0.01, "auto"))
    assert line == (
        "pipeline plan: from the file p.json (made by uniform) in 0.01 s; 2 stages on 2 GPUs; "
        "no prediction in the plan; GPU 0: stage 0; GPU 1: stage 1"
    )


def test_the_trainer_logs_at_transformers_verbosity_through_its_handlers() -> None:
    logger = get_logger("hf_ftpipe.trainer.plan_sharing")
    received: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: received.append(record.getMessage())
    library = logging.getLogger("transformers")
    before = transformers.utils.logging.get_verbosity()
    library.addHandler(handler)
    try:
        transformers.utils.logging.set_verbosity_warning()
        logger.info("hidden at warning")
        transformers.utils.logging.set_verbosity_info()
        logger.info("shown at info")
    finally:
        library.removeHandler(handler)
        transformers.utils.logging.set_verbosity(before)
    assert received == ["shown at info"]
