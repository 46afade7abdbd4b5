"""Tiny Hugging Face models built from configs (no weights to fetch) and matching batches."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB = 96
SEQ = 8
TARGET = 4


def tiny_model(kind: str, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A randomly initialised tiny model of ``kind``; dropout off by default so runs compare exactly."""
    torch.manual_seed(seed)
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            d_kv=16,
            dropout_rate=dropout,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        return transformers.T5ForConditionalGeneration(config)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=1,
            eos_token_id=1,
        )
        return transformers.GPT2LMHeadModel(config)
    if kind in ("bert", "bert-mlm", "bert-qa"):
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            num_labels=2,
        )
        if kind == "bert-mlm":
            return transformers.BertForMaskedLM(config)
        if kind == "bert-qa":
            return transformers.BertForQuestionAnswering(config)
        return transformers.BertForSequenceClassification(config)
    if kind == "roberta":
        config = transformers.RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=40,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            num_labels=2,
            pad_token_id=1,
        )
        return transformers.RobertaForSequenceClassification(config)
    if kind == "bart":
        config = transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
            dropout=dropout,
            attention_dropout=dropout,
            activation_dropout=dropout,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
        )
        return transformers.BartForConditionalGeneration(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attention_dropout=dropout,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown tiny model kind {kind!r}")


KINDS = ("t5", "gpt2", "bert", "roberta", "bart", "llama")


def tiny_batch(
    kind: str, batch_size: int, seed: int = 0, seq: int = SEQ, target: int = TARGET
) -> dict[str, torch.Tensor]:
    """A batch of random tokens with the inputs and labels ``kind`` trains on (``seq`` tokens per
    row, ``target`` label tokens for an encoder-decoder)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch_size, seq), generator=generator)
    attention_mask = torch.ones(batch_size, seq, dtype=torch.long)
    attention_mask[0, -min(2, seq - 1) :] = 0  # some padding, so masks matter
    if kind in ("t5", "bart"):
        labels = torch.randint(3, VOCAB, (batch_size, target), generator=generator)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if kind in ("gpt2", "llama"):
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    labels = torch.randint(0, 2, (batch_size,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class FixedLengthLM(nn.Module):
    """A causal toy LM whose code reads the sequence length as a Python ``int`` (its causal mask is
    built at that size), so ``torch.export`` keeps the length fixed and lets only the rows vary: the
    per-shape fallback's model (`hf_ftpipe.runtime.per_shape`). Right padding with a 0 mask and
    ``-100`` labels changes none of its losses, as for a Hugging Face causal LM."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        length = int(input_ids.shape[1])  # export fixes the length here
        causal = torch.ones(length, length, device=input_ids.device).tril()
        hidden = self.embed(input_ids)
        weights = causal * attention_mask[:, None, :].to(hidden.dtype)  # (rows, length, length)
        for layer in self.mix:
            mixed = (weights @ hidden) / weights.sum(-1, keepdim=True).clamp(min=1)
            hidden = hidden + torch.tanh(layer(mixed))
        logits = self.head(hidden)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}
