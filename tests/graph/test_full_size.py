"""Full-size models from the paper, built from their public configs on the meta device, trace."""

import pytest
import torch
import transformers

from hf_ftpipe.graph import trace_model


def _meta(config_class: type, model_class: type, **config: object) -> torch.nn.Module:
    with torch.device("meta"):
        return model_class(config_class(**config))


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, dtype=torch.long, device="meta")


@pytest.mark.parametrize(
    ("name", "build", "inputs", "params_b"),
    [
        (
            "t5-3b",
            lambda: _meta(
                transformers.T5Config,
                transformers.T5ForConditionalGeneration,
                vocab_size=32128,
                d_model=1024,
                d_ff=16384,
                d_kv=128,
                num_heads=32,
                num_layers=24,
                num_decoder_layers=24,
                decoder_start_token_id=0,
                pad_token_id=0,
            ),
            lambda: {"input_ids": _ids(4, 512), "labels": _ids(4, 4)},
            2.85,
        ),
        (
            "gpt2-xl",
            lambda: _meta(
                transformers.GPT2Config,
                transformers.GPT2LMHeadModel,
                vocab_size=50257,
                n_positions=1024,
                n_embd=1600,
                n_layer=48,
                n_head=25,
            ),
            lambda: {"input_ids": _ids(1, 1024), "labels": _ids(1, 1024)},
            1.56,
        ),
        (
            "bert-large",
            lambda: _meta(
                transformers.BertConfig,
                transformers.BertForQuestionAnswering,
                vocab_size=30522,
                hidden_size=1024,
                num_hidden_layers=24,
                num_attention_heads=16,
                intermediate_size=4096,
            ),
            lambda: {
                "input_ids": _ids(24, 384),
                "start_positions": torch.zeros(24, dtype=torch.long, device="meta"),
                "end_positions": torch.zeros(24, dtype=torch.long, device="meta"),
            },
            0.335,
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_full_size_model_traces_on_meta(name: str, build, inputs, params_b: float) -> None:
    graph = trace_model(build(), inputs())
    trainable = sum(p.numel for p in graph.params.values() if p.requires_grad and not p.is_buffer)
    assert trainable / 1e9 == pytest.approx(params_b, rel=0.02), name
    assert graph.num_nodes > 500
    assert graph.total_flops > 1e12  # a full-size forward is teraFLOPs
    assert graph.outputs[0] in graph.graph and graph.output_names[0] == "loss"
