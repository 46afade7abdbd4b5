"""`hf-ftpipe push`, `list` and `pull` against the loopback Hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.partitioners import partition_seq_greedy
from hf_ftpipe.plan import Partition

from toy_graphs import UNIT, chain

REPO = "ftpipe/plans"


def _plan(num_gpus: int) -> Partition:
    return partition_seq_greedy(
        chain([3, 1, 4, 1, 5, 9]), UNIT.with_count(num_gpus), 2, num_microbatches=4, microbatch_size=2
    )


def test_push_list_and_pull_round_trip(hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = {n: _plan(n) for n in (2, 3)}
    for n, plan in plans.items():
        plan.to_json(tmp_path / f"plan{n}.json")
        assert cli.main(["push", str(tmp_path / f"plan{n}.json"), "--repo", REPO]) == 0
        assert "pushed hf://datasets/ftpipe/plans/plans/v2/ToyModel/" in capsys.readouterr().out

    assert cli.main(["list", "--repo", REPO]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["model", "fingerprint", "GPUs"] and table[-1] == f"2 plan(s) in {REPO}"
    assert cli.main(["list", "--repo", REPO, "--json", "--model", "ToyModel"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(row["num_gpus"] for row in rows) == [2, 3]

    # Two plans match the model and profile: pull refuses to guess, and names them.
    assert cli.main(["pull", "--repo", REPO, "--model", "ToyModel", "--gpu-profile", "unit"]) == 2
    err = capsys.readouterr().err
    assert "2 plans in ftpipe/plans match model=ToyModel, gpu_profile=unit" in err and "--gpus" in err
    out = tmp_path / "pulled.json"
    assert cli.main(["pull", "--repo", REPO, "--model", "ToyModel", "--gpus", "3", "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith("pulled hf://datasets/ftpipe/plans@main/plans/v2/ToyModel/")
    assert Partition.from_json(out).to_dict() == plans[3].to_dict()
    assert cli.main(["pull", "--repo", REPO, "--key", plans[2].key.digest()[:8]]) == 0
    assert json.loads(capsys.readouterr().out) == plans[2].to_dict()


def test_errors_are_one_line_and_status_2(hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list", "--repo", "nobody/nothing"]) == 2
    assert "dataset repo nobody/nothing not found" in capsys.readouterr().err
    hub.fail_with(500)
    _plan(2).to_json(tmp_path / "plan.json")
    assert cli.main(["pull", "--repo", REPO, "--path", "plans/v1/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-ftpipe pull: error: hf://datasets/ftpipe/plans@main/plans/v1/x.json: cannot read it")
    assert "Traceback" not in err


def test_a_pull_that_matches_nothing_says_how_to_see_what_there_is(
    hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _plan(2).to_json(tmp_path / "plan.json")
    assert cli.main(["push", str(tmp_path / "plan.json"), "--repo", REPO]) == 0
    capsys.readouterr()
    assert cli.main(["pull", "--repo", REPO, "--model", "ToyModel", "--gpus", "7"]) == 2
    err = capsys.readouterr().err
    assert "no plan in ftpipe/plans matches model=ToyModel, num_gpus=7\n" in err
    assert "`hf-ftpipe list --repo ftpipe/plans` shows the plans there: pull one by its --key" in err
    assert "Narrow it down" not in err  # the hint for several matches


def test_list_offline_says_it_read_only_the_download_cache(
    hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plans = [_plan(2), _plan(3)]
    for n, plan in enumerate(plans):
        plan.to_json(tmp_path / f"plan{n}.json")
        assert cli.main(["push", str(tmp_path / f"plan{n}.json"), "--repo", REPO]) == 0
    assert cli.main(["pull", "--repo", REPO, "--key", plans[0].key.digest()]) == 0  # now in the download cache
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["list", "--repo", REPO]) == 0
    out = capsys.readouterr().out
    cached = "in the local download cache: HF_HUB_OFFLINE is set, so the Hub was not asked"
    assert out.splitlines()[-1] == f"1 plan(s) in {REPO} {cached}"
    assert cli.main(["pull", "--repo", REPO, "--gpus", "3"]) == 2
    assert f"no plan in {REPO} matches num_gpus=3 {cached}" in capsys.readouterr().err
