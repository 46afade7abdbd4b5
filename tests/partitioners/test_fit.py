"""What would fit when no plan does (``fit.FitAdvice``): each figure once, the fixes in the words
of whoever reads them, and only fixes that the figures show to help where they can tell."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_ftpipe.costmodel import MemoryOptions
from hf_ftpipe.errors import PlanDoesNotFitError
from hf_ftpipe.partitioners import partition_auto, partition_seq_dp, partition_seq_greedy

from toy_graphs import UNIT, chain

# A stage of 2 of these ops keeps (2 × 16 saved + 16 sent) bytes for each of 4 micro-batches and
# works with 2 × 16 in its backward: 224 bytes. 200 bytes less 10% leave 180 usable.
SIZES = {"num_microbatches": 4, "microbatch_size": 2}
TWO = replace(UNIT, count=2, memory_bytes=200)


def no_fit(profile=TWO, **changes) -> PlanDoesNotFitError:
    with pytest.raises(PlanDoesNotFitError) as info:
        partition_seq_dp(chain([1] * 4), profile, **SIZES, **changes)
    return info.value


@pytest.mark.parametrize(
    ("caller", "recompute", "more_gpus", "schedule"),
    [
        ("python", "`memory=MemoryOptions(recompute=True)`", "`profile.with_count(4)`", '`schedule="1f1b"`'),
        ("trainer", "`activation_checkpointing=True`", "`accelerate launch --num_processes 4`", "`pipeline_schedule="),
        ("cli", "`--recompute`", "`--gpus 4`", "`--schedule 1f1b`"),
    ],
)
def test_fixes_are_named_as_the_reader_names_them(caller, recompute, more_gpus, schedule) -> None:
    error = no_fit()
    text = error.message(caller)
    assert text.startswith(error.reason + "\n")
    assert "It would fit on GPUs of at least 249 bytes each (the leanest contiguous split needs 224 bytes" in text
    assert f"It would fit on 4 × unit ({more_gpus}), the fewest that a contiguous split fits." in text
    assert f"With {recompute}, it would fit these 2 × unit." in text  # 176 bytes a stage
    assert schedule in text
    assert str(error.worded_for(caller)) == text
    assert str(error) == error.message("python")


def test_less_headroom_is_offered_when_the_gpus_would_hold_the_plan() -> None:
    roomy = replace(TWO, memory_bytes=240)  # 216 usable; 224 fit once 6% is kept free
    assert "or these with less headroom (`--headroom 0.06`)" in no_fit(roomy).message("cli")
    partition_seq_dp(chain([1] * 4), roomy, **SIZES, memory=MemoryOptions(headroom=0.06))


def test_an_op_that_fits_no_gpu_is_named_and_more_gpus_are_not_offered() -> None:
    tiny = replace(TWO, memory_bytes=84)  # 75 usable; one op alone keeps (16 + 16) × 4 + 32 = 160
    text = no_fit(tiny).message("cli")
    assert "No number of unit fits: `n0` alone needs 160 bytes on a GPU of its own with 4 micro-batches" in text
    assert "--gpus" not in text and "With " not in text


def test_a_partitioner_blind_to_memory_points_to_one_that_is_not() -> None:
    # seq-greedy cuts by compute, 3 ops | 1 (288 bytes on GPU 0); seq-dp fits 2 | 2 (224 bytes).
    profile = replace(TWO, memory_bytes=230)
    memory = MemoryOptions(headroom=0)
    with pytest.raises(PlanDoesNotFitError) as info:
        partition_seq_greedy(chain([1, 1, 1, 9]), profile, **SIZES, memory=memory)
    assert info.value.message("cli").endswith(
        "seq-dp finds a plan that fits: the leanest contiguous split needs 224 bytes on its fullest GPU, within the "
        "230 bytes usable.\nChanges that help: `--partitioner auto`."
    )
    assert '`partitioner="auto"`' in info.value.message("trainer")
    partition_seq_dp(chain([1, 1, 1, 9]), profile, **SIZES, memory=memory)


def follow(text: str, graph, profile, memory: MemoryOptions) -> None:
    """Do what a Python caller's advice says: the partitioner it names for what follows (the one
    asked otherwise), with the fixes of its "With ..." line; raises if the plan still does not fit."""
    with_line = next(line for line in text.splitlines() if line.startswith("With "))
    options = dict(SIZES, memory=memory)
    if "`memory=MemoryOptions(recompute=True)`" in with_line:
        options["memory"] = replace(memory, recompute=True)
    if '`schedule="1f1b"`' in with_line:
        options["schedule"] = "1f1b"
    if '`optimizer="adafactor"`' in with_line:
        options["optimizer"] = "adafactor"
    partitioner = partition_auto if "what follows is for `partition_auto`" in text else partition_seq_greedy
    if "seq-greedy's own plan included" in with_line:
        partitioner = partition_seq_greedy
    partitioner(graph, profile, **options)


def test_advice_to_a_blind_partitioner_names_the_one_that_fits_and_following_it_works() -> None:
    # Seven light ops and a heavy one: greedy cuts 7 | 1. Under 1F1B a split of seq-dp's fits, greedy's
    # 7 | 1 still does not (it needs both 1F1B and recomputation: more fixes than seq-dp's one).
    graph, profile, memory = chain([1] * 7 + [9]), replace(TWO, memory_bytes=196), MemoryOptions(headroom=0)
    with pytest.raises(PlanDoesNotFitError) as info:
        partition_seq_greedy(graph, profile, **SIZES, memory=memory)
    text = info.value.message("python")
    assert "seq-greedy cuts without regard to memory: what follows is for `partition_auto`" in text
    assert (
        'With `schedule="1f1b"`, it would fit these 2 × unit (seq-greedy\'s own plan would not: it would need '
        "288 bytes on its fullest GPU)." in text
    )
    with pytest.raises(PlanDoesNotFitError):  # what the advice used to promise
        partition_seq_greedy(graph, profile, **SIZES, memory=memory, schedule="1f1b")
    follow(text, graph, profile, memory)
    assert '`partitioner="auto"`' in info.value.message("trainer")


def test_advice_to_a_blind_partitioner_that_a_fix_makes_fit_names_that_fix_and_following_it_works() -> None:
    # greedy cuts 3 | 1 (288 bytes on GPU 0) and seq-dp's leanest 2 | 2 needs 224: neither fits 200
    # bytes; with recomputation both fit, greedy's own plan included.
    graph, profile, memory = chain([1, 1, 1, 9]), replace(TWO, memory_bytes=200), MemoryOptions(headroom=0)
    with pytest.raises(PlanDoesNotFitError) as info:
        partition_seq_greedy(graph, profile, **SIZES, memory=memory)
    text = info.value.message("cli")
    assert "With `--recompute`, it would fit these 2 × unit, seq-greedy's own plan included." in text
    follow(info.value.message("python"), graph, profile, memory)
