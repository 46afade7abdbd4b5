"""The cache object ``generate`` holds while the keys and values live on the pipeline's stages.

``model.generate`` keeps a `transformers.cache_utils.Cache`: it asks it how many tokens are cached
(to number and slice the next inputs), passes it to every forward, and has it reorder its rows after
each beam-search step. Through the pipeline the keys and values are kept by each stage's rank for
its own layers (`hf_ftpipe.runtime.kv_decoding.KVDecoder`); `PipelineCache` is the handle ``generate``
holds, every question answered by the decoder. It has no layers of its own: a model's attention
writing into it would mean the eager model ran, which it never does here.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.kv_decoding import KVDecoder

__all__ = ["PipelineCache"]


class PipelineCache(Cache):
    """``generate``'s cache for a pipeline whose stages keep the keys and values (``decoder``)."""

    def __init__(self, decoder: KVDecoder) -> None:
        super().__init__(layers=[])
        self.decoder = decoder

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.decoder.seq_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's step: row ``i`` continues row ``beam_idx[i]`` (on every stage of every rank)."""
        self.decoder.reorder(beam_idx)

    @property
    def is_compileable(self) -> bool:
        return False  # generate must not compile the forward: it is the pipeline's, not a model's

    def update(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise PipelineError(
            "internal: a model layer wrote into the pipeline's cache, so the eager model ran instead of the pipeline"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise PipelineError(
            "the pipeline's key/value cache cannot be rolled back (assisted generation needs that); generate "
            "without an assistant"
        )
