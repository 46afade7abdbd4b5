"""Split-backward schedules in time: B and W priced apart, timelines worked out by hand.

As in test_timelines: a forward 1 s, a backward 2 s (under a split backward B 1 s and W 1 s, half
each by default), free links. ``0W0@6-7`` is stage 0's weight gradients of micro-batch 0.
"""

from __future__ import annotations

import pytest
from test_timelines import timeline, toy

from hf_ftpipe.errors import PartitionError
from hf_ftpipe.simulator import PipelineCosts, StageEdge, simulate_costs


def test_zb_h1_two_ranks_four_microbatches() -> None:
    # Rank 0 warms up with 2 forwards; 0B0 waits for 1B0 (3 s). At 6 s rank 0 keeps 3 micro-batches
    # between F and W (0F3 would make 4) and nothing else is ready: 0W0. Rank 1 waits for 0F3 from
    # 7 s to 9 s and fills it with 1W0 1W1. 13 s: 1F1B's 15 s less the (P − 1) × W it hides.
    result = simulate_costs(toy([0, 1]), "zb-h1", 4)
    assert timeline(result) == {
        0: "0F0@0-1 0F1@1-2 0B0@3-4 0F2@4-5 0B1@5-6 0W0@6-7 0B2@7-8 0F3@8-9 0W1@9-10 0W2@10-11 0B3@11-12 0W3@12-13",
        1: "1F0@1-2 1B0@2-3 1F1@3-4 1B1@4-5 1F2@5-6 1B2@6-7 1W0@7-8 1W1@8-9 1F3@9-10 1B3@10-11 1W2@11-12 1W3@12-13",
    }
    assert result.step_time_s == 13 and result.busy_s == [12, 12]
    assert simulate_costs(toy([0, 1]), "1f1b", 4).step_time_s == 15


def test_b_and_w_take_the_given_weight_share_of_the_backward() -> None:
    costs = PipelineCosts(
        stage_rank=[0], forward_s=[1.0], backward_s=[3.0], weight_s=[2.0], edges=[], activation_bytes=[10],
        weight_kept_bytes=[4],
    )  # fmt: skip
    result = simulate_costs(costs, "zb-h1", 2)
    # One stage holds one micro-batch between F and B (1F1B's depth rule), two between F and W.
    assert timeline(result) == {0: "0F0@0-1 0B0@1-2 0F1@2-3 0B1@3-4 0W0@4-6 0W1@6-8"}
    # Each F adds 10 B; a B frees them but keeps 4 B for its W, which frees those.
    assert [b for _, b in result.memory[0]] == [0, 10, 4, 14, 8, 4, 0]
    with pytest.raises(PartitionError, match=r"`weight_s` \[4.0\] is a part of `backward_s` \[3.0\]: never more"):
        PipelineCosts(stage_rank=[0], forward_s=[1.0], backward_s=[3.0], weight_s=[4.0], edges=[])


def test_zbv_is_shorter_than_1f1b_on_equal_stages() -> None:
    # The same model on 2 GPUs: 4 equal stages of 0.5 s forward and 1 s backward in a V, or 2 of 1 s
    # and 2 s. Without a bubble a GPU works M × 3 s = 12 s.
    v = toy([0, 1, 1, 0], forward_s=0.5, backward_s=1.0)
    zbv = simulate_costs(v, "zbv", 4).step_time_s
    assert zbv < simulate_costs(v, "1f1b", 4).step_time_s
    assert zbv < simulate_costs(toy([0, 1]), "1f1b", 4).step_time_s == 15
    assert zbv == 12.5


def test_interleaved_1f1b_on_a_looped_placement_beats_1f1b_on_the_same_stages() -> None:
    looped = toy([0, 1, 0, 1], forward_s=0.5, backward_s=1.0)
    assert simulate_costs(looped, "interleaved-1f1b", 4).step_time_s < simulate_costs(looped, "1f1b", 4).step_time_s


def test_a_schedule_that_refuses_the_placement_says_so() -> None:
    chain = [StageEdge(0, 1, 8, 8)]
    with pytest.raises(PartitionError, match=r"cannot simulate this pipeline: the 'zbv' schedule runs a V placement"):
        simulate_costs(PipelineCosts(stage_rank=[0, 1], forward_s=[1, 1], backward_s=[2, 2], edges=chain), "zbv", 4)
