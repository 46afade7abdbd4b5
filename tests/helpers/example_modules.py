"""Import the example scripts by path for their tests: ``examples/`` is not a package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = EXAMPLES / "data"


def load_example(name: str) -> ModuleType:
    """``examples/{name}.py`` as a module (registered in ``sys.modules``: dataclasses look it up there)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def regenerate_fixtures(script: str, out_dir: Path) -> None:
    """Run ``examples/data/{script}`` writing into ``out_dir`` (every fixture script takes ``--out-dir``)."""
    result = subprocess.run(
        [sys.executable, str(DATA / script), "--out-dir", str(out_dir)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
