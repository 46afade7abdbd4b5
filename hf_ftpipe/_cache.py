"""hf_ftpipe's cache folder under ``HF_HOME``: one home for where cached plans and cost tables live."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$HF_HOME/hf_ftpipe`` (huggingface_hub's default home without ``HF_HOME``): plans under
    ``partitions/``, measured cost tables under ``costs/``."""
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expanduser(home)) / "hf_ftpipe"
    from huggingface_hub import constants  # its default home, only when HF_HOME is unset

    return Path(constants.HF_HOME) / "hf_ftpipe"
