"""A 2-rank pipeline in which rank 1 raises in its second step (started by torchrun in a test)."""

import torch.distributed as dist

from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime import PipelineEngine

from models import tiny_batch, tiny_model
from placements import contiguous_placement


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
