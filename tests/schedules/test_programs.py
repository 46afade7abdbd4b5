"""A rank's programs per step, asserted literally without processes: a step with another number of
token slices, and a short batch, run the programs every rank derives alike from the step alone."""

from __future__ import annotations

from hf_ftpipe.schedules import make_schedule
from hf_ftpipe.schedules.lowering import Dataflow, Route, format_program
from hf_ftpipe.schedules.programs import RankPrograms

# Stage 0 on rank 0 sends h to stage 1 on rank 1, which computes the loss and copies it to rank 0.
CHAIN = Dataflow(
    sent=[["h"], ["loss"]],
    received=[[], ["h"]],
    consumers={"h": [1], "loss": []},
    routes={"h": Route("h", 0, 0, [1], [1], True), "loss": Route("loss", 1, 1, [0], [], False)},
)


def test_a_step_of_fewer_slices_runs_the_program_of_that_many() -> None:
    """Planned for 3 slices per sequence; a shorter step cut into 1, then 2 micro-batches' worth of 2."""
    programs = {rank: RankPrograms(make_schedule("1f1b", [0, 1], 2, num_slices=3), CHAIN, rank) for rank in (0, 1)}
    one = {
        rank: format_program(p.flushing(training=True, microbatches=1, num_slices=1)) for rank, p in programs.items()
    }
    assert one == {
        0: "0F0.0 SEND_F0.0:h>1 RECV_F0.0:loss<1 RECV_B0.0:h<1 0B0.0",
        1: "RECV_F0.0:h<0 1F0.0 SEND_F0.0:loss>0 1B0.0 SEND_B0.0:h>0",
    }
    two = {
        rank: format_program(p.flushing(training=True, microbatches=2, num_slices=2)) for rank, p in programs.items()
    }
    # 1F1B over 2 slices: stage 0 holds up to 3 (S - s + k - 1); a sequence's slices go backward last-first
    assert two == {
        0: "0F0.0 SEND_F0.0:h>1 0F0.1 SEND_F0.1:h>1 RECV_F0.0:loss<1 0F1.0 SEND_F1.0:h>1 RECV_F0.1:loss<1 "
        "RECV_B0.1:h<1 0B0.1 RECV_F1.0:loss<1 RECV_B0.0:h<1 0F1.1 SEND_F1.1:h>1 0B0.0 RECV_F1.1:loss<1 "
        "RECV_B1.1:h<1 0B1.1 RECV_B1.0:h<1 0B1.0",
        1: "RECV_F0.0:h<0 RECV_F0.1:h<0 1F0.0 SEND_F0.0:loss>0 RECV_F1.0:h<0 1F0.1 SEND_F0.1:loss>0 1B0.1 "
        "SEND_B0.1:h>0 1F1.0 SEND_F1.0:loss>0 1B0.0 SEND_B0.0:h>0 RECV_F1.1:h<0 1F1.1 SEND_F1.1:loss>0 1B1.1 "
        "SEND_B1.1:h>0 1B1.0 SEND_B1.0:h>0",
    }
    planned = format_program(programs[0].flushing(training=True, microbatches=2))
    assert planned.count("0F") == 6 and "0F1.2" in planned, "the planned number is still its own program"
