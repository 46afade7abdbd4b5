"""A schedule from a file: the text ``hf-ftpipe schedule`` prints, or CSV, read, checked and run as any schedule."""

from pathlib import Path

import pytest

from hf_ftpipe.costmodel import estimate
from hf_ftpipe.schedules import awaiting_weight_gradients, in_flight, make_schedule, schedule_traits
from hf_ftpipe.schedules.actions import chain_edges, restrict_order
from hf_ftpipe.schedules.from_file import FileSummary, summarize_file

from toy_graphs import UNIT, chain


def write(tmp_path: Path, text: str, name: str = "order.txt") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_printed_zb_h1_order_runs_from_a_file_with_its_memory_counted_from_it(tmp_path: Path) -> None:
    printed = str(make_schedule("zb-h1", [0, 1], 4))
    path = write(tmp_path, "step:\n" + printed + "\n")
    schedule = make_schedule(path, [0, 1], 4)
    assert str(schedule) == printed
    traits = schedule_traits(path)
    assert traits.flushes and traits.split_backward and traits.held_by_order
    # Rank 0: 0F0 0F1 0B0 0F2 holds 2 between F and B, 3 between F and W (before 0W0); rank 1:
    # 1 between F and B, 3 between F and W (1F0 1F1 1F2 before 1W0): 1 and 2 awaiting W.
    assert [in_flight(path, s, [0, 1], 4) for s in range(2)] == [2, 1]
    assert [awaiting_weight_gradients(path, s, [0, 1], 4) for s in range(2)] == [1, 2]


def test_csv_rows_are_ranks(tmp_path: Path) -> None:
    path = write(tmp_path, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", "order.csv")
    schedule = make_schedule(path, [0, 1], 2)
    assert str(schedule) == "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"
    assert not schedule.traits.split_backward and [in_flight(path, s, [0, 1], 2) for s in range(2)] == [2, 1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "rank 0: 0F0 1F0 0B0 1B0\nrank 1:\n",
            r"rank 0 runs stages \[0, 1\], rank 1 runs no stage; the plan's placement is \[0, 1\]",
        ),
        ("rank 0: 0F0 0B0\nrank 1: 1B0 1F0\n", r"the ranks' orders deadlock: each waits on another, next actions "),
        ("rank 0: 0F0 0B0\nrank 1: 1F0\n", r"deadlock: .*\{0: '0B0'\}"),
        (
            "rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0\n",
            r"not a valid schedule for 1 micro-batches: the order misses 1 actions",
        ),
        ("rank 0: 0F0 0X0\n", r"order.txt:1: cannot parse action '0X0'"),
        ("rank 0: 0F0 0B0\n", r"gives the actions of ranks \[0\]; the plan runs ranks \[0, 1\]"),
    ],
)
def test_a_bad_file_is_refused_saying_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_schedule(write(tmp_path, text), [0, 1], 1)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pipeline schedule file '.*nowhere.csv' does not exist"):
        make_schedule(str(tmp_path / "nowhere.csv"), [0, 1], 1)


def test_the_cost_model_prices_a_file_schedule_by_its_order(tmp_path: Path) -> None:
    # 1F1B's order from a file: the plan's memory is 1f1b's.
    path = write(tmp_path, str(make_schedule("1f1b", [0, 1], 4)))
    sizes = {"num_microbatches": 4, "microbatch_size": 1}
    graph, node_stage = chain([1.0, 1.0]), {"n0": 0, "n1": 1}
    from_file = estimate(graph, node_stage, [0, 1], UNIT, schedule=path, **sizes)
    assert from_file.gpus == estimate(graph, node_stage, [0, 1], UNIT, schedule="1f1b", **sizes).gpus


def test_a_file_for_another_number_of_microbatches_is_refused_naming_both(tmp_path: Path) -> None:
    path = write(tmp_path, str(make_schedule("1f1b", [0, 1], 2)))
    with pytest.raises(ValueError, match=r"orders 2 micro-batches, but a step here runs 4; write the file for 4"):
        make_schedule(path, [0, 1], 4)


def test_a_file_knows_its_placement_and_microbatches_before_any_plan(tmp_path: Path) -> None:
    zbv = write(tmp_path, str(make_schedule("zbv", [0, 1, 1, 0], 3)), "zbv.txt")
    chain_file = write(tmp_path, str(make_schedule("zb-h1", [0, 1], 2)), "zb-h1.txt")
    assert summarize_file(zbv) == FileSummary(stage_rank=[0, 1, 1, 0], num_microbatches=3, split_backward=True)
    assert schedule_traits(zbv).v_placement and not schedule_traits(chain_file).v_placement
    assert make_schedule(zbv, [0, 1, 1, 0], 3).traits == schedule_traits(zbv)
    two_ranks = write(tmp_path, "rank 0: 0F0 1F0 1B0 0B0\nrank 1: 1F0 1B0\n", "two.txt")
    assert summarize_file(two_ranks).stage_rank is None  # stage 1 on both ranks


@pytest.mark.parametrize(
    ("name", "stage_rank"),
    [
        ("gpipe", [0, 1, 2]),
        ("1f1b", [0, 1, 2]),
        ("zb-h1", [0, 1, 2]),
        ("zbv", [0, 1, 1, 0]),
        ("interleaved-1f1b", [0, 1, 0, 1]),
    ],
)
def test_a_short_step_follows_the_order_less_the_missing_microbatches(name: str, stage_rank: list[int]) -> None:
    schedule = make_schedule(name, stage_rank, 4)
    order = schedule.global_order()
    for kept in (1, 2, 3):
        short = restrict_order(order, stage_rank, schedule.edges, kept)
        assert short == [a for a in order if a.microbatch_index < kept]
        assert {a.microbatch_index for a in short} == set(range(kept))


def test_a_short_order_that_misses_an_action_is_refused() -> None:
    order = make_schedule("1f1b", [0, 1], 2).global_order()
    broken = [a for a in order if str(a) != "1B0"]
    with pytest.raises(ValueError, match=r"the order of the first 1 micro-batches is not valid: 0B0 comes before 1B0"):
        restrict_order(broken, [0, 1], chain_edges(2), 1)


def test_a_short_step_of_token_slices_keeps_every_slice_of_its_microbatches() -> None:
    order = make_schedule("1f1b", [0, 1], 3, num_slices=2).global_order()
    short = restrict_order(order, [0, 1], chain_edges(2), 2)
    assert short == [a for a in order if a.microbatch_index < 2] and len(short) == 2 * 2 * 2 * 2
