"""The lowering: each rank's program with its SENDs and RECVs, asserted literally, without processes."""

from hf_ftpipe.schedules import make_schedule
from hf_ftpipe.schedules.lowering import (
    Comm,
    Dataflow,
    Lowering,
    Route,
    chain_dataflow,
    format_program,
    whole_backwards,
)

# Stage 0 on rank 0 sends h to stage 1 on rank 1, which computes the loss and copies it to rank 0.
CHAIN = Dataflow(
    sent=[["h"], ["loss"]],
    received=[[], ["h"]],
    consumers={"h": [1], "loss": []},
    routes={"h": Route("h", 0, 0, [1], [1], True), "loss": Route("loss", 1, 1, [0], [], False)},
)


def programs(name: str, num_microbatches: int) -> dict[int, str]:
    lowered = Lowering(CHAIN, [0, 1]).lower(make_schedule(name, [0, 1], num_microbatches).global_order())
    return {rank: format_program(program) for rank, program in lowered.items()}


def test_gpipe_two_ranks_two_microbatches() -> None:
    assert programs("gpipe", 2) == {
        0: "0F0 SEND_F0:h>1 0F1 SEND_F1:h>1 RECV_F0:loss<1 RECV_F1:loss<1 RECV_B0:h<1 RECV_B1:h<1 0B0 0B1",
        1: "RECV_F0:h<0 RECV_F1:h<0 1F0 SEND_F0:loss>0 1F1 SEND_F1:loss>0 1B0 SEND_B0:h>0 1B1 SEND_B1:h>0",
    }


def test_1f1b_two_ranks_three_microbatches() -> None:
    assert programs("1f1b", 3) == {
        0: "0F0 SEND_F0:h>1 0F1 SEND_F1:h>1 RECV_F0:loss<1 RECV_B0:h<1 0B0 RECV_F1:loss<1 RECV_B1:h<1 "
        "0F2 SEND_F2:h>1 0B1 RECV_F2:loss<1 RECV_B2:h<1 0B2",
        1: "RECV_F0:h<0 RECV_F1:h<0 1F0 SEND_F0:loss>0 1B0 SEND_B0:h>0 1F1 SEND_F1:loss>0 1B1 SEND_B1:h>0 "
        "RECV_F2:h<0 1F2 SEND_F2:loss>0 1B2 SEND_B2:h>0",
    }


def test_async_receives_of_the_next_step_open_its_program() -> None:
    """The gradient of micro-batch 1 is sent in step 0 and read in step 1: its RECV opens step 1."""
    lowering, schedule = Lowering(CHAIN, [0, 1]), make_schedule("async", [0, 1], 2)
    steps = [lowering.lower(step) for step in (schedule.next_step(), schedule.next_step(), schedule.drain())]
    assert [format_program(step[0]) for step in steps] == [
        "0F0 SEND_F0:h>1 0F1 SEND_F1:h>1 RECV_F0:loss<1 RECV_B0:h<1 0B0 0U0 RECV_F1:loss<1",
        "RECV_B1:h<1 0F2 SEND_F2:h>1 0B1 0U1 RECV_F2:loss<1 RECV_B2:h<1 0F3 SEND_F3:h>1 0B2 0U2 RECV_F3:loss<1",
        "RECV_B3:h<1 0B3 0U3",
    ]


def test_both_ends_of_every_message_agree() -> None:
    """Every SEND has its RECV on the peer, in the same order between each pair of ranks."""
    for name in ("gpipe", "1f1b"):
        lowered = Lowering(CHAIN, [0, 1]).lower(make_schedule(name, [0, 1], 4).global_order())
        for src, dst in ((0, 1), (1, 0)):
            sent = [(c.value, c.microbatch_index, c.backward) for c in lowered[src] if _is(c, "SEND", dst)]
            received = [(c.value, c.microbatch_index, c.backward) for c in lowered[dst] if _is(c, "RECV", src)]
            assert sent == received and sent, (name, src, dst)


def test_a_gradient_goes_back_after_the_last_local_reader() -> None:
    """h is read by stages 1 and 2, both on rank 1: one gradient message, after the later backward."""
    flow = Dataflow(
        sent=[["h"], [], []],
        received=[[], ["h"], ["h"]],
        consumers={"h": [1, 2]},
        routes={"h": Route("h", 0, 0, [1], [1], True)},
    )
    lowered = Lowering(flow, [0, 1, 1]).lower(make_schedule("gpipe", [0, 1, 1], 1, [(0, 1), (0, 2)]).global_order())
    assert format_program(lowered[1]) == "RECV_F0:h<0 1F0 2F0 2B0 1B0 SEND_B0:h>0"
    assert str(Comm("RECV", "h", 0, True, 1)) == "RECV_B0:h<1"


def _is(op: object, kind: str, peer: int) -> bool:
    return isinstance(op, Comm) and op.kind == kind and op.peer == peer


def sliced_programs(name: str, num_microbatches: int, num_slices: int) -> dict[int, str]:
    schedule = make_schedule(name, [0, 1], num_microbatches, num_slices=num_slices)
    lowered = Lowering(CHAIN, [0, 1]).lower(schedule.global_order())
    return {rank: format_program(program) for rank, program in lowered.items()}


def test_token_slices_send_hidden_states_gradients_and_partial_losses_per_slice() -> None:
    """One message per slice and value; no keys/values cross: a stage keeps those of its layers."""
    assert sliced_programs("gpipe", 1, 3) == {
        0: "0F0.0 SEND_F0.0:h>1 0F0.1 SEND_F0.1:h>1 0F0.2 SEND_F0.2:h>1 "
        "RECV_F0.0:loss<1 RECV_F0.1:loss<1 RECV_F0.2:loss<1 RECV_B0.2:h<1 RECV_B0.1:h<1 RECV_B0.0:h<1 "
        "0B0.2 0B0.1 0B0.0",
        1: "RECV_F0.0:h<0 RECV_F0.1:h<0 RECV_F0.2:h<0 1F0.0 SEND_F0.0:loss>0 1F0.1 SEND_F0.1:loss>0 "
        "1F0.2 SEND_F0.2:loss>0 1B0.2 SEND_B0.2:h>0 1B0.1 SEND_B0.1:h>0 1B0.0 SEND_B0.0:h>0",
    }
    assert sliced_programs("1f1b", 1, 3) == {
        0: "0F0.0 SEND_F0.0:h>1 0F0.1 SEND_F0.1:h>1 RECV_F0.0:loss<1 0F0.2 SEND_F0.2:h>1 "
        "RECV_F0.1:loss<1 RECV_F0.2:loss<1 RECV_B0.2:h<1 0B0.2 RECV_B0.1:h<1 0B0.1 RECV_B0.0:h<1 0B0.0",
        1: "RECV_F0.0:h<0 RECV_F0.1:h<0 1F0.0 SEND_F0.0:loss>0 RECV_F0.2:h<0 1F0.1 SEND_F0.1:loss>0 "
        "1F0.2 SEND_F0.2:loss>0 1B0.2 SEND_B0.2:h>0 1B0.1 SEND_B0.1:h>0 1B0.0 SEND_B0.0:h>0",
    }


def test_token_slices_of_two_microbatches_lowered() -> None:
    assert sliced_programs("gpipe", 2, 2) == {
        0: "0F0.0 SEND_F0.0:h>1 0F0.1 SEND_F0.1:h>1 0F1.0 SEND_F1.0:h>1 0F1.1 SEND_F1.1:h>1 "
        "RECV_F0.0:loss<1 RECV_F0.1:loss<1 RECV_F1.0:loss<1 RECV_F1.1:loss<1 "
        "RECV_B1.1:h<1 RECV_B1.0:h<1 RECV_B0.1:h<1 RECV_B0.0:h<1 0B1.1 0B1.0 0B0.1 0B0.0",
        1: "RECV_F0.0:h<0 RECV_F0.1:h<0 RECV_F1.0:h<0 RECV_F1.1:h<0 1F0.0 SEND_F0.0:loss>0 1F0.1 SEND_F0.1:loss>0 "
        "1F1.0 SEND_F1.0:loss>0 1F1.1 SEND_F1.1:loss>0 "
        "1B1.1 SEND_B1.1:h>0 1B1.0 SEND_B1.0:h>0 1B0.1 SEND_B0.1:h>0 1B0.0 SEND_B0.0:h>0",
    }
    assert sliced_programs("1f1b", 2, 2) == {
        0: "0F0.0 SEND_F0.0:h>1 0F0.1 SEND_F0.1:h>1 RECV_F0.0:loss<1 0F1.0 SEND_F1.0:h>1 RECV_F0.1:loss<1 "
        "RECV_B0.1:h<1 0B0.1 RECV_F1.0:loss<1 RECV_B0.0:h<1 0F1.1 SEND_F1.1:h>1 0B0.0 RECV_F1.1:loss<1 "
        "RECV_B1.1:h<1 0B1.1 RECV_B1.0:h<1 0B1.0",
        1: "RECV_F0.0:h<0 RECV_F0.1:h<0 1F0.0 SEND_F0.0:loss>0 RECV_F1.0:h<0 1F0.1 SEND_F0.1:loss>0 "
        "1B0.1 SEND_B0.1:h>0 1F1.0 SEND_F1.0:loss>0 1B0.0 SEND_B0.0:h>0 RECV_F1.1:h<0 1F1.1 SEND_F1.1:loss>0 "
        "1B1.1 SEND_B1.1:h>0 1B1.0 SEND_B1.0:h>0",
    }
    assert str(Comm("SEND", "h", 0, False, 1, 2)) == "SEND_F0.2:h>1"


def test_both_ends_of_every_sliced_message_agree_on_a_mixed_placement() -> None:
    """Stages 0 and 3 share rank 0: every SEND has its RECV, in order, per slice; h1 never crosses."""
    stage_rank = [0, 1, 1, 0]
    for name in ("gpipe", "1f1b"):
        schedule = make_schedule(name, stage_rank, 2, num_slices=3)
        lowered = Lowering(chain_dataflow(stage_rank), stage_rank).lower(schedule.global_order())
        for src, dst in ((0, 1), (1, 0)):
            sent = [_unit(c) for c in lowered[src] if _is(c, "SEND", dst)]
            received = [_unit(c) for c in lowered[dst] if _is(c, "RECV", src)]
            assert sent == received and len(sent) == 2 * 3 * (3 if src == 0 else 2), (name, src, dst)
        assert not any(isinstance(op, Comm) and op.value == "h1" for program in lowered.values() for op in program)


def _unit(comm: Comm) -> tuple[str, int, int | None, bool]:
    return comm.value, comm.microbatch_index, comm.slice_index, comm.backward


def test_a_backward_runs_whole_where_nothing_is_sent_before_its_weight_gradients() -> None:
    """zbv on the V: rank 0's stage 0 sends nothing backward, and after 0B2 its rank sends nothing
    more, so 0B2 and 0B3 run whole; every other B is followed by a SEND before its W."""
    stage_rank = [0, 1, 1, 0]
    order = make_schedule("zbv", stage_rank, 4).global_order()
    lowered = Lowering(chain_dataflow(stage_rank), stage_rank).lower(order)
    assert whole_backwards(lowered[0]) == {(0, 2, None), (0, 3, None)}
    assert whole_backwards(lowered[1]) == set()
    lowered = Lowering(CHAIN, [0, 1]).lower(make_schedule("zb-h1", [0, 1], 4).global_order())
    assert format_program(lowered[0]).endswith("0B3 0W3")
    assert whole_backwards(lowered[0]) == {(0, 3, None)}  # 0B2 is followed by 0F3 and its SEND
    assert whole_backwards(lowered[1]) == set()  # every B of the last stage sends h's gradient
