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

Resuming continues that sequence exactly. accelerate's data loader collates one batch ahead of
the one it hands out, so when a checkpoint is saved after step k, batch k + 1 is already
collated and the state has moved past it; a resumed run skips k batches without collating them
and would collate batch k + 1 from the state after it (`Trainer` restores its global generators
after that, so its resumed masks differ too). So the training loader's collate function is
wrapped (`collating`): it notes the state each collation starts from until its batch is trained,
and a checkpoint saves those states with the current one; on resume the first collations start
from the saved states and the current state is put back after them. With
``dataloader_num_workers > 0`` the workers collate from seeds of their own, and a resumed run is
not exact (as in `Trainer`).

A collator may also hold a generator of its own (transformers 5's `DataCollatorForLanguageModeling(...,
seed=...)`, which run_mlm.py passes ``seed=training_args.seed``): it makes it on its first call and
advances it with every call, so the global states do not cover it. A look at a batch that is not
trained on (`forked`: the batch the pipeline is traced on, the longest rows it is planned for) also
puts back what the collator holds (`_CollatorState`), else every later batch would be masked with
the draws of another one, unlike under `Trainer`, which collates no batch but those it uses.
"""

from __future__ import annotations

import copy
import inspect
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["DataRandomness", "global_states", "set_global_states"]

_States = tuple[torch.Tensor, tuple, tuple]
"""torch's CPU, numpy's and Python's generator states."""


class DataRandomness:
    """Generator states for data loading (torch CPU, numpy, Python), swapped in by `active`.

    Args:
        seed (`int`): the run's seed; the states start where ``transformers.set_seed(seed)`` puts
            the global generators.
    """

    def __init__(self, seed: int) -> None:
        torch_state = torch.Generator().manual_seed(seed).get_state()
        self._states: _States = (torch_state, np.random.RandomState(seed).get_state(), random.Random(seed).getstate())
        self._collecting = False
        """Inside `active` (not `forked`): training collations are noted."""
        self._pending: list[_States] = []
        """The states the collations of training batches not yet trained on started from, oldest first."""
        self._replay: list[_States] = []
        """Resuming: the states the next training collations start from."""
        self._after_replay: _States | None = None
        """Resuming: the state once `_replay` is used up."""

    @classmethod
    def following_global_states(cls) -> DataRandomness:
        """Starting where the global generators are now: `Trainer` under ``model_init`` seeds them, makes the
        model, and collates from where making it left them (`hf_ftpipe.trainer.model_init`)."""
        randomness = cls(0)
        randomness._states = global_states()
        return randomness

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body on the data states; they advance, and the model's states are put back after."""
        saved = global_states()
        set_global_states(*self._states)
        collecting, self._collecting = self._collecting, True
        try:
            yield
        finally:
            self._collecting = collecting
            self._states = global_states()
            set_global_states(*saved)

    @contextmanager
    def forked(self, *collators: Any) -> Iterator[None]:
        """Like `active`, but the data states do not advance (a look at a batch that is not trained on),
        nor do the generators ``collators`` (the collate functions the look may call) hold of their own."""
        kept = self._states, list(self._pending), list(self._replay), self._after_replay
        collator_state = _CollatorState(collators)
        try:
            with self.active():
                self._collecting = False
                yield
        finally:
            self._states, self._pending, self._replay, self._after_replay = kept
            collator_state.restore()

    def collating(self, collate: Callable[[list], Any]) -> Callable[[list], Any]:
        """``collate`` (the training data loader's ``collate_fn``), noting the state each collation starts from."""
        return _NotedCollate(self, collate)

    def new_loader(self) -> None:
        """A new training data loader: no batch of it is collated yet."""
        self._pending.clear()

    def trained(self, batches: int) -> None:
        """The oldest ``batches`` collated batches were handed to training."""
        del self._pending[:batches]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The states a resumed run starts its collations from, as tensors only (checkpoints load
        them with ``weights_only=True``): the start of each batch collated but not yet trained on,
        then the current state (``then{i}/...`` keys)."""
        now = self._after_replay if self._replay else self._states
        states = [*self._pending, *self._replay, now]
        result = _to_tensors(states[0])
        for i, state in enumerate(states[1:], start=1):
            result.update({f"then{i}/{key}": value for key, value in _to_tensors(state).items()})
        return result

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        states = [_from_tensors(state)]
        while f"then{len(states)}/torch" in state:
            prefix = f"then{len(states)}/"
            states.append(_from_tensors({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}))
        self._states = states[0]
        self._pending = []
        self._replay, self._after_replay = (states[:-1], states[-1]) if len(states) > 1 else ([], None)

    def _start_collation(self) -> None:
        if not self._collecting or get_worker_info() is not None:
            return
        if self._replay:
            set_global_states(*self._replay.pop(0))
        self._pending.append(global_states())

    def _end_collation(self) -> None:
        if self._collecting and not self._replay and self._after_replay is not None:
            set_global_states(*self._after_replay)
            self._after_replay = None


class _NotedCollate:
    """A collate function that tells `DataRandomness` where each collation starts and ends (a class,
    not a closure, so that data loader workers started by ``spawn`` can pickle it)."""

    def __init__(self, randomness: DataRandomness, collate: Callable[[list], Any]) -> None:
        self.randomness, self.collate = randomness, collate

    def __call__(self, samples: list) -> Any:
        self.randomness._start_collation()
        batch = self.collate(samples)
        self.randomness._end_collation()
        return batch


class _CollatorState:
    """The attributes of some collate functions, and the states of the generators among them, as they are
    now; `restore` puts them back. A collator that makes its generator on first use (``None`` until
    then) gets ``None`` back, so it makes it again from its seed, as if never called; one that already
    has it gets its state back. Collators it wraps (``RemoveColumnsCollator.data_collator``,
    `_NotedCollate.collate`, a user's wrapper) are followed; tokenizers, processors and models are not
    collators and are left as they are."""

    def __init__(self, collators: tuple[Any, ...]) -> None:
        self._attributes: list[tuple[Any, dict[str, Any]]] = []
        self._generators: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for collator in collators:
            self._note(collator, seen, depth=3)

    def _note(self, part: Any, seen: set[int], depth: int) -> None:
        if depth == 0 or id(part) in seen or not _may_be_collator(part):
            return
        seen.add(id(part))
        attributes = dict(vars(part))
        self._attributes.append((part, attributes))
        for value in attributes.values():
            state = _generator_state(value)
            if state is not None:
                self._generators.append((value, state))
            else:
                self._note(value, seen, depth - 1)

    def restore(self) -> None:
        for generator, state in self._generators:
            _set_generator_state(generator, state)
        for part, attributes in self._attributes:
            now = vars(part)
            for name in [name for name in now if name not in attributes]:
                del now[name]
            now.update(attributes)


def _may_be_collator(value: Any) -> bool:
    """A callable object with attributes that is not a tokenizer, processor, model or function."""
    from transformers.utils import PushToHubMixin

    if not callable(value) or not hasattr(value, "__dict__") or isinstance(value, type):
        return False
    return not isinstance(value, PushToHubMixin | torch.nn.Module) and not inspect.isroutine(value)


def _generator_state(value: Any) -> Any:
    """The state of a torch, numpy or Python generator; ``None`` for anything else."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, np.random.Generator):
        return copy.deepcopy(value.bit_generator.state)
    if isinstance(value, np.random.RandomState):
        return value.get_state()
    if isinstance(value, random.Random):
        return value.getstate()
    return None


def _set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


def _to_tensors(states: _States) -> dict[str, torch.Tensor]:
    torch_state, (_, keys, position, has_gauss, cached_gaussian), (version, python_state, gauss) = states
    return {
        "torch": torch_state.clone(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_scalars": torch.tensor([position, has_gauss], dtype=torch.int64),
        "numpy_cached_gaussian": torch.tensor(cached_gaussian, dtype=torch.float64),
        "python": torch.tensor([version, *python_state], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
    }


def _from_tensors(state: dict[str, torch.Tensor]) -> _States:
    position, has_gauss = (int(v) for v in state["numpy_scalars"])
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    numpy_state = ("MT19937", keys, position, has_gauss, float(state["numpy_cached_gaussian"]))
    version, *python_state = (int(v) for v in state["python"])
    gauss = float(state["python_gauss"][0])
    return state["torch"].clone(), numpy_state, (version, tuple(python_state), None if gauss != gauss else gauss)


def global_states() -> _States:
    """torch's CPU, numpy's and Python's global generator states (all ``transformers.set_seed`` seeds but the GPUs')."""
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_global_states(torch_state: torch.Tensor, numpy_state: tuple, python_state: tuple) -> None:
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
