"""`hf-ftpipe profile` writes a measured cost table that `partition --costs` and `show --costs` price with."""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import transformers

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.costmodel.measured import CostTable, cache_path


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_profile_then_plan_and_show_with_measured_costs(tmp_path: Path) -> None:
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=4, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.to_json_file(tmp_path / "config.json")
    model, costs = str(tmp_path / "config.json"), str(tmp_path / "measured.json")
    shape = ["--batch-size", "2", "--seq-len", "8"]

    code, out, err = run("profile", model, *shape, "--repeats", "1", "--warmup", "1", "--out", costs, "--json")
    assert code == 0, err
    assert "6 blocks, 3 to time (the rest repeat one)" in err
    printed = json.loads(out)
    assert [(r["block"], r["count"]) for r in printed["blocks"]] == [
        ("transformer", 1),
        ("transformer.h.0", 4),
        ("transformer.ln_f", 1),
    ]
    table = CostTable.load(costs)
    assert Path(printed["cached"]) == cache_path(table.key) and cache_path(table.key).is_file()

    plan_args = ["partition", model, *shape, "--gpus", "2", "--gpu-profile", "a100-80gb", "--partitioner", "seq-dp"]
    code, out, err = run(*plan_args, "--costs", costs, "-o", str(tmp_path / "measured-plan.json"))
    assert code == 0, err
    assert f"on 2 × a100-80gb; op times measured ({costs})" in out
    measured_plan = json.loads((tmp_path / "measured-plan.json").read_text())
    node_costs = table.node_costs()
    stage0 = [n for n, s in measured_plan["node_stage"].items() if s == 0]
    assert math.isclose(
        measured_plan["predicted"]["stages"][0]["forward_s"], math.fsum(node_costs[n].forward_s for n in stage0)
    )

    # show: the plan as it was priced, then by a table where the layers run 3x slower
    plan = str(tmp_path / "measured-plan.json")
    slower = replace(
        table, blocks=[replace(b, forward_s=3 * b.forward_s) if "h." in b.name else b for b in table.blocks]
    )
    slower.save(tmp_path / "slower.json")
    _, before_out, _ = run("show", plan, "--json")
    code, after_out, err = run("show", plan, "--costs", str(tmp_path / "slower.json"), "--json")
    assert code == 0, err
    before, after = json.loads(before_out), json.loads(after_out)
    for g, gpu in enumerate(after["gpus"]):
        stage = [n for n, s in measured_plan["node_stage"].items() if s == g]
        assert math.isclose(gpu["compute_ms"], 1e3 * math.fsum(slower.node_costs()[n].total_s for n in stage))
        # a GPU without layers keeps its time (noisy timings on a busy machine can make such a plan)
        assert gpu["compute_ms"] >= before["gpus"][g]["compute_ms"] * (1 - 1e-12)  # the same sum, in another order
    assert sum(g["compute_ms"] for g in after["gpus"]) > sum(g["compute_ms"] for g in before["gpus"])
    assert after["ideal_step_time_ms"] > before["ideal_step_time_ms"]
    _, before_out, _ = run("simulate", plan, "--json")
    code, after_out, err = run("simulate", plan, "--costs", str(tmp_path / "slower.json"), "--json")
    assert code == 0, err
    assert json.loads(after_out)["step_time_s"] > json.loads(before_out)["step_time_s"]

    code, _, err = run("show", plan, "--costs", str(tmp_path / "config.json"))
    assert code == 2 and "not a cost table: field 'format' is missing" in err
