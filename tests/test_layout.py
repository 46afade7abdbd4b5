"""The package layout is the architecture: each package imports only the packages below it, and
what it loads at run time stays within that.

Planning (`schedules`, `costmodel`, `plan`, `partitioners`) runs on a laptop without torch,
transformers or the Hub client; the runtime runs a plan without the partitioners or transformers.
The loaded modules are checked in a fresh interpreter (a test process has loaded everything); the
import direction is read from the source with `ast`, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import hf_ftpipe

PACKAGE = Path(hf_ftpipe.__file__).resolve().parent
REPO = PACKAGE.parent

ROOT_HELPERS = {"_cache", "errors", "_lazy", "_json_depth", "_strict_json", "_table", "_units"}
"""Private root modules (and the errors) that any package may import; they import no package."""
FACE = {"__init__", "__main__", "_moved"}
"""The root's face (lazy re-exports, the command line, the forwarding of moved paths): above everything."""

_BELOW_THE_TOP = {
    "model_configs",
    "metrics",
    "graph",
    "schedules",
    "costmodel",
    "plan",
    "partitioners",
    "runtime",
    "hub",
    "simulator",
}
ALLOWED: dict[str, set[str]] = {
    "model_configs": set(),  # data: the paper's model configs
    "metrics": set(),  # evaluate's metric modules, shipped for offline use
    "graph": {"model_configs"},
    "schedules": set(),
    # A cost is estimated over a traced CostGraph, hence graph.
    "costmodel": {"schedules", "graph"},
    "plan": {"costmodel", "schedules", "graph"},
    # A simulated step time can rank candidate plans (`auto`'s rank_by="simulated").
    "simulator": {"plan", "costmodel", "schedules", "graph"},
    "partitioners": {"simulator", "plan", "costmodel", "schedules", "graph"},
    "runtime": {"graph", "plan", "schedules"},
    "hub": {"plan", "partitioners", "costmodel", "graph"},
    # On top, side by side: neither imports the other.
    "trainer": _BELOW_THE_TOP,
    "cli": _BELOW_THE_TOP,
}
"""Package → the hf_ftpipe packages it may import (besides itself and `ROOT_HELPERS`)."""

_DOTTED = re.compile(r"hf_ftpipe(\.[A-Za-z_]\w*)+")


def _run(statement: str, watched: list[str]) -> list[str]:
    """Run ``statement`` in a fresh interpreter; which of ``watched`` it left in ``sys.modules``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {watched!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def _import_everything(package: str) -> str:
    """Import ``package`` and every name it exports (the faces are lazy: a name loads its home)."""
    return f"import {package} as package\nfor name in package.__all__:\n    getattr(package, name)"


@pytest.mark.parametrize("package", ["schedules", "costmodel", "plan", "simulator", "partitioners"])
def test_planning_loads_neither_torch_nor_transformers_nor_the_hub_client(package: str) -> None:
    # `import torch` loads torch.distributed: watching it catches any import of torch.
    loaded = _run(_import_everything(f"hf_ftpipe.{package}"), ["torch.distributed", "transformers", "huggingface_hub"])
    assert loaded == [], f"importing hf_ftpipe.{package} loaded {loaded}"


def test_the_runtime_loads_neither_the_partitioners_nor_transformers() -> None:
    loaded = _run(_import_everything("hf_ftpipe.runtime"), ["hf_ftpipe.partitioners", "transformers"])
    assert loaded == [], f"importing hf_ftpipe.runtime loaded {loaded}"


# -- import direction, from the source ----------------------------------------------------------


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _exists(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _nodes(tree: ast.AST, *, annotations: bool = False) -> Iterator[ast.AST]:
    """Every node, less the bodies of ``if TYPE_CHECKING:`` (annotations only: nothing is loaded)
    unless ``annotations``."""
    for child in ast.iter_child_nodes(tree):
        if _is_type_checking(child) and not annotations:
            yield from (n for orelse in child.orelse for n in [orelse, *_nodes(orelse)])
            continue
        yield child
        yield from _nodes(child, annotations=annotations)


def _references(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for each module the source file ``path`` imports."""
    name, is_package = _module_name(path)
    return _references_in(path.read_text(encoding="utf-8"), name, is_package)


def _references_in(source: str, name: str, is_package: bool, *, annotations: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for each module the module ``name`` imports: ``import``, ``from ... import``
    (relative ones resolved), and hf_ftpipe module paths written as strings (the lazy faces, `import_module`);
    ``annotations``: those under ``if TYPE_CHECKING:`` too."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in _nodes(ast.parse(source), annotations=annotations):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                # `from hf_ftpipe import PipeTrainer`: a name of the root's lazy face, loaded from its home.
                if base == "hf_ftpipe" and alias.name in hf_ftpipe._HOMES:
                    yield node.lineno, hf_ftpipe._HOMES[alias.name]
                else:
                    yield node.lineno, child if _exists(child) else base
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
            if _exists(node.value):  # not a format tag such as "hf_ftpipe.partition"
                yield node.lineno, node.value


def _sources(package: str) -> list[Path]:
    folder = PACKAGE / package
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{package}.py"]


def test_every_package_has_a_place_in_the_layout() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED), "add the new package to ALLOWED, below the packages it imports"
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == ROOT_HELPERS | FACE, "a root module is a helper of every package or part of the face"


@pytest.mark.parametrize("package", sorted(ALLOWED) + sorted(ROOT_HELPERS))
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    allowed = ALLOWED.get(package, set()) | {package} | ROOT_HELPERS
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in _sources(package)
        for line, module in _references(path)
        if module.startswith("hf_ftpipe.") and module.split(".")[1] not in allowed
    ]
    below = ", ".join(sorted(ALLOWED.get(package, set()))) or "none"
    assert wrong == [], f"{package} may import only hf_ftpipe's root helpers and: {below}\n" + "\n".join(wrong)


def test_the_import_scan_sees_every_kind_of_import() -> None:
    """The scanner itself, on a made-up module of the runtime: what it must see, and what it must not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import hf_ftpipe.plan\n"
        "from hf_ftpipe.graph import cost_graph\n"
        "from ..costmodel import estimate\n"
        "from . import stage\n"
        "from hf_ftpipe import PipeTrainer\n"
        "if TYPE_CHECKING:\n"
        "    from hf_ftpipe.hub import store\n"
        "def later():\n"
        "    from hf_ftpipe.partitioners.registry import get_partitioner\n"
        "HOMES = {'x': 'hf_ftpipe.schedules.orders', 'format': 'hf_ftpipe.partition'}\n"
    )
    seen = sorted(module for _, module in _references_in(source, "hf_ftpipe.runtime.example", is_package=False))
    assert seen == [
        "hf_ftpipe.costmodel.estimate",
        "hf_ftpipe.graph.cost_graph",
        "hf_ftpipe.partitioners.registry",
        "hf_ftpipe.plan",
        "hf_ftpipe.runtime.stage",
        "hf_ftpipe.schedules.orders",
        "hf_ftpipe.trainer",
        "typing",
    ]


# -- the partitioners, in layers ----------------------------------------------------------------


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import circle of ``edges`` (module → the modules it imports), as a path that ends where it
    starts; empty when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(edges.get(module, ())):
            if found := visit(imported):
                return found
        path.pop()
        done.add(module)
        return []

    for module in sorted(edges):
        if found := visit(module):
            return found
    return []


def test_the_cycle_finder_finds_a_circle() -> None:
    edges = {"chain": {"contiguous"}, "contiguous": {"fit"}, "fit": {"seq_dp"}, "seq_dp": {"chain"}, "auto": {"fit"}}
    assert _cycle(edges) == ["fit", "seq_dp", "chain", "contiguous", "fit"]  # reached from "auto"
    assert _cycle(edges | {"seq_dp": {"registry"}}) == []


def test_the_partitioners_import_one_another_in_layers() -> None:
    """No import circle among the modules of `partitioners`, counting imports inside functions and
    under ``TYPE_CHECKING``: `contiguous` and `registry` import no partitioner, `chain` only
    `contiguous`, `fit` those, and the registered partitioners sit above. The package faces
    (``__init__``) re-export what is below them and are imported by nothing inside."""
    modules = {_module_name(path)[0]: path for path in _sources("partitioners")}
    edges = {
        name: {
            module
            for _, module in _references_in(
                path.read_text(encoding="utf-8"), name, _module_name(path)[1], annotations=True
            )
            if module in modules and module != name
        }
        for name, path in modules.items()
    }
    assert "hf_ftpipe.partitioners.fit" in edges["hf_ftpipe.partitioners.seq_dp"]  # the scan sees this package
    circle = _cycle(edges)
    assert circle == [], "the partitioners import in a circle: " + " → ".join(circle)


def test_no_two_test_files_share_a_name() -> None:
    # The test folders are not packages: pytest imports each file by its bare name, so a second
    # `test_x.py` in another folder fails collection ("import file mismatch") for the whole suite.
    tests = Path(__file__).parent
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path.relative_to(tests)} and {seen[path.name].relative_to(tests)} share a name"
        seen[path.name] = path
