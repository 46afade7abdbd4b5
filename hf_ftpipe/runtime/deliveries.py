"""Which of this rank's sends are certainly received, so that their tensors can go before the step ends.

`Messenger.flush` ends a step by waiting for every send, and gloo reports a send complete only
once it is waited on: without this, a stage would keep every micro-batch's activations and
gradients that it sent until the end of the step, where the partitioner's memory rules count the
micro-batches in flight. What a peer does next proves what it received:

- an activation's gradient came back from a reader, so that reader has the activation;
- stage s ran its forward of micro-batch m, so (a stage holds at most ``limits[s]`` micro-batches
  between forward and backward) its backwards up to m − ``limits[s]`` are done, and they took
  every gradient sent to them.

Waiting on a send so proven returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_ftpipe.runtime.comm import Messenger

__all__ = ["Deliveries"]


class Deliveries:
    """The sends of one rank that wait for proof of delivery, and the proofs as they come."""

    def __init__(self, messenger: Messenger, limits: Sequence[int]) -> None:
        self.messenger = messenger
        self.limits = list(limits)
        self._activations: dict[tuple[str, int, int], int] = {}
        """(value, micro-batch, reader rank) → send id, until its gradient comes back."""
        self._gradients: list[tuple[int, int, int]] = []
        """(producer stage, micro-batch, send id) of each gradient sent."""

    def activation_sent(self, value: str, m: int, dst: int, send_id: int) -> None:
        self._activations[(value, m, dst)] = send_id

    def gradient_came_back(self, value: str, m: int, src: int) -> None:
        send_id = self._activations.pop((value, m, src), None)
        if send_id is not None:
            self.messenger.delivered(send_id)

    def gradient_sent(self, producer_stage: int, m: int, send_id: int) -> None:
        self._gradients.append((producer_stage, m, send_id))

    def forward_ran(self, stage: int, m: int) -> None:
        """An activation of ``stage``'s forward of micro-batch ``m`` arrived."""
        up_to = m - self.limits[stage]
        keep = []
        for entry in self._gradients:
            if entry[0] == stage and entry[1] <= up_to:
                self.messenger.delivered(entry[2])
            else:
                keep.append(entry)
        self._gradients = keep

    def forget_finished(self) -> None:
        """Drop the sends the messenger no longer holds (after a `Messenger.flush`)."""
        pending = self.messenger.pending
        self._activations = {key: i for key, i in self._activations.items() if pending(i)}
        self._gradients = [entry for entry in self._gradients if pending(entry[2])]
