"""Generation through the pipeline: transformers' own ``generate``, with the model's forward run by the pipeline.

Every rank calls ``model.generate`` in lockstep, with ``model.forward`` replaced for the call by a
*pipeline forward* (`pipeline_generate`): it feeds the tokens so far to the pipeline and returns
the logits, which ``PipelineEngine.eval_step`` hands every rank whole. So every rank's ``generate``
sees identical logits and takes identical decisions: greedy and beam search, sampling (from rank 0's
random state: `hf_ftpipe.trainer.generation_randomness`), logits processors, stopping criteria, EOS
and padding, ``length_penalty``, ``num_return_sequences`` are ``generate``'s own code, what it does on
one process by construction. The replacement has the model's own ``forward`` signature, which
``generate`` inspects to decide what to pass.

Encoder-decoders (T5, BART): ``generate`` is given ``encoder_outputs`` whose ``last_hidden_state`` is
a placeholder, each row's index into the batch, so it never runs the encoder itself; it expands
them for beams as it expands any encoder output, and the forward reads each row's encoder inputs
(``input_ids``, ``attention_mask``, any other the pipeline was traced with) by that index. A
T5-family model keeps a key/value cache on the stages
(`hf_ftpipe.runtime.encoder_decoder_decoding.EncoderDecoderKV`): the first forward runs the encoder
and the decoder start token, each later one the new decoder token alone (and a one-token stand-in
for the encoder), with the decoder's and the encoder's keys and values kept per stage. Without it
(``use_cache=False``, another encoder-decoder, or a T5 the stages cannot cache: warned, with the
reason) the forward gets the decoder tokens so far and feeds ``labels`` whose right shift (the
decoder inputs the model makes from them) equals them, padded to the traced label length where the
graph fixes it: each new token then costs a whole forward (the encoder and the decoder prefix again).

Causal LMs (GPT-2, Llama) keep a key/value cache on the stages (`hf_ftpipe.runtime.kv_decoding`):
``generate`` holds a `PipelineCache` that the forward hands the prompt, then each new token, so a new
token costs one token's work per stage; beam search reorders the stages' rows through it. With
``use_cache=False``, or for a model the stages cannot cache (warned with the reason), the forward
gets the whole sequence so far instead. A graph traced without ``position_ids`` numbers positions
0, 1, ... itself, where ``generate`` numbers a left-padded row from its first real token; so each
row's real tokens are moved to its front (in order), where the two agree, and the logits moved
back. Attention sees the same real tokens at the same positions.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, Seq2SeqLMOutput

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import InputInfo
from hf_ftpipe.runtime.encoder_decoder_stages import DECODER_INPUTS
from hf_ftpipe.runtime.kv_decoding import KVDecoder
from hf_ftpipe.trainer.generation_settings import resolved_generation_config
from hf_ftpipe.trainer.pipeline_cache import PipelineCache
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["DecoderFor", "LogitsOf", "pipeline_generate"]

logger = get_logger(__name__)

LogitsOf = Callable[..., torch.Tensor]
"""Runs the pipeline on a batch of the traced graph's inputs and returns its logits, ``(rows,
length, vocab)``, identical on every rank (`PipeEvaluation._pipeline_logits`); given a ``position``,
that position's only, ``(rows, 1, vocab)``."""

DecoderFor = Callable[[int, int], KVDecoder]
"""Makes the pipeline's key/value cache for ``rows`` rows of up to ``max_length`` tokens (`KVDecoder`;
an encoder-decoder's `EncoderDecoderKV`, whose length counts decoder tokens), or raises `PipelineError`
naming why the model cannot be cached."""

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
_CACHE_INPUT = "cache" if "cache" in _CACHE_FIELDS else "past_key_values"
"""Where ``generate`` keeps the cache, passes it to the forward and reads it back from the output: ``cache``
from transformers 5.24, ``past_key_values`` before."""


def pipeline_generate(
    model: nn.Module,
    logits_of: LogitsOf,
    traced: Mapping[str, InputInfo],
    device: torch.device,
    decoder_for: DecoderFor | None = None,
    **kwargs: Any,
) -> Any:
    """``model.generate(**kwargs)``, with every forward run by the pipeline (every rank must call it
    alike; the random state is the caller's business: `rank0_random_state`).

    Args:
        model: the Hugging Face model (its config and generation settings; its weights are not used).
        logits_of: runs the pipeline on whole sequences (`LogitsOf`).
        traced: the inputs the pipeline was traced with (``engine.graph.inputs``).
        device: where the pipeline takes its inputs (``generate`` may move them to the model's device).
        decoder_for: makes the key/value cache on the stages (`DecoderFor`); with ``use_cache``
            (``generate``'s default) a causal LM or a T5-family model decodes with it, one token's work per
            stage for each new token. A model it cannot cache generates without, with a warning naming why.
        kwargs: ``generate``'s arguments.
    """
    kwargs = dict(kwargs)
    if kwargs.get("inputs") is not None:  # generate's positional `inputs`: the model's main input
        kwargs[getattr(model, "main_input_name", "input_ids")] = kwargs.pop("inputs")
    kwargs["synced_gpus"] = False  # every rank already runs every step: nothing to keep in step
    forward: _EncoderDecoderForward | _CausalForward
    if model.config.is_encoder_decoder:
        forward = _EncoderDecoderForward(model, logits_of, traced, device, kwargs)
    else:
        forward = _CausalForward(logits_of, traced, device)
    decoder = _cache_for(model, decoder_for, kwargs) if decoder_for is not None else None
    if isinstance(forward, _EncoderDecoderForward):
        kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=forward.row_indices)
    if decoder is None:
        _set_generation(kwargs, use_cache=False)
    else:  # generate's own cache would be made beside ours: none of its making
        _set_generation(kwargs, use_cache=True, cache_implementation=None)
        kwargs[_CACHE_INPUT] = PipelineCache(decoder)
    try:
        with _forward_replaced(model, forward):
            return model.generate(**kwargs)
    finally:
        if decoder is not None:
            decoder.close()


def _cache_for(model: nn.Module, decoder_for: DecoderFor, kwargs: dict[str, Any]) -> KVDecoder | None:
    """The stages' key/value cache for ``model.generate(**kwargs)``: as many rows as it decodes together
    (the batch times its beams or sequences per prompt) and as long as they may grow (an encoder-decoder's
    decoder: from its start token); ``None`` where ``use_cache`` is off or the model cannot be cached
    (warned, with the reason)."""
    settings = resolved_generation_config(model, kwargs)
    prompt = kwargs.get(getattr(model, "main_input_name", "input_ids"))
    if not settings.use_cache or not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        return None
    rows = prompt.shape[0] * max(settings.num_beams or 1, settings.num_return_sequences or 1)
    start = prompt.shape[1]
    if model.config.is_encoder_decoder:
        decoder_prompt = kwargs.get("decoder_input_ids")
        start = decoder_prompt.shape[-1] if isinstance(decoder_prompt, torch.Tensor) else 1
    new_tokens = settings.max_new_tokens
    max_length = start + new_tokens if new_tokens is not None else settings.max_length
    try:
        return decoder_for(rows, max(max_length, start + 1))
    except PipelineError as error:
        logger.warning("generating without a key/value cache (each new token reruns the whole sequence): %s", error)
        return None


def _set_generation(kwargs: dict[str, Any], **settings: Any) -> None:
    """Generation ``settings`` where ``generate`` reads them: in the ``generation_config`` given, else as
    keywords (transformers 5.24 warns of keywords beside a ``generation_config``)."""
    given = kwargs.get("generation_config")
    if isinstance(given, GenerationConfig):
        kwargs["generation_config"] = copy.deepcopy(given)
        for name, value in settings.items():
            setattr(kwargs["generation_config"], name, value)
            kwargs.pop(name, None)
    else:
        kwargs.update(settings)


@contextmanager
def _forward_replaced(model: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``model.forward`` is ``forward`` inside the body, with the model's own signature (``generate`` reads
    it to decide what to pass: ``attention_mask``, ``position_ids``, the cache's name, ``logits_to_keep``)."""
    signature = inspect.signature(model.forward)

    def pipeline_forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs.update(signature.bind_partial(*args).arguments)
        return forward(**kwargs)

    pipeline_forward.__signature__ = signature  # type: ignore[attr-defined]
    previous = model.__dict__.get("forward")
    model.forward = pipeline_forward
    try:
        yield
    finally:
        if previous is None:
            del model.forward
        else:
            model.forward = previous


class _EncoderDecoderForward:
    """The pipeline's logits for the decoder tokens so far (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        logits_of: LogitsOf,
        traced: Mapping[str, InputInfo],
        device: torch.device,
        kwargs: dict[str, Any],
    ) -> None:
        if "labels" not in traced:
            raise PipelineError(
                "generation feeds the decoder tokens so far to the pipeline as `labels`, but it was traced on a "
                "batch without labels; train or evaluate on batches with (padded) labels before generating"
            )
        self.logits_of, self.traced, self.device = logits_of, traced, device
        self.encoder_inputs = {
            name: kwargs[name].to(device)
            for name in traced
            if name not in DECODER_INPUTS and isinstance(kwargs.get(name), torch.Tensor)
        }
        main_input = getattr(model, "main_input_name", "input_ids")
        main = kwargs.get(main_input)
        if not isinstance(main, torch.Tensor):
            raise PipelineError(
                f"generation through the pipeline needs the encoder's `{main_input}` (a tensor): pass it to generate"
            )
        self.row_indices = torch.arange(main.shape[0], device=main.device)[:, None]
        """``(batch, 1)``: the placeholder encoder output, each row's index into the batch."""
        label = traced["labels"]
        self.fixed_length = None if 1 in label.varying or label.shape is None else int(label.shape[1])
        self.decoder_start_token_id = model.config.decoder_start_token_id
        self.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.prepare_decoder_input_ids = getattr(model, "prepare_decoder_input_ids_from_labels", None)

    def __call__(
        self,
        *,
        decoder_input_ids: torch.Tensor,
        encoder_outputs: Any,
        cache: PipelineCache | None = None,
        past_key_values: PipelineCache | None = None,
        **ignored: Any,
    ) -> Seq2SeqLMOutput:
        rows = encoder_outputs[0][:, 0]  # the placeholder (expanded for beams): batch row of each row
        batch = {name: value[rows.to(self.device)] for name, value in self.encoder_inputs.items()}
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, PipelineCache):  # the new decoder tokens only; the encoder at the first call alone
            encoder = batch if cache.get_seq_length() == 0 else None
            logits = cache.decoder.forward(decoder_input_ids.to(self.device), encoder)  # on every rank
            return Seq2SeqLMOutput(logits=logits, **{_CACHE_INPUT: cache})
        length = decoder_input_ids.shape[1]
        width = length if self.fixed_length is None else self.fixed_length
        if length > width:
            raise PipelineError(
                f"the pipeline was traced with labels of length {width}, so it can feed the decoder at most {width} "
                f"tokens, not {length}; lower `max_length` / `max_new_tokens` (at most {width} new tokens) or trace "
                "with longer (padded) labels"
            )
        decoder = decoder_input_ids.to(self.device)
        padded = nn.functional.pad(decoder, (0, width - length), value=self.pad_token_id)
        if "decoder_input_ids" in self.traced:  # fed as they are; labels only make a loss nobody reads
            batch["decoder_input_ids"] = padded
        elif not bool((decoder[:, 0] == self.decoder_start_token_id).all()):
            raise PipelineError(
                f"the decoder inputs begin with {decoder[:, 0].unique().tolist()}, but the model makes its decoder "
                f"inputs from `labels` behind its `decoder_start_token_id` ({self.decoder_start_token_id}); "
                "generate with that decoder start token"
            )
        # labels [y1 .. y_{n-1}, pad ...]: their right shift is [start, y1 .. y_{n-1}, pad ...], the tokens so far
        labels = nn.functional.pad(padded[:, 1:], (0, 1), value=self.pad_token_id)
        batch["labels"] = labels
        if "decoder_attention_mask" in self.traced:
            batch["decoder_attention_mask"] = torch.ones_like(labels)
        # position i sees decoder tokens 0..i only; generate reads the last one's logits alone
        logits = self.logits_of(batch, position=length - 1)  # (rows, 1, vocab)
        return Seq2SeqLMOutput(logits=logits)  # generate moves them to its tokens' device


class _CausalForward:
    """The pipeline's logits for the whole sequence so far (see the module's docstring)."""

    def __init__(self, logits_of: LogitsOf, traced: Mapping[str, InputInfo], device: torch.device) -> None:
        self.logits_of, self.traced, self.device = logits_of, traced, device

    def __call__(
        self,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: PipelineCache | None = None,
        past_key_values: PipelineCache | None = None,
        logits_to_keep: int = 0,
        **ignored: Any,
    ) -> CausalLMOutputWithPast:
        if input_ids is None:
            raise PipelineError(
                "generation through the pipeline starts from token ids: the pipeline was traced on `input_ids`, "
                "not `inputs_embeds`; pass `input_ids`"
            )
        cache = cache if cache is not None else past_key_values
        input_ids = input_ids.to(self.device)
        if cache is not None:
            return self._decode(cache, input_ids, attention_mask, position_ids, logits_to_keep)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        batch = {"input_ids": input_ids}
        if "position_ids" in self.traced:
            batch["position_ids"] = _positions(mask) if position_ids is None else position_ids.to(self.device)
            order = None
        else:
            _check_positions(mask, position_ids)
            order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
            batch["input_ids"], mask = input_ids.gather(1, order), mask.gather(1, order)
        if "attention_mask" in self.traced:
            batch["attention_mask"] = mask
        elif not bool(mask.all()):
            raise PipelineError(
                "the prompts are padded (`attention_mask` has zeros), but the pipeline was traced without an "
                "`attention_mask`: generate from unpadded prompts, or trace on batches with an attention mask"
            )
        logits = self.logits_of(batch)  # (rows, length, vocab)
        if order is not None:
            logits = logits.gather(1, torch.argsort(order, dim=1)[..., None].expand_as(logits))
        return CausalLMOutputWithPast(logits=logits)

    def _decode(
        self,
        cache: PipelineCache,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        logits_to_keep: int,
    ) -> CausalLMOutputWithPast:
        """The new tokens only (the prompt, then one per row per step), through the stages' caches; only
        the last ``logits_to_keep`` positions' logits (``generate`` asks for 1) cross between ranks."""
        rows, new = input_ids.shape
        length = cache.get_seq_length() + new
        # generate drops a mask of all ones; the cache takes the mask of every token so far
        mask = torch.ones(rows, length, dtype=torch.long, device=self.device)
        if attention_mask is not None:
            mask = attention_mask.to(self.device)
        positions = _positions(mask)[:, -new:] if position_ids is None else position_ids.to(self.device)
        logits = cache.decoder.forward(input_ids, mask, positions, logits_to_keep=logits_to_keep)  # on every rank
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_INPUT: cache})


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s positions: each row's real tokens numbered from 0 (padding: 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _check_positions(mask: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    """A graph that numbers positions itself takes only ``generate``'s numbering of left-padded rows
    (each real token at the count of real tokens before it)."""
    if position_ids is None:
        return
    position_ids = position_ids.to(mask.device)
    real = mask == 1
    if not bool((position_ids[real] == _positions(mask)[real]).all()):
        raise PipelineError(
            "generate numbers some tokens at other positions than the count of real tokens before them (it does "
            "so after right padding, or with `position_ids` given), but the pipeline was traced without "
            "`position_ids` (its graph numbers positions itself) and generates here without a key/value cache: "
            "pad the prompts on the left (`tokenizer.padding_side = 'left'`) and drop `position_ids`, or generate "
            "with the cache (`use_cache=True`)"
        )
