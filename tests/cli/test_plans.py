"""`hf-ftpipe show`, `profiles`, `regenerate-partitions` and `publish-partitions`.

`show` reads a plan file alone, so these tests use the plans shipped in ``partitions/``: the
paper's T5-3B BoolQ plan (one stage per GPU) and the 8 × A100 one (2-3 stages per GPU).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.costmodel import list_profiles
from hf_ftpipe.hub.catalog import _would_fit, read_index
from hf_ftpipe.plan import Partition

FOLDER = Path(__file__).resolve().parents[2] / "partitions"
PAPER_PLAN = FOLDER / "t5-3b" / "rtx2080ti-x8-boolq.json"
MIXED_PLAN = FOLDER / "t5-3b" / "a100-80gb-x8-boolq.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def table_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header`` (cells split on 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line or line.startswith(" "):
            break
        rows.append([cell for cell in line.split("  ") if cell.strip()])
    return rows


def test_show_prints_every_gpu_and_stage_with_the_predicted_figures() -> None:
    plan = Partition.from_json(MIXED_PLAN)
    code, out, err = run("show", str(MIXED_PLAN))
    assert code == 0, err
    predicted = plan.predicted
    assert f"predicted: {predicted.throughput_samples_per_s:.2f} samples/s" in out
    assert f"worst GPU / ideal {predicted.worst_over_ideal:.3f}" in out
    gpus = table_rows(out, "GPU ")
    assert len(gpus) == plan.num_devices
    slowest = max(range(plan.num_devices), key=lambda g: predicted.gpus[g].cost_s)
    assert [row[0].strip() for row in gpus].index(f"{slowest} *") == slowest
    for g, row in enumerate(gpus):
        assert row[1].strip() == ",".join(_runs(plan.stages_on(g)))
        assert float(row[3]) == pytest.approx(predicted.gpus[g].compute_s * 1e3, abs=0.06)
        assert float(row[6]) == pytest.approx(predicted.gpus[g].cost_s * 1e3, abs=0.06)
    stages = table_rows(out, "stage ")
    assert [int(row[1]) for row in stages] == plan.stage_device
    feeds = {s: sorted(t for src, t, _ in predicted.stage_edges if src == s) for s in range(plan.num_stages)}
    assert feeds[0] and all(row[-1].strip() != "-" for row in stages[:-1])  # every stage but the last feeds one
    assert max(len(plan.stages_on(g)) for g in range(plan.num_devices)) > 1  # a Mixed-Pipe placement


def _runs(values: list[int]) -> list[str]:
    """The expected rendering of a sorted list: consecutive values as ``a-b``."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return [str(a) if a == b else f"{a}-{b}" for a, b in out]


def test_show_json_carries_the_plan_figures() -> None:
    plan = Partition.from_json(PAPER_PLAN)
    code, out, err = run("show", str(PAPER_PLAN), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["partitioner"] == plan.partitioner and summary["key"] == plan.key.to_dict()
    assert summary["throughput_samples_per_s"] == pytest.approx(plan.predicted.throughput_samples_per_s)
    assert [g["cost_ms"] for g in summary["gpus"]] == pytest.approx([g.cost_s * 1e3 for g in plan.predicted.gpus])
    assert sum(g["num_ops"] for g in summary["gpus"]) == len(plan.node_stage)
    assert [(e["source"], e["destination"]) for e in summary["stage_edges"]] == [
        (s, t) for s, t, _ in plan.predicted.stage_edges
    ]
    for gpu in summary["gpus"]:  # the memory parts add up to the total
        parts = gpu["weights_gib"] + gpu["gradients_gib"] + gpu["optimizer_gib"] + gpu["activations_gib"]
        assert parts == pytest.approx(gpu["memory_gib"])


def test_show_plot_writes_a_png_of_both_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    path = tmp_path / "plan.png"
    code, out, err = run("show", str(MIXED_PLAN), "--plot", str(path))
    assert code == 0, err
    assert f"wrote {path}" in out
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000
    pixels = matplotlib.image.imread(path)
    height, width = pixels.shape[:2]
    assert width > 2 * height > 600  # two panels side by side
    colors = {tuple(p) for p in pixels[::4, ::4, :3].reshape(-1, 3).round(2).tolist()}
    assert len(colors) > 20  # bars and nodes in a colour per GPU, not a blank canvas


def test_show_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, _, err = run("show", str(PAPER_PLAN), "--plot", str(tmp_path / "plan.png"))
    assert code == 2 and 'pip install "hf_ftpipe[plot]"' in err
    assert not (tmp_path / "plan.png").exists()


def test_show_refuses_a_file_that_is_not_a_plan_or_has_no_prediction(tmp_path: Path) -> None:
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"model_type": "t5"}))
    code, _, err = run("show", str(other))
    assert code == 2 and "not a partition file" in err and str(other) in err
    bare = tmp_path / "bare.json"
    data = json.loads(PAPER_PLAN.read_text())
    bare.write_text(json.dumps({**data, "predicted": None}))
    code, _, err = run("show", str(bare))
    assert code == 2 and "no prediction" in err


def test_profiles_lists_every_built_in_profile() -> None:
    code, out, _ = run("profiles")
    assert code == 0
    rows = table_rows(out, "name ")
    assert [row[0].strip() for row in rows] == [p.name for p in list_profiles()]
    l4 = next(row for row in rows if row[0].strip() == "l4")
    assert [cell.strip() for cell in l4[1:4]] == ["24", "30", "121"]  # GiB, fp32 and fp16 TFLOP/s
    code, out, _ = run("profiles", "--json")
    assert code == 0
    expected = [{k: v for k, v in p.to_dict().items() if k != "count"} for p in list_profiles()]
    assert json.loads(out) == expected


def test_would_fit_takes_memory_and_gpu_count_from_the_advice() -> None:
    assert _would_fit(13.24 * 2**30, 9, "rtx2080ti") == "≥ 13.24 GiB per GPU, or 9 × rtx2080ti"
    assert _would_fit(13.24 * 2**30, None, "rtx2080ti") == "≥ 13.24 GiB per GPU"
    assert _would_fit(None, None, "l4") is None


def test_publish_refuses_a_folder_that_was_never_generated(tmp_path: Path) -> None:
    code, _, err = run("publish-partitions", "someone/plans", "--folder", str(tmp_path))
    assert code == 2 and "index.json" in err and "regenerate-partitions" in err


def test_regenerate_names_the_valid_plans_for_an_unknown_one(tmp_path: Path) -> None:
    code, _, err = run("regenerate-partitions", "--folder", str(tmp_path), "--only", "t5-3b/tpu-x8-boolq")
    assert code == 2 and "t5-3b/rtx2080ti-x8-boolq" in err
    assert not (tmp_path / "index.json").exists()


@pytest.mark.slow
def test_regenerate_remakes_a_shipped_plan_identically(tmp_path: Path) -> None:
    name = "bert-large/rtx4090-x4-squad"  # the quickest to trace and plan (~10 s)
    code, out, err = run("regenerate-partitions", "--folder", str(tmp_path), "--only", name)
    assert code == 0, err
    assert f"{name}: mixed" in err and "1 plan; every setup fits its GPUs." in out
    made, shipped = (json.loads((f / f"{name}.json").read_text()) for f in (tmp_path, FOLDER))
    for data in (made, shipped):
        data.pop("versions"), data.pop("created_at")  # the library versions differ between machines
    assert made == shipped
    (entry,) = read_index(tmp_path)
    assert entry == next(e for e in read_index(FOLDER) if e["name"] == name)
    assert entry["file"] in (tmp_path / "README.md").read_text()


def test_show_reads_a_plan_written_before_stage_edges_were_recorded(tmp_path: Path) -> None:
    data = json.loads(PAPER_PLAN.read_text())
    del data["predicted"]["stage_edges"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    code, out, err = run("show", str(old))
    assert code == 0, err
    assert "predates recorded stage edges" in out
    assert all(row[-1].strip() == "-" for row in table_rows(out, "stage "))
