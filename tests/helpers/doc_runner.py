"""Run documentation blocks as a reader would, one after another in one process, for tests/test_docs.py.

    python tests/helpers/doc_runner.py BLOCKS.json RESULTS.json

BLOCKS.json: a list of ``{"where", "language", "text"}``. Each block runs in a folder of its own
that links the repository's top-level entries (``examples/``, ``partitions/``, ...), so relative
paths work and what a block writes stays out of the checkout. Python runs as a script
(``__name__ == "__main__"``, a fresh namespace); a bash block runs line by line, each line must
succeed: ``hf-ftpipe ...`` through the command's own entry point (``hf_ftpipe.cli.main``, what the
installed script calls) in this process, anything else in ``bash``. Running the blocks in one
process pays for starting Python and importing torch and transformers once. The caller sets the
environment (offline, a temporary HF_HOME). RESULTS.json: per block ``{"where", "ok", "output",
"seconds"}``, ``output`` holding stdout and stderr (and the traceback of a failure).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL_TIMEOUT_S = 120.0


def main(blocks_file: str, results_file: str) -> None:
    blocks = json.loads(Path(blocks_file).read_text(encoding="utf-8"))
    results = []
    for block in blocks:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="docs-block-") as folder:
            _link_repository(Path(folder))
            ok, output = _run(block, Path(folder))
        results.append({"where": block["where"], "ok": ok, "output": output, "seconds": time.perf_counter() - started})
        # Written after each block, so that a block that hangs past the caller's deadline leaves the others' results.
        Path(results_file).write_text(json.dumps(results), encoding="utf-8")


def _link_repository(folder: Path) -> None:
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def _run(block: dict, folder: Path) -> tuple[bool, str]:
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if block["language"] == "python":
                code = compile(block["text"], block["where"], "exec")
                exec(code, {"__name__": "__main__", "__file__": str(folder / "snippet.py")})
                return True, out.getvalue()
            for line in block["commands"]:
                print(f"$ {line}")
                if not _run_command(line, folder):
                    return False, out.getvalue()
            return True, out.getvalue()
    except BaseException:  # SystemExit too: a snippet's failure is a result, not the runner's end
        return False, out.getvalue() + traceback.format_exc()
    finally:
        os.chdir(cwd)


def _run_command(line: str, folder: Path) -> bool:
    """Run one command line; whether it exited 0. Its output goes to the current stdout."""
    import shlex

    words = shlex.split(line)
    if words[:1] == ["hf-ftpipe"] or words[:3] == ["python", "-m", "hf_ftpipe"]:
        from hf_ftpipe.cli import parser as cli

        code = cli.main(words[1:] if words[0] == "hf-ftpipe" else words[3:])
        print(f"(exit status {code})")
        return code == 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        ["bash", "-c", line], cwd=folder, env=env, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S
    )
    print(result.stdout + result.stderr + f"(exit status {result.returncode})")
    return result.returncode == 0


if __name__ == "__main__":
    main(*sys.argv[1:])
