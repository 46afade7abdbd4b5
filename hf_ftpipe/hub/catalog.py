"""The ``partitions/`` folder: shipped plans for the setups in ``setups.py``, their index and card.

``regenerate`` traces each setup's model on the meta device, runs every partitioner as `auto`
does (no time budget, so the winner does not depend on how busy the machine is) and writes:

- ``<model>/<profile>-x<count>-<task>.json``: the winning plan (the normal Partition JSON, key
  included), for every setup that fits;
- ``index.json``: one entry per setup: its options, the key's digest, which partitioner won and
  the predicted figures, or why nothing fits and what would (`auto.no_plan_fits`);
- ``README.md``: the Hub dataset card, its table rendered from the index (``render_card``).

``publish`` uploads the folder to a Hub dataset repository. Command line::

    hf-ftpipe regenerate-partitions [--folder partitions] [--only t5-3b/rtx2080ti-x8-rte ...]
    hf-ftpipe publish-partitions USER/REPO [--folder partitions] [--private]

Importing this module is cheap: tracing (transformers) is imported when a setup is traced.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hf_ftpipe._units import GiB, format_bytes
from hf_ftpipe.costmodel.estimate import MemoryOptions
from hf_ftpipe.costmodel.profiles import GPUProfile, get_profile
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.hub.setups import SHIPPED_PLANS, FineTuningTask, PlanSpec
from hf_ftpipe.partitioners.auto import best_result, compare_partitioners, no_plan_fits
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.request import PlanRequest

__all__ = [
    "INDEX_FILE",
    "GraphCache",
    "count_line",
    "partitioner_options",
    "plan_request",
    "make_entry",
    "plan_spec",
    "profile_of",
    "publish",
    "read_index",
    "regenerate",
    "render_card",
]

INDEX_FILE = "index.json"
CARD_FILE = "README.md"
_INDEX_VERSION = 1
_NO_BUDGET_S = math.inf  # `auto` with a budget could skip a partitioner on a slow machine


class GraphCache:
    """Each setup's traced CostGraph: each model exported once, measured at each setup's shape
    (`hf_ftpipe.graph.trace.measure_at`; setups with equal shapes share one graph)."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self._graphs: dict[tuple[str, int, int, int | None], CostGraph] = {}
        self._captures: dict[str, tuple[Any, Any]] = {}
        self._log = log

    def __call__(self, setup: FineTuningTask) -> CostGraph:
        from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for
        from hf_ftpipe.graph.trace import capture_model, measure_at

        cache_key = (setup.model, setup.microbatch_size, setup.seq_len, setup.target_len)
        if cache_key not in self._graphs:
            started = time.perf_counter()
            if setup.model in self._captures:
                model, traced = self._captures[setup.model]
                inputs = sample_inputs_for(model, setup.microbatch_size, setup.seq_len, setup.target_len)
                self._graphs[cache_key] = measure_at(model, traced, inputs)
            else:
                model = load_model_for_planning(setup.model)
                inputs = sample_inputs_for(model, setup.microbatch_size, setup.seq_len, setup.target_len)
                traced = capture_model(model, inputs)
                self._captures[setup.model] = (model, traced)
                self._graphs[cache_key] = traced.cost_graph
            time_s = time.perf_counter() - started
            if self._log:
                self._log(f"traced {setup.model} {setup.shape} × {setup.microbatch_size} in {time_s:.1f} s")
        return self._graphs[cache_key]


def plan_spec(name: str) -> PlanSpec:
    """The shipped spec called ``name`` (e.g. ``"t5-3b/rtx2080ti-x8-rte"``)."""
    for spec in SHIPPED_PLANS:
        if spec.name == name:
            return spec
    raise PartitionError(f"no shipped plan {name!r}; choose among {[s.name for s in SHIPPED_PLANS]}")


def profile_of(spec: PlanSpec) -> GPUProfile:
    """The built-in profile that ``spec`` names, with its GPU count."""
    return get_profile(spec.gpu_profile, count=spec.num_gpus)


def plan_request(spec: PlanSpec) -> PlanRequest:
    """What ``spec`` asks every partitioner for."""
    return PlanRequest(
        profile=profile_of(spec),
        num_microbatches=spec.num_microbatches,
        microbatch_size=spec.setup.microbatch_size,
        schedule=spec.schedule,  # type: ignore[arg-type]  # a PlanSpec holds built-in names
        optimizer=spec.setup.optimizer,  # type: ignore[arg-type]
        dtype=None,  # the weights' dtype: fp32 for the shipped configs
        memory=MemoryOptions(headroom=spec.headroom, recompute=spec.recompute),
    )


def partitioner_options(spec: PlanSpec) -> dict[str, Any]:
    """The keyword arguments every partitioner takes besides the graph and profile, for ``spec``."""
    return plan_request(spec).options()


def make_entry(spec: PlanSpec, graph: CostGraph) -> tuple[dict[str, Any], Partition | None]:
    """Plan ``spec`` on ``graph`` as `auto` would: its index entry, and the plan when one fits."""
    import hf_ftpipe.partitioners  # noqa: F401  (registers every partitioner)

    request = plan_request(spec)
    profile, options = request.profile, request.options()
    results = compare_partitioners(graph, profile, time_budget_s=_NO_BUDGET_S, **options)
    best = best_result(results)
    key = request.key_for(graph)
    entry = _spec_fields(spec) | {"model_class": graph.model_class, "key_digest": key.digest()}
    if best is None:
        error = no_plan_fits(graph, profile, results, **options)
        advice = error.advice
        assert advice is not None  # no_plan_fits always advises
        return entry | {
            "file": None,
            "partitioner": None,
            "predicted": None,
            "does_not_fit": str(error),
            "would_fit": _would_fit(advice.need_capacity_bytes, advice.num_gpus, profile.name),
        }, None
    plan = best.partition
    assert plan is not None and plan.predicted is not None  # feasible results carry a predicted plan
    predicted = plan.predicted
    figures = {
        "throughput_samples_per_s": predicted.throughput_samples_per_s,
        "step_time_ms": predicted.step_time_s * 1e3,
        "ideal_step_time_ms": predicted.ideal_step_time_s * 1e3,
        "worst_over_ideal": predicted.worst_over_ideal,
        "max_memory_gib": max(g.memory_bytes for g in predicted.gpus) / GiB,
        "max_memory_fraction": predicted.max_memory_fraction,
        "num_stages": plan.num_stages,
        "stages_per_gpu": [len(plan.stages_on(g)) for g in range(plan.num_devices)],
        "runner_up": _runner_up(results, best.partitioner),
    }
    file = f"{spec.name}.json"
    return entry | {
        "file": file,
        "partitioner": plan.partitioner,
        "predicted": figures,
        "does_not_fit": None,
        "would_fit": None,
    }, plan


def _would_fit(need_capacity_bytes: float | None, num_gpus: int | None, profile_name: str) -> str | None:
    """``"≥ 13.24 GiB per GPU, or 9 × rtx2080ti"``: the figures of what would fit (``fit.FitAdvice``)."""
    parts = [f"≥ {format_bytes(need_capacity_bytes)} per GPU"] if need_capacity_bytes is not None else []
    parts += [f"{num_gpus} × {profile_name}"] if num_gpus is not None else []
    return ", or ".join(parts) or None


def _spec_fields(spec: PlanSpec) -> dict[str, Any]:
    setup = spec.setup
    return {
        "name": spec.name,
        "model": setup.model,
        "task": setup.name,
        "dataset": setup.dataset,
        "seq_len": setup.seq_len,
        "target_len": setup.target_len,
        "microbatch_size": setup.microbatch_size,
        "optimizer": setup.optimizer,
        "gpu_profile": spec.gpu_profile,
        "num_gpus": spec.num_gpus,
        "schedule": spec.schedule,
        "num_microbatches": spec.num_microbatches,
        "recompute": spec.recompute,
        "headroom": spec.headroom,
    }


def _runner_up(results: Sequence[Any], winner: str) -> dict[str, Any] | None:
    """The best feasible plan of another partitioner: how much the winner gains."""
    others = [r for r in results if r.feasible and r.partitioner != winner]
    best = best_result(others)
    if best is None:
        return None
    return {"partitioner": best.partitioner, "throughput_samples_per_s": best.throughput_samples_per_s}


# -- the folder --------------------------------------------------------------------------------


def regenerate(
    folder: str | os.PathLike,
    names: Sequence[str] | None = None,
    *,
    graphs: GraphCache | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> list[dict[str, Any]]:
    """Recompute the plans ``names`` (default: all of ``SHIPPED_PLANS``) into ``folder``, then
    rewrite its index and card; entries of other plans are kept from the existing index."""
    folder = Path(folder)
    specs = list(SHIPPED_PLANS) if names is None else [plan_spec(n) for n in names]
    graphs = graphs or GraphCache(log)
    old = {e["name"]: e for e in read_index(folder)} if (folder / INDEX_FILE).exists() else {}
    new: dict[str, dict[str, Any]] = {}
    for spec in specs:
        started = time.perf_counter()
        entry, plan = make_entry(spec, graphs(spec.setup))
        path = folder / f"{spec.name}.json"
        if plan is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.to_json(path)
        elif path.exists():
            path.unlink()  # a plan that no longer fits must not linger
        outcome = "does not fit"
        if plan is not None:
            outcome = f"{entry['partitioner']}, {entry['predicted']['throughput_samples_per_s']:.2f} samples/s"
        log(f"{spec.name}: {outcome} ({time.perf_counter() - started:.1f} s)")
        new[spec.name] = entry
    entries = [new.get(s.name) or old.get(s.name) for s in SHIPPED_PLANS]
    entries = [e for e in entries if e is not None]
    folder.mkdir(parents=True, exist_ok=True)
    index = {"format": "hf_ftpipe.partitions_index", "format_version": _INDEX_VERSION, "plans": entries}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    (folder / CARD_FILE).write_text(render_card(entries), encoding="utf-8")
    return entries


def read_index(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The entries of ``folder/index.json``."""
    path = Path(folder) / INDEX_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise PartitionError(f"cannot read the index {path}: {error}; run `hf-ftpipe regenerate-partitions`") from error
    if not isinstance(data, dict) or data.get("format_version") != _INDEX_VERSION:
        raise PartitionError(f"{path} is not a version {_INDEX_VERSION} index; run `hf-ftpipe regenerate-partitions`")
    return data["plans"]


def publish(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Update hf_ftpipe partitions",
) -> str:
    """Upload ``folder`` (plans, index, card, model configs) to the Hub dataset ``repo_id``,
    creating it (and the branch ``revision``) when missing, in one commit; returns its URL.

    Each plan goes up twice: where it is in the folder (``t5-3b/rtx2080ti-x8-boolq.json``, for
    people and the card's table), and at the keyed path `hf_ftpipe.hub.PartitionStore` looks up
    (``plans/v2/...``), so that ``partition_repo=repo_id`` and ``hf-ftpipe pull`` find it.
    Files are added or replaced, never deleted: a plan dropped from the folder stays in the
    repository until removed by hand, since the repository may hold plans shared by others
    (``index.json`` and the card list only the current ones)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from hf_ftpipe.hub.store import path_for
    from hf_ftpipe.plan.partition import Partition, with_fix

    folder = Path(folder)
    entries = read_index(folder)  # refuse to publish a folder that was never generated
    sources = {}  # path in the repo -> file: the card, the index, the plans, the model configs
    for path in sorted(folder.rglob("*")):
        in_repo = path.relative_to(folder).as_posix()
        if path.is_file() and ".tmp" not in path.name and (in_repo == CARD_FILE or path.suffix == ".json"):
            sources[in_repo] = path
    for entry in entries:
        if entry["file"]:  # setups with equal keys (BoolQ and MultiRC shapes) share one keyed file
            with with_fix(f"Run `hf-ftpipe regenerate-partitions --folder {folder}` to write it again."):
                plan = Partition.from_json(folder / entry["file"])
            sources[path_for(plan.key, plan.format_version)] = folder / entry["file"]
    operations = [CommitOperationAdd(in_repo, str(path)) for in_repo, path in sources.items()]
    # The environment as it is now (huggingface_hub reads HF_ENDPOINT once, at import).
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token or os.environ.get("HF_TOKEN") or None)
    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="dataset", exist_ok=True)
    commit = api.create_commit(
        repo_id, operations, repo_type="dataset", revision=revision, commit_message=commit_message
    )
    return str(commit)


# -- the card ----------------------------------------------------------------------------------


def count_line(num_plans: int, num_unfit: int) -> str:
    plans = f"{num_plans} plan{'s' if num_plans != 1 else ''}"
    if not num_unfit:
        return f"{plans}; every setup fits its GPUs."
    setups = f"{num_unfit} setup{' does' if num_unfit == 1 else 's do'}"
    return f"{plans}; {setups} not fit its GPUs (the table says what would)."


_FRONT_MATTER = """---
pretty_name: hf_ftpipe pipeline partitions
tags:
- pipeline-parallelism
- ftpipe
- partitioning
- hf-ftpipe
size_categories:
- n<1K
viewer: false
---
"""


def render_card(entries: Sequence[dict[str, Any]]) -> str:
    """The folder's README.md (a Hub dataset card): front matter, what is here, the table."""
    fits = [e for e in entries if e["file"]]
    lines = [
        _FRONT_MATTER,
        "# hf_ftpipe pipeline partitions",
        "",
        "Pipeline plans computed by hf_ftpipe's partitioners (after FTPipe, USENIX ATC '21) for the paper's "
        "fine-tuning setups on 8 × RTX 2080 Ti and for a few current boxes. Each `<model>/<gpu>-x<count>-<task>.json` "
        "is a `hf_ftpipe.partition` file: which stage runs each op of the traced model, which GPU runs each "
        "stage, and the cost model's prediction (compute, communication and memory per stage and per GPU). "
        "Pass one as `partition_file=` to `PipeTrainer` to skip planning, or inspect it with "
        "`hf-ftpipe show FILE [--plot out.png]`.",
        "",
        "Every plan is the best of all partitioners (`auto`), predicted for fp32 compute, the async schedule "
        "(PipeDream weight stashing, an update after every micro-batch), 8 micro-batches in flight, activation "
        "recomputation, and 10% of each GPU's memory kept free. MultiRC has BoolQ's shapes, so their plans are "
        "the same. Figures are predictions of hf_ftpipe's analytical cost model (datasheet speeds, "
        "`hf-ftpipe profiles`), not measurements: use them to compare plans and to see whether a setup fits "
        "before spending GPU hours.",
        "",
        "fp32 makes the A100 look slow: its fp32 peak (19.5 TFLOP/s; PyTorch leaves TF32 off) is below an "
        "L4's (30) and an RTX 4090's (82.6). Mixed precision is not planned yet.",
        "",
        count_line(len(fits), len(entries) - len(fits)),
        "",
        "| model | task | input/target | micro-batch | optimizer | GPUs | partitioner | stages (per GPU) "
        "| samples/s | worst GPU / ideal | peak memory | file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        shape = f"{e['seq_len']}" + (f"/{e['target_len']}" if e["target_len"] else "")
        head = f"| {e['model']} | {e['dataset']} | {shape} | {e['microbatch_size']} | {e['optimizer']} | "
        head += f"{e['num_gpus']} × {e['gpu_profile']} | "
        p = e["predicted"]
        if p is None:
            lines.append(head + f"does not fit | – | – | – | needs {e['would_fit'] or 'more memory'} | – |")
            continue
        per_gpu = p["stages_per_gpu"]
        spread = str(per_gpu[0]) if min(per_gpu) == max(per_gpu) else f"{min(per_gpu)}–{max(per_gpu)}"
        lines.append(
            head + f"{e['partitioner']} | {p['num_stages']} ({spread}) | {p['throughput_samples_per_s']:.2f} | "
            f"{p['worst_over_ideal']:.3f} | {p['max_memory_gib']:.1f} GiB ({p['max_memory_fraction']:.0%}) | "
            f"[{e['file']}]({e['file']}) |"
        )
    lines += [
        "",
        "`samples/s`: steady-state throughput (micro-batch / the slowest GPU's time per micro-batch, "
        "fill and drain not counted). `worst GPU / ideal`: that time over total compute / GPUs (1.0 is a perfect "
        "balance). `peak memory`: the fullest GPU, and its share of the GPU's memory. `index.json` has every "
        "figure, the key digest of each plan, and the full reason when a setup does not fit.",
        "",
        "## Regenerate and publish",
        "",
        "```bash",
        "hf-ftpipe regenerate-partitions --folder partitions   # traces each model (no GPU, no weights)",
        "hf-ftpipe show partitions/t5-3b/rtx2080ti-x8-boolq.json --plot boolq.png",
        "hf-ftpipe publish-partitions USER/hf-ftpipe-partitions --folder partitions",
        "```",
        "",
        "A plan is valid for its `key`: the model's traced graph (fingerprint), the input shapes of one micro-batch, "
        "dtype, schedule, micro-batches and GPU profile. hf_ftpipe refuses a plan whose key differs from the run's.",
        "",
        "Published, each plan is also stored under `plans/v2/...` by its key, where hf_ftpipe looks: a run with "
        '`PipeTrainingArguments(partition_repo="USER/hf-ftpipe-partitions")` whose setup matches one of these pulls '
        "it instead of partitioning, and `hf-ftpipe pull --repo USER/hf-ftpipe-partitions ...` fetches it.",
        "",
    ]
    return "\n".join(lines)
