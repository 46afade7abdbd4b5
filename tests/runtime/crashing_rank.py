"""A 2-rank pipeline in which rank 1 raises in its second step (started by torchrun in a test)."""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from hf_ftpipe.graph import capture_model  # noqa: E402
from hf_ftpipe.runtime import PipelineEngine  # noqa: E402

from models import tiny_batch, tiny_model  # noqa: E402
from placements import contiguous_placement  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model("gpt2")
    batch = tiny_batch("gpt2", 4)
    traced = capture_model(model, {k: v[:2] for k, v in batch.items()})
    engine = PipelineEngine(traced, contiguous_placement(traced.cost_graph, [0, 1]), num_microbatches=2, timeout_s=50)
    step = 0
    if rank == 1:
        stage = engine.modules[1]
        original = stage.forward

        def failing_forward(*args):
            if step == 1:
                raise RuntimeError("injected failure")
            return original(*args)

        stage.forward = failing_forward
    for step in range(3):
        engine.train_step(batch)
        print(f"rank {rank} finished step {step}", flush=True)


if __name__ == "__main__":
    main()
