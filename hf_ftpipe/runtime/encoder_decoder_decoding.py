"""Decoding a T5-family encoder-decoder through the pipeline with a key/value cache kept on each stage's rank.

As a causal LM's (`hf_ftpipe.runtime.kv_decoding.KVDecoder`, whose streaming of micro-batches
through the stages, lockstep calls and logits broadcast this reuses): the first call runs the
encoder on the real input and the decoder on its first tokens (the decoder start token), keeping
each stage's decoder self-attention keys and values and the cross-attention keys, values and
encoder padding mask; every later call runs one new decoder token, and a one-token stand-in for
the encoder, so it costs one token's work per stage whatever the prefix's length (see
`hf_ftpipe.runtime.encoder_decoder_stages` for the attention calls). Beam search's reorder moves
every kept row, self- and cross-attention's, on every rank alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.encoder_decoder_stages import (
    CrossKV,
    EncoderDecoderStages,
    encoder_decoder_stages,
    relative_position_bias,
)
from hf_ftpipe.runtime.kv_decoding import KVDecoder, StepStages
from hf_ftpipe.runtime.shapes import MicrobatchShapes
from hf_ftpipe.schedules.actions import Action

if TYPE_CHECKING:
    from hf_ftpipe.runtime.engine import PipelineEngine

__all__ = ["EncoderDecoderKV"]


class EncoderDecoderKV(KVDecoder):
    """A T5-family model's decoding calls through ``engine``, each stage's keys and values kept on its rank.

    Args:
        engine (`PipelineEngine`): the pipeline (its stages' weights are the ones decoded with).
        model (`nn.Module`): the model the engine was built from (its config and module names).
        rows (`int`): rows decoded together (batch × beams).
        max_length (`int`): the most decoder tokens a row will hold, the start token included.

    Raises:
        `PipelineError`: the model cannot be cached (`hf_ftpipe.runtime.decoding_stages.check_cacheable`,
            `hf_ftpipe.runtime.encoder_decoder_stages.encoder_decoder_stages`), with the reason.
    """

    stages: EncoderDecoderStages

    def __init__(self, engine: PipelineEngine, *, model: nn.Module, rows: int, max_length: int) -> None:
        super().__init__(engine, model=model, rows=rows, max_length=max_length)
        for padding in self._key_padding:
            padding.fill_(True)  # generate masks no decoder token: each sees every one before it
        self._cross = {key: CrossKV() for key in self._sequences}
        bias = relative_position_bias(engine, self.stages, model, max_length)
        for cursor in self.stages.cursors.values():
            cursor.bias = bias
        config = model.config
        self.decoder_start_token_id = config.decoder_start_token_id
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0

    def _decoding_stages(self, engine: PipelineEngine, model: nn.Module) -> StepStages:
        return encoder_decoder_stages(engine, model)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, decoder_input_ids: torch.Tensor, encoder_inputs: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The logits of the last new decoder position, ``(rows, 1, vocab)``, on every rank.

        Args:
            decoder_input_ids: ``(rows, n)``, the new decoder tokens (at the first call: the decoder's
                first tokens, beginning with its start token).
            encoder_inputs: at the first call, the encoder's ``input_ids`` and ``attention_mask``
                (``(rows, source length)``); not read later.
        """
        n = int(decoder_input_ids.shape[-1])
        self._check_step(decoder_input_ids, encoder_inputs)
        device = self.engine.device
        tokens = decoder_input_ids.to(device)
        if self.seq_length == 0:
            encoder = {name: value.to(device) for name, value in (encoder_inputs or {}).items()}
            encoder.setdefault("attention_mask", torch.ones_like(encoder["input_ids"]))
        else:  # the encoder's keys and values are kept: a one-token stand-in whose output nothing reads
            stand_in = torch.full((self.rows, 1), self.pad_token_id, dtype=torch.long, device=device)
            encoder = {"input_ids": stand_in, "attention_mask": torch.ones_like(stand_in)}
        batch = {**encoder, **self._decoder_inputs(tokens)}
        batch = {name: value for name, value in batch.items() if name in self.engine.graph.inputs}
        pieces = [{name: value[first:last] for name, value in batch.items()} for first, last in self._bounds]
        return self._step(pieces, n, 1)

    __call__ = forward

    def _decoder_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the graph takes for the new decoder ``tokens``; sets the filler rows the stages skip."""
        filler = 0
        if not self.stages.labels_only:
            decoder = {"decoder_input_ids": tokens, "labels": torch.full_like(tokens, self.pad_token_id)}
        elif self.seq_length == 0:  # labels [t1 .. t_{n-1}, pad]: shifted behind the start token, the tokens
            decoder = {"labels": nn.functional.pad(tokens[:, 1:], (0, 1), value=self.pad_token_id)}
        else:  # labels [new .., pad]: the decoder runs [start, new ..], the start a filler
            decoder = {"labels": nn.functional.pad(tokens, (0, 1), value=self.pad_token_id)}
            filler = 1
        width = next(iter(decoder.values())).shape[1]
        decoder["decoder_attention_mask"] = torch.ones(self.rows, width, dtype=torch.long, device=tokens.device)
        for cursor in self.stages.cursors.values():
            cursor.filler = filler
        return decoder

    def _check_step(self, decoder_input_ids: torch.Tensor, encoder_inputs: Mapping[str, torch.Tensor] | None) -> None:
        if not self._key_padding:
            raise PipelineError("this key/value cache was closed; make a new EncoderDecoderKV")
        n = int(decoder_input_ids.shape[-1])
        if decoder_input_ids.dim() != 2 or decoder_input_ids.shape[0] != self.rows or n < 1:
            raise PipelineError(
                f"`decoder_input_ids` has shape {tuple(decoder_input_ids.shape)}, expected ({self.rows}, n >= 1): "
                "the new decoder tokens of every row"
            )
        if self.seq_length + n > self.max_length:
            raise PipelineError(
                f"{self.seq_length + n} decoder tokens do not fit the key/value cache made for max_length="
                f"{self.max_length}; make the EncoderDecoderKV with the longest length generation may reach"
            )
        if self.seq_length > 0:
            return
        ids = None if encoder_inputs is None else encoder_inputs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[0] != self.rows:
            given = None if ids is None else tuple(ids.shape)
            raise PipelineError(
                f"the first decoding call runs the encoder: it needs `input_ids` of shape ({self.rows}, source "
                f"length) in `encoder_inputs`, got {given}"
            )
        if self.stages.labels_only and not bool((decoder_input_ids[:, 0] == self.decoder_start_token_id).all()):
            raise PipelineError(
                f"the decoder inputs begin with {decoder_input_ids[:, 0].unique().tolist()}, but the model makes its "
                f"decoder inputs from `labels` behind its `decoder_start_token_id` ({self.decoder_start_token_id}); "
                "generate with that decoder start token"
            )

    def _run(
        self, action: Action, piece: dict, shapes: MicrobatchShapes, outputs: dict[tuple[str, int], torch.Tensor]
    ) -> None:
        self.stages.cursors[action.stage_index].cross = self._cross[(action.stage_index, action.microbatch_index)]
        super()._run(action, piece, shapes, outputs)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` takes row ``beam_idx[i]``'s kept keys and values, the decoder's and the encoder's."""
        super().reorder(beam_idx)
        index = torch.as_tensor(beam_idx, device=self.engine.device).long()
        for stage in self.engine.local_stages:
            caches = [self._cross[(stage, m)] for m in range(len(self._bounds))]
            for store in ("keys", "values", "masks"):
                for layer, first_piece in getattr(caches[0], store).items():
                    if first_piece is None:
                        continue
                    whole = torch.cat([getattr(cache, store)[layer] for cache in caches]).index_select(0, index)
                    for cache, (first, last) in zip(caches, self._bounds, strict=True):
                        getattr(cache, store)[layer] = whole[first:last]

    @property
    def cache_bytes(self) -> int:
        """What this rank's kept keys and values take, the decoder's and the encoder's."""
        kept = [t for cache in self._cross.values() for store in (cache.keys, cache.values) for t in store.values()]
        return super().cache_bytes + sum(t.numel() * t.element_size() for t in kept)

    def close(self) -> None:
        super().close()
        self._cross.clear()
        for cursor in self.stages.cursors.values():
            cursor.cross = cursor.bias = None
