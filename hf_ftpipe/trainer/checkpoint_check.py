"""Whether a folder is a checkpoint that can be resumed, checked by every rank before any trains.

A checkpoint that fails half-way through resuming stops one rank while the others go on (and
wait for it): a truncated optimizer shard of rank 1 let rank 0 start training, and a truncated
``model.safetensors`` surfaced as a bare ``SafetensorError: ... incomplete metadata``. So before
any rank builds on it, every rank reads the header of every tensor file, parses every JSON file
and opens every ``torch.save`` archive of the folder (cheap: no tensor data is read), and the
ranks agree on the outcome (`hf_ftpipe.trainer.preflight`). A file whose bytes are damaged without
changing its size is not found here (the formats carry no checksums).
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

from safetensors import safe_open

from hf_ftpipe.errors import CheckpointError, PipelineError
from hf_ftpipe.runtime.weights import checkpoint_files
from hf_ftpipe.trainer.checkpoint_folders import TRAINER_STATE, is_complete, numbered
from hf_ftpipe.trainer.checkpoint_format import check_optimizer_state
from hf_ftpipe.trainer.peft_checkpoints import ADAPTER_WEIGHTS, has_adapter

__all__ = ["check_readable", "check_resumable"]

_TORCH_ARCHIVES = (".pt", ".pth", ".bin")
_STEP = re.compile(r"-(\d+)$")


def check_resumable(folder: str | os.PathLike) -> None:
    """Refuse a ``resume_from_checkpoint`` that is no checkpoint, or not a readable one.

    The reason is the missing folder or file, or the damaged file, not a later symptom (a model
    built with empty weights finding no weights to read, a rank dying while the others train).
    """
    where = f"Can't find a valid checkpoint at {os.fspath(folder)}"
    fix = "pass a checkpoint-N folder PipeTrainer wrote in `output_dir`, or `resume_from_checkpoint=True` for the last"
    if not os.path.isdir(folder):
        raise CheckpointError(f"{where}: no such folder; {fix}")
    check_readable(folder)
    try:
        checkpoint_files(folder)
    except PipelineError as error:
        if not has_adapter(folder):  # a LoRA model's checkpoint holds its adapter alone
            raise CheckpointError(
                f"{where}: it holds no model weights (model.safetensors or its sharded index, or a LoRA "
                f"adapter's {ADAPTER_WEIGHTS}); {fix}"
            ) from error
    if not is_complete(folder):
        raise CheckpointError(
            f"{where}: it has no {TRAINER_STATE}, which a checkpoint gets last (saving was interrupted, or it is "
            "a save_pretrained folder: for its weights alone use `weights_path`); " + fix
        )
    check_optimizer_state(folder)


def check_readable(folder: str | os.PathLike) -> None:
    """Raise `CheckpointError` naming the first file of ``folder`` (subfolders included) that is
    truncated or unreadable: a safetensors file whose header or tensor data is cut short, a JSON
    file that does not parse, a ``torch.save`` archive without its directory."""
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        problem = _problem(path)
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint {os.fspath(folder)} cannot be resumed: {path} {problem} (a save or a copy that "
                f"did not finish, or a full disk). {_fix(Path(folder))}"
            )


def _problem(path: Path) -> str | None:
    """What is wrong with the file at ``path``, or None."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as handle:
                handle.keys()
        elif path.suffix == ".json":
            json.loads(path.read_bytes())
        elif path.suffix in _TORCH_ARCHIVES and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        elif path.suffix in _TORCH_ARCHIVES:
            return f"is not a whole torch.save archive ({path.stat().st_size} bytes; truncated?)"
    except json.JSONDecodeError as error:
        return f"is not valid JSON ({error}; truncated?)"
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        return f"cannot be read ({error})"
    except Exception as error:  # safetensors' SafetensorError derives from Exception only
        return f"is truncated or damaged ({type(error).__name__}: {error})"
    return None


def _fix(folder: Path) -> str:
    """Resume from the newest complete checkpoint older than ``folder``, if its ``output_dir`` has one."""
    step = _STEP.search(folder.name)
    for number, other in numbered(folder.parent) if step is not None else []:
        if number < int(step.group(1)) and is_complete(other):
            return f'Resume from the checkpoint before it, `resume_from_checkpoint="{other}"`, or copy this one again'
    return "Copy the checkpoint again if it was copied, or train without resuming"
