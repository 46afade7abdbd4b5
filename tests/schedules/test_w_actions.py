"""The split backward: ``W`` actions (weight gradients) parsed, checked for order and lowered without messages."""

import pytest

from hf_ftpipe.schedules import Action, chain_edges, check_order
from hf_ftpipe.schedules.actions import dependencies
from hf_ftpipe.schedules.lowering import Lowering, chain_dataflow, format_program


def parse(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


@pytest.mark.parametrize("text", ["1W3", "0W0.2"])
def test_a_weight_gradient_action_round_trips_through_text(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text and action.computation == "W"


def test_a_weight_gradient_depends_on_its_backward_only() -> None:
    producers, consumers = [[], [0]], [[1], []]
    assert dependencies(Action.parse("0W1"), producers, consumers) == [Action.parse("0B1")]
    assert dependencies(Action.parse("0B1"), producers, consumers) == parse("0F1 1B1")


def test_check_order_wants_one_w_after_each_b_under_a_split_backward() -> None:
    ok = parse("0F0 1F0 1B0 0B0 1W0 0W0")
    check_order(ok, [0, 1], chain_edges(2), range(1), split_backward=True)
    with pytest.raises(ValueError, match="0W0 comes before 0B0, which it depends on"):
        check_order(parse("0F0 1F0 1B0 0W0 0B0 1W0"), [0, 1], chain_edges(2), range(1), split_backward=True)
    with pytest.raises(ValueError, match=r"the order misses 1 actions, e.g. \['1W0'\]"):
        check_order(parse("0F0 1F0 1B0 0B0 0W0"), [0, 1], chain_edges(2), range(1), split_backward=True)
    with pytest.raises(ValueError, match="1W0 appears twice"):
        check_order(ok + parse("1W0"), [0, 1], chain_edges(2), range(1), split_backward=True)
    with pytest.raises(ValueError, match="1W0 is a weight-gradient action, but this schedule does not split"):
        check_order(ok, [0, 1], chain_edges(2), range(1))


def test_a_weight_gradient_is_local_and_the_backward_sends_the_input_gradient() -> None:
    order = parse("0F0 1F0 1B0 0B0 1W0 0W0")
    lowered = Lowering(chain_dataflow([0, 1]), [0, 1]).lower(order)
    assert format_program(lowered[0]) == "0F0 SEND_F0:h0>1 RECV_F0:loss<1 RECV_B0:h0<1 0B0 0W0"
    assert format_program(lowered[1]) == "RECV_F0:h0<0 1F0 SEND_F0:loss>0 1B0 SEND_B0:h0>0 1W0"
