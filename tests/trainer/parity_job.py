"""PipeTrainer (gpipe, 2 ranks) on a tiny GPT-2 (also cut into token slices), T5 and BERT, for the
comparison with plain `Trainer`.

Run by `test_parity.py` under `accelerate launch`; the test builds the single-process reference
from the same `parity_runs.setup()`. Rank 0 writes, per model, ``OUTPUT/<kind>/result.pt`` (logged
history, evaluate() and predict() results) and the trained checkpoint in ``OUTPUT/<kind>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from parity_runs import KINDS, run


def main(output_dir: str, *kinds: str) -> None:
    """Run ``kinds`` (default: every one of `KINDS`)."""
    from hf_ftpipe import PipeTrainer

    for kind in kinds or KINDS:
        result = run(kind, str(Path(output_dir) / kind), PipeTrainer)
        if torch.distributed.get_rank() == 0:
            torch.save(result, Path(output_dir) / kind / "result.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
