"""StageCompiler: a stage module compiled in place keeps its names, computes what it computed, and
compiles once for every length and every micro-batch's rows (views of the batch at an offset)."""

from __future__ import annotations

import torch
from torch import fx, nn

from hf_ftpipe.runtime.compiled_stages import CompileOptions, StageCompiler


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, length: int) -> tuple[torch.Tensor]:
        # A stage reads a varying size as an input of its own (`StageSpec.size_inputs`); GPT-2's graph views
        # input_ids with it, on which dynamo guards the layout of the tensor it is given.
        return (self.proj(self.embed(input_ids.view(-1, length))).tanh().sum(-1),)


def test_a_compiled_stage_keeps_its_names_and_values_and_compiles_once_per_mode() -> None:
    torch.manual_seed(0)
    stage = fx.symbolic_trace(_Block())  # a GraphModule, as the pipeline's stages are
    reference = fx.symbolic_trace(_Block())
    reference.load_state_dict(stage.state_dict())
    names = list(stage.state_dict())
    compiler = StageCompiler(CompileOptions(backend="eager"), dynamic=True)
    compiler.prepare(stage)
    compiler.prepare(stage)  # once only

    wide = torch.randint(0, 11, (4, 12))
    for length in (6, 4, 9):  # micro-batches of 2 rows of a batch cut from a wider one: views, not contiguous
        batch = wide[:, :length]
        for rows in batch.tensor_split(2):
            (out,) = stage(rows, length)
            (want,) = reference(rows, length)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            out.sum().backward()
            want.sum().backward()
    with torch.no_grad():  # evaluation: one more graph
        stage(torch.randint(0, 11, (2, 5)), 5)

    assert list(stage.state_dict()) == names and not any("_orig_mod" in n for n, _ in stage.named_parameters())
    for (name, param), (_, want) in zip(stage.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(param.grad, want.grad, msg=name)
    assert compiler.graphs == 2, compiler.graphs
    assert compiler.compile_time_s > 0
    assert "2 graphs of this rank's stages compiled in" in compiler.summary()
