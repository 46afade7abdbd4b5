"""AgreedLossScaler: GradScaler's rule on a decision all ranks share."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ftpipe.trainer.loss_scale import AgreedLossScaler

from distributed import run_ranks, values_or_raise


def _param(*values: float) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = torch.tensor(values)
    return param


def test_unscale_divides_and_the_rule_backs_off_and_grows() -> None:
    scaler = AgreedLossScaler(init_scale=8.0, growth_interval=2)
    param = _param(8.0, -16.0)
    assert scaler.unscale_([param], lambda found: None) is False
    assert param.grad.tolist() == [1.0, -2.0]
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0 and scaler.good_steps == 0
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.skipped_steps == 1
    assert scaler.unscale_([_param(1.0, float("inf"))], lambda found: None) is True
    assert scaler.unscale_([_param(float("nan"))], lambda found: None) is True


def test_another_ranks_overflow_counts_and_state_round_trips() -> None:
    scaler = AgreedLossScaler(init_scale=4.0)
    assert scaler.unscale_([_param(1.0)], lambda found: found.fill_(1.0)) is True
    scaler.update(True)
    restored = AgreedLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() and restored.scale == 2.0


@pytest.mark.parametrize("settings", [{"init_scale": 0.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}])
def test_bad_settings_are_refused(settings: dict) -> None:
    with pytest.raises(ValueError):
        AgreedLossScaler(**settings)


def _one_rank_overflows(rank: int, world_size: int) -> bool:
    grad = float("inf") if rank == 1 else 1.0
    return AgreedLossScaler().unscale_([_param(grad)], lambda found: dist.all_reduce(found, op=dist.ReduceOp.MAX))


@pytest.mark.distributed
def test_every_rank_skips_when_one_overflows() -> None:
    assert values_or_raise(run_ranks(_one_rank_overflows, 2)) == [True, True]
