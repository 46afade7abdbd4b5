"""Decoding a causal LM through the pipeline with a key/value cache kept on each stage's rank.

Each stage keeps the keys and values of its own attention layers, per micro-batch of rows, in
buffers made once for ``max_length`` tokens (`SequenceKV`), so a new token costs one token's
work per stage, not the whole prefix's. A call is a token slice at offset `seq_length`
(`hf_ftpipe.runtime.prefix_attention`): the prompt as one slice (prefill), then one token per
step. The rows are split into the engine's micro-batches, which stream through the stages as in
training: a rank runs its forwards in GPipe's order (stage by stage, micro-batches in order)::

    rank 0: 0F0 0F1             (stage 0 sends m0 on before it runs m1)
    rank 1:     1F0 1F1

Sends never block (a stage of one rank may feed a later stage of the same rank, Mixed-Pipe), and
each receive is bounded by the engine's watchdog. Every rank calls every method in lockstep, as
``model.generate`` does on each rank, so `reorder` (beam search) needs no message, and every rank
returns the same logits (broadcast from the rank holding the stage that computes them).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch
from torch import fx, nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.decoding_stages import decoding_stages
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.runtime.prefix_attention import SequenceKV, SliceCursor
from hf_ftpipe.runtime.shapes import MicrobatchShapes, ShapeBook
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.schedules.actions import Action
from hf_ftpipe.schedules.orders import ScheduleGPipe

if TYPE_CHECKING:
    from hf_ftpipe.runtime.engine import PipelineEngine

__all__ = ["KVDecoder", "StepStages"]

logger = logging.getLogger(__name__)


class StepStages(Protocol):
    """What a decoding step runs: this rank's stages with their attention over kept keys and values
    (`DecodingStages`, `hf_ftpipe.runtime.encoder_decoder_stages.EncoderDecoderStages`)."""

    @property
    def specs(self) -> list[StageSpec]: ...
    @property
    def modules(self) -> Mapping[int, fx.GraphModule]: ...
    @property
    def to_variant(self) -> Mapping[str, str]:
        """Planned-graph value → its name in the stages' graph."""
        ...

    cursors: Mapping[int, SliceCursor]
    book: ShapeBook
    logits: str


class KVDecoder:
    """A causal LM's decoding steps through ``engine``, with each stage's keys and values kept on its rank.

    Args:
        engine (`PipelineEngine`): the pipeline (its stages' weights are the ones decoded with).
        model (`nn.Module`): the model the engine was built from, captured once per engine for
            decoding (on the meta device; its weights are not read).
        rows (`int`): rows decoded together (batch × beams).
        max_length (`int`): the most tokens a row will hold, prompt included.

    Raises:
        `PipelineError`: the model cannot be cached (an encoder-decoder, attention that is not
            ``scaled_dot_product_attention``, ...; see `check_cacheable`), with the reason.
    """

    def __init__(self, engine: PipelineEngine, *, model: nn.Module, rows: int, max_length: int) -> None:
        if rows < 1 or max_length < 1:
            raise PipelineError(f"a key/value cache needs rows >= 1 and max_length >= 1, got {rows} and {max_length}")
        self.engine = engine
        self.stages: StepStages = self._decoding_stages(engine, model)
        engine.drain()  # a streaming pipeline decodes with its latest weights
        self.rows, self.max_length = rows, max_length
        sizes = microbatch_rows(rows, engine.num_microbatches)
        self._bounds = [(sum(sizes[:m]), sum(sizes[: m + 1])) for m in range(len(sizes))]
        self._key_padding = [torch.zeros(size, max_length, dtype=torch.bool, device=engine.device) for size in sizes]
        self._sequences = {
            (s, m): SequenceKV(self._key_padding[m]) for s in engine.local_stages for m in range(len(sizes))
        }
        schedule = ScheduleGPipe(engine.stage_rank, len(sizes), engine.schedule.edges)
        self._order = [
            a
            for a in schedule.global_order()
            if a.computation == "F" and engine.stage_rank[a.stage_index] == engine.position
        ]
        self.seq_length = 0
        """Tokens cached so far."""

    @property
    def cache_bytes(self) -> int:
        """What this rank's kept keys and values take (allocated at the first call, for ``max_length``)."""
        return sum(
            t.numel() * t.element_size()
            for seq in self._sequences.values()
            for store in (seq.keys, seq.values)
            for t in store.values()
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The logits of the ``n`` new positions, ``(rows, n, vocab)``, on every rank.

        Args:
            input_ids: ``(rows, n)``, the new tokens (the prompt at the first call).
            attention_mask: ``(rows, seq_length + n)``, the mask of every token so far (0 at padding).
            position_ids: ``(rows, n)``, the new tokens' positions.
            logits_to_keep: as the model's own: only the last ``logits_to_keep`` positions' logits are
                handed to the other ranks and returned (0: all); ``generate`` reads only the last, and
                a prompt's logits for every position are rows × length × vocabulary floats.
        """
        n = int(input_ids.shape[-1])
        end = self.seq_length + n
        self._check(input_ids, attention_mask, position_ids, end)
        device = self.engine.device
        input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        attention_mask = attention_mask.to(device)
        pieces = []
        for m, (first, last) in enumerate(self._bounds):
            self._key_padding[m][:, :end] = attention_mask[first:last].bool()
            pieces.append(
                self.stages.inputs(
                    input_ids[first:last], attention_mask[first:last, self.seq_length :], position_ids[first:last]
                )
            )
        return self._step(pieces, n, min(n, logits_to_keep) if logits_to_keep > 0 else n)

    __call__ = forward

    def _step(self, pieces: list[dict[str, torch.Tensor]], n: int, kept: int) -> torch.Tensor:
        """Run each micro-batch's ``pieces`` (its ``n`` new tokens) through this rank's stages; the
        last ``kept`` positions' logits of every row, on every rank."""
        shapes = [self.stages.book.of(piece) for piece in pieces]
        outputs: dict[tuple[str, int], torch.Tensor] = {}
        for action in self._order:
            try:
                self._run(action, pieces[action.microbatch_index], shapes[action.microbatch_index], outputs)
            except Exception as error:
                self._fail(action, error)
        logits = self._logits(outputs, kept)
        self.engine.messenger.flush()
        if self.seq_length == 0 and self._sequences:
            logger.debug("rank %d keeps %.1f MB of keys and values", self.engine.rank, self.cache_bytes / 2**20)
        self.seq_length += n
        return logits

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` takes the keys and values of row ``beam_idx[i]``, on every stage of this rank
        (beam search, each step). Every rank calls it alike: no message."""
        index = torch.as_tensor(beam_idx, device=self.engine.device).long()
        if index.shape != (self.rows,):
            raise PipelineError(f"reorder takes one row index per row, ({self.rows},), got {tuple(index.shape)}")
        length = self.seq_length
        for stage in self.engine.local_stages:
            sequences = [self._sequences[(stage, m)] for m in range(len(self._bounds))]
            for store in ("keys", "values"):
                for layer in getattr(sequences[0], store):
                    buffers = [getattr(seq, store)[layer] for seq in sequences]
                    whole = torch.cat([b[..., :length, :] for b in buffers]).index_select(0, index)
                    for buffer, (first, last) in zip(buffers, self._bounds, strict=True):
                        buffer[..., :length, :] = whole[first:last]

    def close(self) -> None:
        """Free the kept keys and values."""
        self._sequences.clear()
        self._key_padding.clear()
        for cursor in self.stages.cursors.values():
            cursor.sequence = None

    # -- a step -----------------------------------------------------------------------------

    def _decoding_stages(self, engine: PipelineEngine, model: nn.Module) -> StepStages:
        """This rank's stages for decoding (an encoder-decoder's: `EncoderDecoderKV`)."""
        return decoding_stages(engine, model)

    def _check(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, end: int
    ) -> None:
        if not self._key_padding:
            raise PipelineError("this key/value cache was closed; make a new KVDecoder")
        n = int(input_ids.shape[-1])
        if n < 1:
            raise PipelineError(
                f"`input_ids` has shape {tuple(input_ids.shape)}: a decoding step needs at least one new token"
            )
        expected = {"input_ids": (self.rows, n), "attention_mask": (self.rows, end), "position_ids": (self.rows, n)}
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        for name, shape in expected.items():
            if tuple(given[name].shape) != shape:
                raise PipelineError(
                    f"`{name}` has shape {tuple(given[name].shape)}, expected {shape} ({self.rows} rows, "
                    f"{self.seq_length} tokens cached, {n} new)"
                )
        if end > self.max_length:
            raise PipelineError(
                f"{end} tokens do not fit the key/value cache made for max_length={self.max_length}; "
                "make the KVDecoder with the longest length generation may reach"
            )

    def _run(
        self, action: Action, piece: dict, shapes: MicrobatchShapes, outputs: dict[tuple[str, int], torch.Tensor]
    ) -> None:
        engine, stages = self.engine, self.stages
        s, m = action.stage_index, action.microbatch_index
        spec, module = stages.specs[s], stages.modules[s]
        received = []
        for value in spec.received:
            if (value, m) not in outputs:
                transfer = engine.transfers[value]
                shape = shapes.values[stages.to_variant[value]]
                outputs[(value, m)] = engine.messenger.recv(
                    shape,
                    transfer.dtype,
                    engine.device,
                    transfer.source_rank,
                    self._tag(value, m),
                    f"{value} of micro-batch {m}",
                )
            received.append(outputs[(value, m)])
        sizes = shapes.sizes
        args = [*[piece[name] for name in spec.batch_inputs], *[sizes[name] for name in spec.size_inputs], *received]
        stages.cursors[s].point(self._sequences[(s, m)], self.seq_length)
        autocast = torch.autocast(
            engine.device.type, dtype=engine.autocast_dtype, enabled=engine.autocast_dtype is not None
        )
        with autocast:
            results = module(*args)
        for value, tensor in zip(spec.sent, results, strict=True):
            transfer = engine.transfers.get(value)
            for peer in transfer.reader_ranks if transfer is not None else ():
                engine.messenger.send(
                    tensor.to(transfer.dtype), peer, self._tag(value, m), f"{value} of micro-batch {m}"
                )
            if value == stages.logits or any(engine.stage_rank[c] == engine.position for c in spec.consumers[value]):
                outputs[(value, m)] = tensor

    def _logits(self, outputs: dict[tuple[str, int], torch.Tensor], n: int) -> torch.Tensor:
        """The last ``n`` positions' logits of every row, broadcast from the rank that computed them."""
        engine = self.engine
        output = engine.model_outputs.outputs["logits"]
        if output.rank == engine.position:
            pieces = [outputs[(output.value, m)][:, -n:] for m in range(len(self._bounds))]
            logits = torch.cat(pieces).to(output.dtype)
        else:
            vocab = engine.graph.node(output.value)["output_shapes"][0][-1]
            logits = torch.empty((self.rows, n, vocab), dtype=output.dtype, device=engine.device)
        return engine.messenger.broadcast(logits.contiguous(), output.rank, "logits")

    def _tag(self, value: str, m: int) -> int:
        return self.engine.transfers[value].value_id * self.engine.num_microbatches + m

    def _fail(self, action: Action, error: Exception) -> None:
        context = (
            f"[rank {self.engine.rank}, stage {action.stage_index}] decoding micro-batch {action.microbatch_index}"
        )
        if isinstance(error, PipelineError):
            detail = str(error).removeprefix(f"[rank {self.engine.rank}] ")
            message = report = f"{context}: {detail}"
        else:
            message = f"{context}: {type(error).__name__}: {error}"
            report = message + "\n" + traceback.format_exc(limit=6)
        self.engine.messenger.report_failure(report)
        raise PipelineError(message) from error
