"""The micro-batch a run's plan is made for: the largest it will see, so every batch fits.

The pipeline takes batches of any length (`hf_ftpipe.graph.dynamic_shapes`), but its plan (the
stage cut, the memory each GPU needs) is made for one shape. A plan that fits the longest sequence
fits every shorter one, so the plan is made for the longest: ``plan_max_length`` when given, else
the longest rows of the training and evaluation datasets, collated as the data loader would
collate them (the collator pads to its own rule, e.g. ``pad_to_multiple_of=8``), else the first
batch's shape. The rows of a planned micro-batch are ``per_device_train_batch_size`` over
``num_microbatches``, rounded up (the largest piece of a mini-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["longest_rows", "planned_microbatch"]

logger = get_logger(__name__)


def planned_microbatch(
    sample: Mapping[str, Any],
    rows: int,
    longest: Mapping[str, Any] | None,
    plan_max_length: int | None,
) -> dict[str, tuple[int, ...]]:
    """The planned shape of each tensor input of ``sample`` (a batch the model is traced on).

    Args:
        sample: a real batch (the first one): which inputs there are, and their sizes beyond the
            sequence (a label count...).
        rows: the rows of the largest micro-batch.
        longest: the dataset's longest rows collated (`longest_rows`), or ``None`` if unknown.
        plan_max_length: the user's bound on every sequence dimension, overriding the data's.
    """
    planned: dict[str, tuple[int, ...]] = {}
    for name, value in sample.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        shape = [rows, *value.shape[1:]]
        if value.dim() > 1:
            other = longest.get(name) if longest is not None else None
            if plan_max_length is not None:
                shape[1] = plan_max_length
            elif isinstance(other, torch.Tensor) and other.dim() == value.dim():
                shape[1] = max(int(value.shape[1]), int(other.shape[1]))
        planned[name] = tuple(int(size) for size in shape)
    return planned


def longest_rows(
    datasets: Iterable[Any], collate: Callable[[list[Any]], Mapping[str, Any]], columns: Sequence[str]
) -> Mapping[str, Any] | None:
    """The longest row of each list-valued column in ``columns`` over ``datasets`` (🤗 `datasets.Dataset`
    objects; others are skipped), as the collator pads it: each dataset's longest rows are collated
    together, and each column keeps the longest of those batches. ``None`` when no dataset tells its
    lengths (or none collates).

    Datasets are collated apart because their columns may differ: training features carry labels
    that evaluation features lack (run_qa.py's), and a collator cannot pad rows with and without them
    into one batch.
    """
    longest: dict[str, Any] = {}
    for dataset in datasets:
        if not hasattr(dataset, "with_format") or not hasattr(dataset, "column_names") or len(dataset) == 0:
            continue
        indices = {_longest_index(dataset, column) for column in columns if column in dataset.column_names}
        rows = [dataset[i] for i in sorted(i for i in indices if i is not None)]
        if not rows:
            continue
        try:
            batch = collate(rows)
        except Exception as error:  # a collator that needs more than rows of the dataset
            logger.warning("could not collate the dataset's longest rows (%s): planning without them", error)
            continue
        for name, value in batch.items():
            if name not in longest or _length(value) > _length(longest[name]):
                longest[name] = value
    return longest or None


def _length(value: Any) -> int:
    """A collated column's sequence length (its second dimension); -1 for what has none."""
    return int(value.shape[1]) if isinstance(value, torch.Tensor) and value.dim() > 1 else -1


def _longest_index(dataset: Any, column: str) -> int | None:
    """The index of ``dataset``'s longest row in ``column`` (its selection and order, as indexed)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.with_format("arrow")[column]  # reads lengths from Arrow, rows are not decoded
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
        return None
    lengths = pc.fill_null(pc.list_value_length(values), 0)
    if len(lengths) == 0:
        return None
    return int(pc.index(lengths, pc.max(lengths)).as_py())
