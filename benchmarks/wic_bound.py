"""Can any plan put T5-3B on WiC within 1.05 × ideal on 8 × RTX 2080 Ti? (issue 27's last gap)

The shipped plan (``partitions/t5-3b/rtx2080ti-x8-wic.json``, Mixed-Pipe, one stage per GPU) is
1.067 × ideal. This script decides the question in the cost model's own numbers (roofline,
``async``, 8 micro-batches, recomputation, 10% headroom: `hf_ftpipe.hub.setups`) over plans cut
between units (`_wic_units`: 48 encoder half-layers, 24 decoder layers, the head):

- A plan is an ordered list of stages, each a contiguous run of units on one GPU; a GPU may hold
  several stages, adjacent or not. A *run* is a maximal sequence of consecutive stages on one GPU:
  a plan with R runs sends each micro-batch across GPUs R − 1 times, and R = 8 means one
  contiguous piece per GPU. A GPU's time is the sum of its units' compute (whatever the stages),
  so whether some R-run plan has every GPU ≤ T × ideal is a question about runs alone.
- `runs_within` searches it exhaustively (depth-first over where each run ends and which GPU it
  goes to, GPUs labelled in order of first use; pruned by T per GPU, by the compute left against
  the room left, and by the fewest runs of ≤ T that can cover the rest). It finds none for R ≤ 10
  at T = 1.05, and prints the least T each R reaches.
- For R = 11 it lists plans with every GPU ≤ 1.05, splits their runs into stages until memory fits
  (`fit_memory`), prices each with `estimate` and simulates each with `hf_ftpipe.simulate`, beside
  the shipped plan.

    python benchmarks/wic_bound.py                    # a table, about 3 minutes (+ 1 to trace, cached)
    python benchmarks/wic_bound.py --json
    python benchmarks/wic_bound.py --max-plans 0      # every 11-run plan (5334; about 7 minutes)

The unit tables are checked against `estimate` on random plans first (exactly equal bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _wic_units import Stage, UnitTables, check_tables, unit_tables  # noqa: E402  (benchmarks/)
from partition_quality import traced_graph  # noqa: E402  (the cached trace)

from hf_ftpipe.costmodel.estimate import estimate, usable_capacity  # noqa: E402
from hf_ftpipe.hub.catalog import plan_request, plan_spec  # noqa: E402
from hf_ftpipe.plan.partition import Partition  # noqa: E402

PLAN = "t5-3b/rtx2080ti-x8-wic"
TARGET = 1.05
_EPS = 1e-12
Run = tuple[int, int, int]
"""``(first unit, last unit, GPU)``."""


def fewest_runs(compute: Sequence[float], limit: float) -> list[int]:
    """``f[p]``: the fewest runs of compute ≤ ``limit`` each that cover units p.. to the end."""
    n = len(compute)
    prefix = [0.0, *_accumulate(compute)]
    f = [math.inf] * (n + 1)
    f[n] = 0
    for p in range(n - 1, -1, -1):
        q = p + 1
        while q <= n and prefix[q] - prefix[p] <= limit + _EPS:
            f[p] = min(f[p], 1 + f[q])
            q += 1
    return f  # type: ignore[return-value]  # math.inf only where no run fits


def runs_within(
    compute: Sequence[float], limit: float, num_runs: int, num_gpus: int, *, max_plans: int = 1
) -> tuple[list[list[Run]], int]:
    """Plans of at most ``num_runs`` runs on ``num_gpus`` GPUs with every GPU's compute ≤ ``limit``
    (up to ``max_plans`` of them; 0 for all), and the search nodes visited. Exhaustive: an empty
    list proves there is none."""
    n = len(compute)
    prefix = [0.0, *_accumulate(compute)]
    fewest = fewest_runs(compute, limit)
    load = [0.0] * num_gpus
    runs: list[Run] = []
    found: list[list[Run]] = []
    visited = 0

    def extend(pos: int, used: int, last: int) -> bool:  # True: stop, enough plans
        nonlocal visited
        visited += 1
        if pos == n:
            found.append(list(runs))
            return 0 < max_plans <= len(found)
        if len(runs) + fewest[pos] > num_runs:
            return False
        if prefix[n] - prefix[pos] > math.fsum(limit - x for x in load) + _EPS:
            return False
        for end in range(pos + 1, n + 1):
            cost = prefix[end] - prefix[pos]
            if cost > limit + _EPS:
                break
            if len(runs) + 1 + fewest[end] > num_runs:
                continue
            for gpu in range(min(used + 1, num_gpus)):  # a new GPU is the lowest unused one
                if gpu == last or load[gpu] + cost > limit + _EPS:
                    continue
                load[gpu] += cost
                runs.append((pos, end - 1, gpu))
                stop = extend(end, max(used, gpu + 1), gpu)
                runs.pop()
                load[gpu] -= cost
                if stop:
                    return True
        return False

    extend(0, 0, -1)
    return found, visited


def least_limit(
    compute: Sequence[float], num_runs: int, num_gpus: int, *, low: float = 1.0, high: float = 1.2
) -> float:
    """The least per-GPU compute (in units of the ideal, to 1e-6) that some plan of ≤ ``num_runs`` runs reaches."""
    while high - low > 1e-6:
        middle = (low + high) / 2
        if runs_within(compute, middle, num_runs, num_gpus)[0]:
            high = middle
        else:
            low = middle
    return high


def fit_memory(
    tables: UnitTables, runs: Sequence[Run], capacity: int, schedule: str, num_microbatches: int
) -> list[Stage] | None:
    """Stages for ``runs`` that fit ``capacity`` on every GPU, or None: each run starts as one
    stage; the encoder runs of a GPU over capacity are cut into layers, then into half-layers
    (recomputing one small stage at a time instead of the whole run), until none is over."""
    split = [0] * len(runs)
    while True:
        stages = [s for run, level in zip(runs, split, strict=True) for s in _split(run, level, tables)]
        memory = tables.gpu_memory(stages, schedule, num_microbatches)
        over = {d for d, m in enumerate(memory) if m > capacity}
        if not over:
            return stages
        finer = [
            i for i, (a, _, d) in enumerate(runs) if d in over and split[i] < 2 and tables.names[a].startswith("enc")
        ]
        if not finer:
            return None
        for i in finer:
            split[i] += 1


def _split(run: Run, level: int, tables: UnitTables) -> list[Stage]:
    a, b, d = run
    encoder = [u for u in range(a + 1, b + 1) if tables.names[u].startswith("enc")]
    cuts = [] if level == 0 else [u for u in encoder if level == 2 or tables.names[u].endswith("attn")]
    edges = [a, *cuts, b + 1]
    return [(edges[i], edges[i + 1] - 1, d) for i in range(len(edges) - 1)]


def _accumulate(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def priced(tables: UnitTables, stages: Sequence[Stage], request: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A plan's figures from `estimate` and `simulate` (the judges, not the tables)."""
    node_stage = tables.node_stage(stages)
    stage_device = [d for _, _, d in stages]
    prediction = estimate(tables.graph, node_stage, stage_device, request.profile, **options)
    plan = Partition(
        node_stage=node_stage,
        stage_device=stage_device,
        partitioner="wic-bound",
        key=request.key_for(tables.graph),
        predicted=prediction,
    )
    return _figures(plan, tables, request) | {"stages": [list(s) for s in stages]}


def _figures(plan: Partition, tables: UnitTables, request: Any) -> dict[str, Any]:
    from hf_ftpipe.simulator import simulate

    prediction = plan.predicted
    assert prediction is not None  # every plan here is priced
    sim = simulate(plan, graph=tables.graph)
    capacity = usable_capacity(request.profile, request.memory)
    devices = plan.stage_device
    return {
        "worst_over_ideal": prediction.step_time_s / prediction.ideal_step_time_s,
        "fits": all(g.memory_bytes <= capacity for g in prediction.gpus),
        "peak_gib": max(g.memory_bytes for g in prediction.gpus) / 2**30,
        "num_stages": len(devices),
        "num_runs": 1 + sum(1 for s in range(1, len(devices)) if devices[s] != devices[s - 1]),
        "simulated_step_s": sim.step_time_s,
        "simulated_bubble": sim.bubble_fraction,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-plans", type=int, default=1500, help="11-run plans to list (0: all)")
    parser.add_argument("--unsplit", type=int, default=10, help="11-run plans to simulate as one stage per run")
    parser.add_argument("--check-trials", type=int, default=30, help="random plans to check the tables on")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "hf_ftpipe_bench_graphs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()

    spec = plan_spec(PLAN)
    request = plan_request(spec)
    options = {k: v for k, v in request.options().items() if k not in ("key", "cost_table")}
    graph = traced_graph(spec.setup, args.cache_dir)
    tables = unit_tables(graph, request.profile, spec.setup.optimizer, spec.num_gpus)
    drift = check_tables(tables, request.profile, options, trials=args.check_trials)
    capacity = usable_capacity(request.profile, request.memory)

    shipped = Partition.from_json(Path(__file__).resolve().parents[1] / "partitions" / f"{PLAN}.json")
    shipped.check_matches(graph)
    shipped_figures = _figures(shipped, tables, request)

    by_runs = []
    for num_runs in (8, 9, 10):
        found, visited = runs_within(tables.compute, TARGET, num_runs, spec.num_gpus)
        least = least_limit(tables.compute, num_runs, spec.num_gpus)
        by_runs.append({"max_runs": num_runs, "within_target": bool(found), "nodes": visited, "least_worst": least})
    plans, visited = runs_within(tables.compute, TARGET, 11, spec.num_gpus, max_plans=args.max_plans)
    fitted = [s for s in (fit_memory(tables, r, capacity, "async", spec.num_microbatches) for r in plans) if s]
    candidates = [priced(tables, stages, request, options) for stages in fitted]
    candidates.sort(key=lambda c: c["simulated_step_s"])
    # The revisits alone: the first plans listed, one stage per run (most over memory, so not plans to run).
    unsplit = [priced(tables, runs, request, options)["simulated_step_s"] for runs in plans[: args.unsplit]]
    by_runs.append(
        {
            "max_runs": 11,
            "within_target": bool(plans),
            "nodes": visited,
            "plans_listed": len(plans),
            "plans_that_fit": len(candidates),
            "least_worst_that_fits": min((c["worst_over_ideal"] for c in candidates), default=None),
            "unsplit_simulated_step_s": [min(unsplit), max(unsplit)] if unsplit else None,
        }
    )
    report = {
        "plan": PLAN,
        "target": TARGET,
        "num_units": tables.num_units,
        "tables_checked_on": args.check_trials,
        "tables_compute_drift": drift,
        "unsplit": args.unsplit,
        "shipped": shipped_figures,
        "by_runs": by_runs,
        "best_simulated": candidates[0] if candidates else None,
        "time_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report, candidates)
    return 0


def _print(report: dict[str, Any], candidates: list[dict[str, Any]]) -> None:
    checked = report["tables_checked_on"]
    print(f"{report['plan']}: {report['num_units']} units; tables equal estimate on {checked} random plans")
    print(f"{'runs ≤':>7} {'≤ 1.05':>7} {'least worst/ideal':>18} {'search nodes':>13}")
    for row in report["by_runs"]:
        least = row.get("least_worst", row.get("least_worst_that_fits"))
        least_text = "-" if least is None else f"{least:.4f}"
        print(f"{row['max_runs']:>7} {'yes' if row['within_target'] else 'no':>7} {least_text:>18} {row['nodes']:>13}")
    last = report["by_runs"][-1]
    print(f"11 runs: {last['plans_listed']} plans ≤ {report['target']} listed, {last['plans_that_fit']} fit memory")
    if last["unsplit_simulated_step_s"]:
        low, high = last["unsplit_simulated_step_s"]
        print(f"the first {report['unsplit']}, one stage per run, memory aside: simulated {low:.2f} to {high:.2f} s")
    print(
        f"\n{'plan':<22} {'worst/ideal':>11} {'stages':>6} {'runs':>4} {'peak GiB':>8} {'sim step s':>10} {'bubble':>6}"
    )
    rows = [("shipped", report["shipped"])] + [(f"11-run #{i + 1}", c) for i, c in enumerate(candidates[:5])]
    for name, c in rows:
        print(
            f"{name:<22} {c['worst_over_ideal']:>11.4f} {c['num_stages']:>6} {c['num_runs']:>4} "
            f"{c['peak_gib']:>8.2f} {c['simulated_step_s']:>10.3f} {c['simulated_bubble']:>6.1%}"
        )
    if report["best_simulated"]:
        print(
            f"best simulated 11-run plan, (first unit, last unit, GPU) per stage: {report['best_simulated']['stages']}"
        )
    print(f"{report['time_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
