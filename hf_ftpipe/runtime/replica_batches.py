"""A replica's share of each global mini-batch, and the sums and gathers that make its results global.

Every rank loads the same global mini-batch. It is cut into ``D × M`` micro-batches exactly as one
pipeline of ``D × M`` micro-batches would cut it (`microbatch_rows`), and replica ``d`` runs the
contiguous micro-batches ``d·M .. d·M + M − 1``: over all replicas, the same samples in the same
micro-batches as one process. A short batch may leave a later replica fewer micro-batches, or none:
its step is then empty, but it still joins every collective. The step's loss is the sum of the
replicas' weighted losses (their weights are the global batch's); an evaluation's outputs are each
replica's share, gathered in replica order over the data group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.microbatches import batch_losses, batch_rows, check_loss_weights, mean_loss, microbatch_rows
from hf_ftpipe.runtime.model_outputs import ModelOutputs
from hf_ftpipe.runtime.replicas import ReplicaLayout
from hf_ftpipe.runtime.step_inputs import StepInputs

__all__ = ["ReplicaBatches"]

_MAX_DIMS = 8
"""The most dimensions of an evaluation output whose shape replicas exchange."""


class ReplicaBatches:
    """One replica's share of the global batches (with one replica: all of them, as they are).

    Args:
        layout (`ReplicaLayout`): the job's replicas.
        rank (`int`): this process's global rank.
        group (`dist.ProcessGroup`, *optional*): the data group (``None``: one replica).
        messenger (`Messenger`): bounds every wait.
        inputs (`StepInputs`): splits a replica's rows into its micro-batches.
        model_outputs (`ModelOutputs`): the outputs an evaluation returns (their dtypes).
    """

    def __init__(
        self,
        layout: ReplicaLayout,
        rank: int,
        group: dist.ProcessGroup | None,
        messenger: Messenger,
        inputs: StepInputs,
        model_outputs: ModelOutputs,
    ) -> None:
        self.model_outputs = model_outputs
        self.layout = layout
        self.replica, self.position = layout.replica_of(rank), layout.position_of(rank)
        self.group = group
        self.messenger = messenger
        self.inputs = inputs

    @property
    def replicated(self) -> bool:
        return self.layout.data_parallel_size > 1

    # -- training ---------------------------------------------------------------------------

    def training(
        self,
        batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        loss_weights: Sequence[float] | None,
        limit: int,
        streaming: str | None,
    ) -> tuple[list[list[dict[str, Any]]], list[float]]:
        """This replica's micro-batches of a global step (one mini-batch or a list of up to ``limit``),
        by mini-batch (an empty list where it runs none), and one loss weight for each.

        ``loss_weights`` has one weight per micro-batch of the global batch (``D × M`` per mini-batch,
        fewer for a short one), by default equal. A streaming schedule runs whole mini-batches on every
        replica, so a batch with fewer than ``D × M`` rows is refused on every rank alike.
        """
        if not self.replicated:
            pieces = self.inputs.split_batches(batch, limit, streaming)
            return pieces, check_loss_weights(loss_weights, sum(len(piece) for piece in pieces))
        batches = [batch] if isinstance(batch, Mapping) else list(batch)
        if not 1 <= len(batches) <= limit:
            raise PipelineError(f"a training step takes 1 to {limit} mini-batches, got {len(batches)}")
        D, M = self.layout.data_parallel_size, self.inputs.num_microbatches  # noqa: N806 (the paper's names)
        shares = [self._share(one) for one in batches]
        global_weights = check_loss_weights(loss_weights, sum(len(sizes) for _, sizes in shares))
        pieces, weights, first = [], [], 0
        for part, sizes in shares:
            if streaming is not None and len(sizes) < D * M:
                raise PipelineError(
                    f"the {streaming!r} schedule streams whole mini-batches of num_microbatches={M} micro-batches on "
                    f"each of data_parallel_size={D} replicas, but this batch has {sum(sizes)} rows, too few for "
                    f"{D * M} micro-batches; drop the short last batch (dataloader_drop_last=True) or use gpipe or 1f1b"
                )
            pieces.append([] if part is None else self.inputs.split(part, streaming=streaming))
            offset = first + self.replica * M
            weights += global_weights[offset : offset + len(pieces[-1])]
            first += len(sizes)
        return pieces, weights

    def step_loss(
        self,
        losses: list[tuple[int, torch.Tensor]],
        loss_weight: dict[int, float],
        units: int,
        per_batch: Sequence[int],
        whole_batch: bool,
        device: torch.device,
    ) -> torch.Tensor:
        """The step's loss on every rank: of one mini-batch a scalar (`mean_loss`), of a list one per
        mini-batch (`batch_losses`); with replicas the sum of theirs (an empty replica adds 0)."""
        if whole_batch:
            local = mean_loss(losses, loss_weight, units, device) if units else torch.zeros((), device=device)
        else:
            local = batch_losses(losses, loss_weight, per_batch, device)
        if not self.replicated:
            return local
        assert self.group is not None
        local = local.to(device, torch.float32).clone()
        return self.messenger.all_reduce(local, self.group, "the replicas' losses")

    # -- evaluation -------------------------------------------------------------------------

    def evaluation(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This replica's micro-batches of an evaluation batch (cut as in training; maybe none)."""
        if not self.replicated:
            return self.inputs.split(batch, training=False)
        part, _ = self._share(batch)
        return [] if part is None else self.inputs.split(part, training=False)

    def gather_outputs(
        self, outputs: Mapping[str, torch.Tensor], output_names: Sequence[str], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Each output of ``output_names`` the model has, concatenated over the replicas, in order.

        A replica's shares differ in their first dimension only (rows or micro-batches), so the
        replicas first exchange their shapes, then each broadcasts its own over the data group.
        """
        if not self.replicated:
            return dict(outputs)
        assert self.group is not None
        dtypes = {n: self.model_outputs.outputs[n].dtype for n in output_names if n in self.model_outputs.outputs}
        names = list(dtypes)
        shapes = torch.full((len(names), _MAX_DIMS + 1), -1, dtype=torch.long, device=device)
        for i, name in enumerate(names):
            if name in outputs:
                shape = outputs[name].shape
                shapes[i, 0] = len(shape)
                shapes[i, 1 : 1 + len(shape)] = torch.tensor(shape)
        everyone = [torch.empty_like(shapes) for _ in range(self.layout.data_parallel_size)]
        work = dist.all_gather(everyone, shapes, group=self.group, async_op=True)
        self.messenger.wait(work, "gathering the replicas' output shapes", peers=self._peers())
        gathered = {}
        for i, name in enumerate(names):
            pieces = []
            for d, theirs in enumerate(everyone):
                ndim = int(theirs[i, 0])
                if ndim < 0:  # an empty share
                    continue
                src = self.layout.global_rank(d, self.position)
                if d == self.replica:
                    tensor = outputs[name].contiguous()
                else:
                    tensor = torch.empty(tuple(theirs[i, 1 : 1 + ndim].tolist()), dtype=dtypes[name], device=device)
                work = dist.broadcast(tensor, src, group=self.group, async_op=True)
                self.messenger.wait(
                    work, f"gathering {name} from rank {src}", peers=(src,) if d != self.replica else self._peers()
                )
                pieces.append(tensor)
            gathered[name] = torch.cat(pieces)
        return gathered

    # -- helpers ----------------------------------------------------------------------------

    def _share(self, batch: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
        """This replica's rows of ``batch`` (``None``: none) and the rows of every micro-batch of it."""
        rows = batch_rows(self.inputs.graph, batch)
        M = self.inputs.num_microbatches  # noqa: N806
        sizes = microbatch_rows(rows, self.layout.data_parallel_size * M)
        mine = sizes[self.replica * M : (self.replica + 1) * M]
        if not mine:
            return None, sizes
        start, count = sum(sizes[: self.replica * M]), sum(mine)
        return {name: _rows_of(value, rows, start, count) for name, value in batch.items()}, sizes

    def _peers(self) -> tuple[int, ...]:
        return tuple(r for r in self.layout.data_ranks(self.position) if r != self.messenger.rank)


def _rows_of(value: Any, rows: int, start: int, count: int) -> Any:
    """Rows ``start .. start + count`` of a batch entry that has one row per sample; others as they are."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value
    if isinstance(value, torch.Tensor | list | tuple) and len(value) == rows:
        return value[start : start + count]
    return value
