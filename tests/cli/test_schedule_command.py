"""`hf-ftpipe schedule`: each rank's actions, checked, with no process started."""

from __future__ import annotations

import pytest

from hf_ftpipe.cli import parser as cli


def test_schedule_prints_each_ranks_actions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "1f1b", "--num-microbatches", "4"]) == 0
    assert capsys.readouterr().out == (
        "step:\n  rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n  rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3\n"
    )
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "2bw", "--num-microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 0:\n  rank 0: 0F0 0F1 0B0\n  rank 1: 1F0 1B0 1F1 1B1 1U1\nstep 1:\n"), out
    assert out.endswith("drain:\n  rank 0: 0B3 0U3\n  rank 1: \n"), out


def test_schedule_zb_auto_prints_zb_h1s_order_and_says_where_the_plans_own_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "zb-auto", "--num-microbatches", "4"]) == 0
    printed = capsys.readouterr()
    assert printed.out == (
        "step:\n  rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3\n"
        "  rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3\n"
    )
    assert "`hf-ftpipe simulate PLAN --write-zb-auto order.txt` builds the one for a plan" in printed.err


def test_schedule_refuses_a_placement_with_an_idle_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedule", "--placement", "0,2"]) == 2
    assert "ranks must be 0..N-1, each holding a stage; got [0, 2]" in capsys.readouterr().err


def test_schedule_messages_prints_each_ranks_program_with_its_sends_and_receives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # GPipe on two ranks: rank 1 receives h0 before each forward, copies the loss back, and sends
    # h0's gradient after each backward; rank 0 posts every receive in the order rank 1 sends.
    assert cli.main(["schedule", "--placement", "0,1", "--num-microbatches", "2", "--messages"]) == 0
    assert capsys.readouterr().out == (
        "step:\n"
        "  rank 0: 0F0 SEND_F0:h0>1 0F1 SEND_F1:h0>1 RECV_F0:loss<1 RECV_F1:loss<1 RECV_B0:h0<1 RECV_B1:h0<1 0B0 0B1\n"
        "  rank 1: RECV_F0:h0<0 RECV_F1:h0<0 1F0 SEND_F0:loss>0 1F1 SEND_F1:loss>0 1B0 SEND_B0:h0>0 1B1 SEND_B1:h0>0\n"
    )


def test_schedule_messages_pair_every_send_with_a_receive_on_a_mixed_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Stages 0 and 3 share rank 0: h0 and h2 cross ranks, h1 stays on rank 1 and is never sent.
    argv = ["schedule", "--placement", "0,1,1,0", "--schedule", "1f1b", "--num-microbatches", "2", "--messages"]
    assert cli.main(argv) == 0
    programs = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        rank, program = line.removeprefix("  rank ").split(": ")
        programs[int(rank)] = program.split()
    sends, receives = [], []
    for rank, program in programs.items():
        for op in program:
            if op.startswith("SEND_"):
                what, peer = op.removeprefix("SEND_").split(">")
                sends.append((what, rank, int(peer)))
            elif op.startswith("RECV_"):
                what, peer = op.removeprefix("RECV_").split("<")
                receives.append((what, int(peer), rank))
    assert sorted(sends) == sorted(receives)
    assert sorted(what for what, src, _ in sends if src == 0) == [
        "B0:h2", "B1:h2", "F0:h0", "F0:loss", "F1:h0", "F1:loss",
    ]  # fmt: skip
    assert not any("h1" in op for program in programs.values() for op in program)


def test_schedule_token_slices_prints_the_sliced_orders_and_their_messages(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["schedule", "--placement", "0,1", "--schedule", "1f1b", "--num-microbatches", "2", "--token-slices", "2"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        "step:\n"
        "  rank 0: 0F0.0 0F0.1 0F1.0 0B0.1 0F1.1 0B0.0 0B1.1 0B1.0\n"
        "  rank 1: 1F0.0 1F0.1 1B0.1 1F1.0 1B0.0 1F1.1 1B1.1 1B1.0\n"
    )
    argv = ["schedule", "--placement", "0,1", "--num-microbatches", "1", "--token-slices", "2", "--messages"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        "step:\n"
        "  rank 0: 0F0.0 SEND_F0.0:h0>1 0F0.1 SEND_F0.1:h0>1 RECV_F0.0:loss<1 RECV_F0.1:loss<1 "
        "RECV_B0.1:h0<1 RECV_B0.0:h0<1 0B0.1 0B0.0\n"
        "  rank 1: RECV_F0.0:h0<0 RECV_F0.1:h0<0 1F0.0 SEND_F0.0:loss>0 1F0.1 SEND_F0.1:loss>0 "
        "1B0.1 SEND_B0.1:h0>0 1B0.0 SEND_B0.0:h0>0\n"
    )
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "2bw", "--token-slices", "2"]) == 2
    assert "'2bw' does not take token slices" in capsys.readouterr().err


def test_schedule_refuses_zero_token_slices_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedule", "--placement", "0,1", "--token-slices", "0"]) == 2
    assert "--token-slices takes the slices per sequence, at least 1; got 0" in capsys.readouterr().err


def test_schedule_prints_the_zero_bubble_schedules_and_refuses_a_placement_they_do_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["schedule", "--placement", "0,1", "--schedule", "zb-h1", "--num-microbatches", "4"]) == 0
    assert capsys.readouterr().out == (
        "step:\n  rank 0: 0F0 0F1 0B0 0F2 0B1 0W0 0B2 0F3 0W1 0W2 0B3 0W3\n"
        "  rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1F3 1B3 1W2 1W3\n"
    )
    assert cli.main(["schedule", "--placement", "0,1,0,1", "--schedule", "interleaved-1f1b", "--messages"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step:\n  rank 0: 0F0 SEND_F0:h0>1 0F1 SEND_F1:h0>1 RECV_F0:h1<1 2F0 SEND_F0:h2>1"), out
    assert cli.main(["schedule", "--placement", "0,1,0,1", "--schedule", "zbv"]) == 2
    assert "placement [0, 1, 0, 1] is not one" in capsys.readouterr().err
