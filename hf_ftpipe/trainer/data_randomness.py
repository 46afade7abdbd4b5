"""The random state that data loading draws from, kept apart from the model's.

Every rank of a pipeline reads its own copy of each batch, so the copies must be identical. A
random collator (masked-LM masking, whole-word masking, span corruption, augmentation) draws from
torch's, numpy's and Python's global generators, and a shuffling sampler or a data loader may
too; but dropout draws from the same generators, and each rank runs different layers, so after a
step the ranks' generators differ and so would their batches: the first stage would train on one
masking while the last stage scores another. `DataRandomness` holds a separate state for those
three generators, seeded from the run's seed as ``transformers.set_seed`` seeds the global ones,
and PipeTrainer loads every batch with that state swapped in. Data randomness then depends on
the seed and the batches drawn so far, never on the model; with dropout off it is the very
sequence a single-process `Trainer` draws, so a pipeline run masks exactly as `Trainer` does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["DataRandomness"]


class DataRandomness:
    """Generator states for data loading (torch CPU, numpy, Python), swapped in by `active`.

    Args:
        seed (`int`): the run's seed; the states start where ``transformers.set_seed(seed)`` puts
            the global generators.
    """

    def __init__(self, seed: int) -> None:
        self._torch = torch.Generator().manual_seed(seed).get_state()
        self._numpy = np.random.RandomState(seed).get_state()
        generator = random.Random(seed)
        self._python = generator.getstate()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body on the data states; they advance, and the model's states are put back after."""
        saved = _global_states()
        _set_global_states(self._torch, self._numpy, self._python)
        try:
            yield
        finally:
            self._torch, self._numpy, self._python = _global_states()
            _set_global_states(*saved)

    @contextmanager
    def forked(self) -> Iterator[None]:
        """Like `active`, but the data states do not advance (a look at a batch that is not trained on)."""
        kept = self._torch, self._numpy, self._python
        try:
            with self.active():
                yield
        finally:
            self._torch, self._numpy, self._python = kept

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The states as tensors only (checkpoints load them with ``weights_only=True``)."""
        kind, keys, position, has_gauss, cached_gaussian = self._numpy
        version, python_state, gauss = self._python
        return {
            "torch": self._torch.clone(),
            "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "numpy_scalars": torch.tensor([position, has_gauss], dtype=torch.int64),
            "numpy_cached_gaussian": torch.tensor(cached_gaussian, dtype=torch.float64),
            "python": torch.tensor([version, *python_state], dtype=torch.int64),
            "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._torch = state["torch"].clone()
        position, has_gauss = (int(v) for v in state["numpy_scalars"])
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        self._numpy = ("MT19937", keys, position, has_gauss, float(state["numpy_cached_gaussian"]))
        version, *python_state = (int(v) for v in state["python"])
        gauss = float(state["python_gauss"][0])
        self._python = (version, tuple(python_state), None if gauss != gauss else gauss)


def _global_states() -> tuple[torch.Tensor, tuple, tuple]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_global_states(torch_state: torch.Tensor, numpy_state: tuple, python_state: tuple) -> None:
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
