"""The lowering: each rank's program with its SENDs and RECVs, asserted literally, without processes."""

from hf_ftpipe.schedules import make_schedule
from hf_ftpipe.schedules.lowering import Comm, Dataflow, Lowering, Route, format_program

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
