"""The executor: runs one rank's lowered program, its actions and its SENDs and RECVs.

The program comes from the lowering (`hf_ftpipe.schedules.lowering`), which every rank derives
from the same global order: a RECV is posted where the program puts it, ahead of the action that
reads it; the SENDs that follow an action send what it produced. Activations go straight from the
stage that produces them to every rank with a stage that reads them, adjacent or not.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import fx
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.deliveries import Deliveries
from hf_ftpipe.runtime.executor_context import ExecutorContext, LossFunction
from hf_ftpipe.runtime.messages import Transfer
from hf_ftpipe.runtime.split_backward import collecting, defer_weight_gradients, whole_products
from hf_ftpipe.runtime.stage import StageSpec
from hf_ftpipe.runtime.state import MicrobatchState
from hf_ftpipe.schedules.actions import Action
from hf_ftpipe.schedules.lowering import Comm, Op, whole_backwards

__all__ = ["Executor", "LossFunction"]

_DOING = {"F": "forward", "B": "backward", "W": "weight gradients", "U": "weight update"}


class Executor:
    """Runs lowered programs on this rank's stages.

    Args:
        context (`ExecutorContext`): the rank's pipeline, fixed for the run.
        update_norms (`list[torch.Tensor]`): where a streaming schedule's updates put their gradient norms.
    """

    def __init__(self, context: ExecutorContext, update_norms: list[torch.Tensor]) -> None:
        self.context = context
        self.update_norms = update_norms
        self.loss_scale = 1.0
        """Multiplies the loss's gradient at the start of the backward (float16 loss scaling,
        `hf_ftpipe.trainer.loss_scale`); the gradients come out scaled by it, the loss returned is not."""
        self.loss_function: LossFunction | None = None
        """Training's loss from the model's outputs on the loss stage, in place of the traced one."""
        self.optimizer: torch.optim.Optimizer | None = None
        """What ``async`` and ``2bw`` step inside the pipeline (`RankWeights.attach_optimizer`)."""
        self.max_grad_norm: float | None = None
        self._outbox: dict[str, torch.Tensor] = {}
        self._whole: set[tuple[int, int, int | None]] = set()
        """The split backwards of the program running that run whole (`whole_backwards`): their W has nothing left."""
        self._local_readers = Counter(value for s in context.local_stages for value in context.specs[s].received)
        """How many of this rank's stages read each value their forwards receive."""
        self.reset()

    def reset(self) -> None:
        """A new pipeline: per-micro-batch state and messages forgotten (streaming schedules carry
        them from one step to the next until a drain)."""
        c = self.context
        self.state = MicrobatchState(actions_per_microbatch=(2 + c.traits.split_backward) * len(c.local_stages))
        self.deliveries = Deliveries(c.messenger, c.limits)
        if c.streaming_weights is not None:
            c.streaming_weights.reset()
        c.slicing.reset()

    def flush(self, older_than: int | None = None) -> None:
        """Wait for the sends (of generations before ``older_than``) and forget the delivered ones."""
        self.context.messenger.flush(older_than)
        self.deliveries.forget_finished()

    def run(self, program: Sequence[Op], training: bool) -> list[tuple[int, torch.Tensor]]:
        """Perform ``program``; returns ``(micro-batch, loss)`` of every loss computed in it, here
        or on the rank that holds the loss stage (those RECVs the lowering puts last)."""
        losses: list[tuple[int, torch.Tensor]] = []
        loss_receives: list[Comm] = []
        self._whole = whole_backwards(program) if training and self.context.traits.split_backward else set()
        i = 0
        while i < len(program):
            op = program[i]
            i += 1
            if isinstance(op, Comm):  # a RECV: the SENDs go with the action they follow
                self._post(op)
                if op.value == self.context.loss_value:
                    loss_receives.append(op)
                continue
            sends = []
            while i < len(program) and isinstance(program[i], Comm) and program[i].kind == "SEND":  # type: ignore[union-attr]
                sends.append(program[i])
                i += 1
            try:
                if op.computation == "F":
                    loss = self._forward(op, training)
                    if loss is not None:
                        losses.append((self._unit(op), loss))
                elif op.computation == "B":
                    self._backward(op)
                elif op.computation == "W":
                    for deferred in self.state.deferred.pop((op.stage_index, self._unit(op)), []):
                        deferred.apply()  # then x and the product's gradient go
                else:
                    assert self.context.streaming_weights is not None and self.optimizer is not None
                    if self.context.replica_gradients is not None:  # 2bw: once per weight version
                        pending = self.context.streaming_weights.pending_grads[op.stage_index]
                        self.context.replica_gradients.sum_pending(op.stage_index, pending)
                    self.context.streaming_weights.update(
                        op.stage_index, self.optimizer, self.max_grad_norm, self.update_norms
                    )
                for comm in sends:
                    self._send(comm, training)  # type: ignore[arg-type]
            except Exception as error:
                self._fail(op, error)
            if op.computation != "U" and training:
                self.state.action_done(self._unit(op))
                if self.context.replica_gradients is not None:  # a stage's last B or W starts its all-reduce
                    self.context.replica_gradients.action_done(op.stage_index, op.computation)
        for comm in loss_receives:
            losses.append((self._unit(comm), self._take(comm, f"the loss of {_unit_name(comm)}")))
        return losses

    def _unit(self, op: Action | Comm) -> int:
        """The key of what this rank keeps for ``op``'s micro-batch (and token slice)."""
        return self.context.slicing.unit(op.microbatch_index, op.slice_index)

    def _stage(self, action: Action) -> tuple[StageSpec, fx.GraphModule]:
        """The stage's data flow and module for ``action``: a token slice's run at its own length, or
        the stage traced at the micro-batch's shape (`hf_ftpipe.runtime.per_shape`)."""
        s, c = action.stage_index, self.context
        stages = c.slicing.variant(action.slice_index) or self.state.shapes[action.microbatch_index].stages
        if stages is not None:
            return stages.specs[s], stages.modules[s]
        return c.specs[s], c.modules[s]

    def _point_slice(self, action: Action) -> None:
        self.context.slicing.point(action.stage_index, action.microbatch_index, action.slice_index)

    def _fail(self, action: Action, error: Exception) -> None:
        context = f"[rank {self.context.rank}, stage {action.stage_index}] {_unit_name(action)}, "
        context += _DOING[action.computation]
        if isinstance(error, PipelineError):  # a transfer failed: say what this rank was doing
            detail = str(error).removeprefix(f"[rank {self.context.rank}] ")
            message, report = f"{context}: {detail}", f"{context}: {detail}"
        else:
            message = f"{context}: {type(error).__name__}: {error}"
            report = message + "\n" + traceback.format_exc(limit=6)
        self.context.messenger.report_failure(report)
        raise PipelineError(message) from error

    def _forward(self, action: Action, training: bool) -> torch.Tensor | None:
        spec, module = self._stage(action)
        if training and self.context.traits.split_backward:  # the products' weight gradients wait for W
            defer_weight_gradients(module)
        if self.context.compiler is not None:
            self.context.compiler.prepare(module)
        m = self._unit(action)
        leaves = []
        for value in spec.received:
            leaf = self._incoming(value, action).detach()
            if training and self.context.graph.node(value)["requires_grad"] and leaf.is_floating_point():
                leaf.requires_grad_(True)
            leaves.append(leaf)
            if training:
                self.state.value_read(value, m, self._local_readers[value])
        sizes = self.state.shapes[m].sizes if spec.size_inputs else {}
        args = [
            *[self.state.data[m][name] for name in spec.batch_inputs],
            *[sizes[name] for name in spec.size_inputs],
            *leaves,
        ]
        self._point_slice(action)
        if training and self.context.streaming_weights is not None:
            older = sum(1 for stage, _ in self.state.saved if stage == spec.stage_index)
            weights = self.context.streaming_weights.forward_weights(spec.stage_index, m, older, self.optimizer)

            def run(*inputs: Any) -> tuple[torch.Tensor, ...]:
                return functional_call(module, weights, inputs, strict=False)
        else:
            run = module
        autocast = torch.autocast(
            self.context.device.type, dtype=self.context.autocast_dtype, enabled=self.context.autocast_dtype is not None
        )
        with torch.set_grad_enabled(training), autocast, self._products(action):
            if training and self.context.recompute:  # keep the inputs only; run the forward again in backward
                outputs = checkpoint(run, *args, use_reentrant=False)
            else:
                outputs = run(*args)
        if training and self.loss_function is not None and "loss" in spec.model_outputs:
            outputs = self._loss_from_outputs(spec, leaves, outputs, m)
        if training:
            self.state.saved[(spec.stage_index, m)] = (leaves, outputs)
        self.context.slicing.forward_done(spec.stage_index, action.microbatch_index, action.slice_index, training)
        self._outbox = {}
        for value, tensor in zip(spec.sent, outputs, strict=True):
            if spec.consumers[value] and any(
                self.context.stage_rank[c] == self.context.position for c in spec.consumers[value]
            ):
                self.state.outputs[(value, m)] = tensor
            elif not training:
                self.state.outputs[(value, m)] = tensor  # model outputs, collected by eval_step
            self._outbox[value] = tensor
        if "loss" in spec.model_outputs:
            if training:
                self.state.loss_seed[m] = self._seed(m)
            return outputs[spec.sent.index(spec.model_outputs["loss"])].detach()
        return None

    def _loss_from_outputs(
        self, spec: StageSpec, leaves: list[torch.Tensor], outputs: Sequence[torch.Tensor], m: int
    ) -> tuple[torch.Tensor, ...]:
        """``outputs`` with the traced loss replaced by `loss_function`'s, from the model outputs this
        stage computes or receives; the backward starts from it."""
        named = {}  # in the model's output order: ``outputs[0]`` is the model's first output
        for name, value in zip(self.context.graph.output_names, self.context.graph.outputs, strict=False):
            if name in spec.model_outputs:
                named[name] = outputs[spec.sent.index(value)]
            elif value in spec.received:  # routed here (`plan_stages`'s ``loss_reads``) or read anyway
                named[name] = leaves[spec.received.index(value)]
        assert self.loss_function is not None
        try:
            loss = self.loss_function(m, named, self.state.data[m])
        except KeyError as error:
            name = error.args[0] if error.args else None
            if not isinstance(name, str) or name in named or name not in self.context.graph.output_names:
                raise
            raise PipelineError(self._unserved(name, spec.stage_index, sorted(named))) from error
        replaced = list(outputs)
        replaced[spec.sent.index(spec.model_outputs["loss"])] = loss
        return tuple(replaced)

    def _unserved(self, name: str, loss_stage: int, served: list[str]) -> str:
        """Why the loss read output ``name`` in vain: the stage holding it did not send it here."""
        holder = next((spec.stage_index for spec in self.context.specs if name in spec.model_outputs), None)
        rank = None if holder is None else self.context.messenger.rank_of(self.context.stage_rank[holder])
        where = "no stage" if holder is None else f"stage {holder} (rank {rank})"
        return (
            f"the loss computed from the model's outputs read `{name}`, which {where} produces, but the loss "
            f"stage {loss_stage} was sent only {served}: the pipeline sends it the outputs the loss depends on; "
            f"compute the loss from those, or compute the part that needs `{name}` inside the model's forward"
        )

    def _backward(self, action: Action) -> None:
        spec, _ = self._stage(action)
        m = self._unit(action)
        leaves, outputs = self.state.saved.pop((spec.stage_index, m))
        roots, grads = [], []
        for value, tensor in zip(spec.sent, outputs, strict=True):
            if spec.model_outputs.get("loss") == value:
                seed = self.state.loss_seed.pop(m, 0.0)
                if seed and tensor.requires_grad:  # weight 0: a NaN loss must not reach the gradients
                    roots.append(tensor)
                    grads.append(torch.full_like(tensor, seed))
            elif spec.consumers.get(value):
                grad = self._output_grad(value, action)
                if grad is not None and tensor.requires_grad:
                    roots.append(tensor)
                    grads.append(grad.to(tensor.dtype))  # autocast may have made a bfloat16 output
        if roots:
            self._point_slice(action)  # a recomputed forward reads the sequence's keys and values
            if self.context.traits.split_backward and not self._runs_whole(action):
                with collecting() as deferred:  # B: input gradients now; the products' weight gradients at W
                    torch.autograd.backward(roots, grads)
                self.state.deferred[(spec.stage_index, m)] = deferred
            else:
                with self._products(action):
                    torch.autograd.backward(roots, grads)
        self.context.slicing.backward_done(spec.stage_index, action.microbatch_index, action.slice_index)
        if self.context.streaming_weights is not None:
            self.context.streaming_weights.backward_done(spec.stage_index, m)
        for value, leaf in zip(spec.received, leaves, strict=True):
            if leaf.requires_grad:  # summed here; a SEND after this backward takes it to a remote producer
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                key = (value, m)
                self.state.grads[key] = grad if key not in self.state.grads else self.state.grads[key] + grad

    def _runs_whole(self, action: Action) -> bool:
        return (action.stage_index, action.microbatch_index, action.slice_index) in self._whole

    def _products(self, action: Action) -> AbstractContextManager[None]:
        """How ``action``'s stage runs its products: as the plain ops where its backward runs whole
        (forward, backward and a recomputed forward alike), else as the module has them."""
        return whole_products() if self._runs_whole(action) else nullcontext()

    def _seed(self, m: int) -> float:
        """The gradient of the step's loss with respect to micro-batch ``m``'s loss."""
        weight = self.state.loss_weight.get(m, 1.0 / self.context.num_microbatches) * self.loss_scale
        if self.context.traits.updates_every_group:  # the update averages over its own group of micro-batches
            return weight * self.context.num_microbatches / self.context.gradient_accumulation_steps
        return weight

    # -- data movement ----------------------------------------------------------------------

    def _send(self, comm: Comm, training: bool) -> None:
        transfer = self.context.transfers[comm.value]
        m = self._unit(comm)
        if not comm.backward:
            send_id = self.context.messenger.send(
                self._outbox[comm.value].to(transfer.dtype),
                comm.peer,
                self._tag(transfer, m, backward=False),
                f"{comm.value} of {_unit_name(comm)}",
            )
            if training and transfer.carries_gradient and comm.peer in transfer.reader_ranks:
                self.deliveries.activation_sent(comm.value, m, comm.peer, send_id)
            return
        send_id = self.context.messenger.send(
            self.state.grads.pop((comm.value, m)).to(transfer.dtype),
            comm.peer,
            self._tag(transfer, m, backward=True),
            f"gradient of {comm.value} for {_unit_name(comm)}",
        )
        self.deliveries.gradient_sent(transfer.producer_stage, m, send_id)

    def _post(self, comm: Comm) -> None:
        transfer = self.context.transfers[comm.value]
        tag = self._tag(transfer, self._unit(comm), comm.backward)
        shape = self.state.shapes[self._unit(comm)].values[comm.value]  # the unit's own (`runtime.shapes`)
        self.state.posted[comm] = self.context.messenger.post_recv(
            shape, transfer.dtype, self.context.device, comm.peer, tag
        )

    def _take(self, comm: Comm, what: str) -> torch.Tensor:
        peer = self.context.messenger.rank_of(comm.peer)
        if comm not in self.state.posted:  # every message is lowered; this would be a bug
            raise PipelineError(f"[rank {self.context.rank}] {what} from rank {peer} was never expected")
        work, buffer = self.state.posted.pop(comm)
        self.context.messenger.wait(work, f"receiving {what} from rank {peer}", peers=(peer,))
        return buffer

    def _incoming(self, value: str, action: Action) -> torch.Tensor:
        m = self._unit(action)
        if (value, m) in self.state.outputs:
            return self.state.outputs[(value, m)]
        if (value, m) not in self.state.received:
            transfer = self.context.transfers[value]
            comm = Comm("RECV", value, action.microbatch_index, False, transfer.source_rank, action.slice_index)
            self.state.received[(value, m)] = self._take(comm, f"{value} of {_unit_name(comm)}")
            self.deliveries.forward_ran(transfer.producer_stage, m)
        return self.state.received[(value, m)]

    def _output_grad(self, value: str, action: Action) -> torch.Tensor | None:
        """The gradient of a sent value: local consumers' share plus one message per remote rank."""
        m = self._unit(action)
        grad = self.state.grads.pop((value, m), None)
        transfer = self.context.transfers.get(value)
        if transfer is not None and transfer.carries_gradient:
            for src in transfer.reader_ranks:
                comm = Comm("RECV", value, action.microbatch_index, True, src, action.slice_index)
                remote = self._take(comm, f"gradient of {value} for {_unit_name(comm)}")
                grad = remote if grad is None else grad + remote
                self.deliveries.gradient_came_back(value, m, src)
        return grad

    def _tag(self, transfer: Transfer, unit: int, backward: bool) -> int:
        # Messages with one tag between two ranks arrive in the order sent, so indices may wrap.
        units = self.context.scheduled_microbatches * self.context.slicing.num_slices
        return (transfer.value_id * 2 + int(backward)) * units + unit % units


def _unit_name(op: Action | Comm) -> str:
    if op.slice_index is None:
        return f"micro-batch {op.microbatch_index}"
    return f"micro-batch {op.microbatch_index} slice {op.slice_index}"
