"""Hugging Face `datasets`, taken as they are: a `datasets.Dataset` (map-style) or a
`datasets.IterableDataset`, with or without `set_format("torch")`.

Rows are dicts, batched as dict batches are (`ddptrain.data.batch`): the model is called
with the columns its `forward` accepts, and `labels` are the targets. A `label` column
(the hub's usual name) is renamed `labels` when there is no `labels`. Columns that hold
no numbers (strings, such as a raw `text` beside its `input_ids`) are dropped, each named
once in the log. `datasets` itself is never imported here: a dataset is recognised by its
class.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

log = logging.getLogger("ddptrain")

LABELS = "labels"
_told: set[tuple[str, tuple[str, ...]]] = set()  # the dropped columns, said once


def is_hf(obj: Any) -> bool:
    """A `datasets.Dataset` or `datasets.IterableDataset` (not yet adapted)."""
    cls = type(obj)
    return cls.__module__.startswith("datasets.") and cls.__name__ in (
        "Dataset", "IterableDataset"
    )


def is_hf_iterable(obj: Any) -> bool:
    return is_hf(obj) and type(obj).__name__ == "IterableDataset"


def adapt(dataset: Any, source: str) -> Any:
    """A Hugging Face dataset as ddptrain trains it (anything else as it is): tensors out,
    `labels` as the targets, columns without numbers dropped."""
    if not is_hf(dataset):
        return dataset
    columns = _column_names(dataset)
    if columns is not None and "label" in columns and LABELS not in columns:
        dataset = dataset.rename_column("label", LABELS)
        columns = [LABELS if c == "label" else c for c in columns]
    dropped = _text_columns(dataset, columns)
    if dropped and (source, tuple(dropped)) not in _told:
        _told.add((source, tuple(dropped)))
        log.info(
            "--dataset %s: column(s) %s hold no numbers and are left out of the batches",
            source, ", ".join(repr(c) for c in dropped),
        )
        dataset = dataset.remove_columns(dropped)
    dataset = dataset.with_format("torch")
    if is_hf_iterable(dataset):
        return dataset  # already a torch IterableDataset, sharded by `.shard`
    return HFRows(dataset)


def _column_names(dataset: Any) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    return list(names) if names else None


def _text_columns(dataset: Any, columns: list[str] | None) -> list[str]:
    """The columns whose values hold no numbers: from the features when they are known,
    else from the first row."""
    features = getattr(dataset, "features", None)
    if features:
        return [name for name, feature in features.items() if not _numeric(feature)]
    if columns is None and not is_hf_iterable(dataset):
        return []
    row = next(iter(dataset), None)
    if not isinstance(row, Mapping):
        return []
    return [k for k, v in row.items() if not _holds_numbers(v)]


def _numeric(feature: Any) -> bool:
    """Whether a `datasets` feature holds numbers (values, class labels, sequences and
    arrays of them); strings, binary data and images as files do not."""
    dtype = getattr(feature, "dtype", None)
    kind = type(feature).__name__
    if kind == "ClassLabel":
        return True
    if kind in ("Sequence", "List", "LargeList"):
        return _numeric(feature.feature)
    if isinstance(feature, dict):
        return all(_numeric(f) for f in feature.values())
    if isinstance(feature, list):
        return all(_numeric(f) for f in feature)
    if isinstance(dtype, str):
        return not dtype.startswith(("string", "large_string", "binary", "large_binary"))
    return True  # an Array / Image / Audio: torch formatting makes tensors of them


def _holds_numbers(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_holds_numbers(v) for v in value)
    return not isinstance(value, (str, bytes)) and value is not None and _array_like(value)


def _array_like(value: Any) -> bool:
    try:
        torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


class HFRows(Dataset):
    """A map-style `datasets.Dataset` as a torch `Dataset` of dict rows of tensors. It
    reads a batch's rows with one `__getitems__` (one Arrow read), which a DataLoader
    then collates; ddptrain's own pre-batched protocol is not claimed."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.dataset[int(i)])

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [dict(row) for row in self.dataset.__getitems__([int(i) for i in indices])]


def class_label_count(dataset: Any) -> int | None:
    """`features['labels'].num_classes` of a (wrapped) Hugging Face dataset."""
    while dataset is not None:
        features = getattr(dataset, "features", None)
        if features and LABELS in features:
            return getattr(features[LABELS], "num_classes", None)
        dataset = getattr(dataset, "dataset", None)
    return None


def _one_integer_per_row(dataset: Any) -> bool:
    """Whether a Hugging Face dataset's `labels` column is one integer per row (a
    ClassLabel or an integer Value), judged from its features without reading it."""
    import datasets

    feature = (dataset.features or {}).get(LABELS)
    if isinstance(feature, datasets.ClassLabel):
        return True
    return isinstance(feature, datasets.Value) and "int" in str(feature.dtype)


def labels_column(dataset: Any) -> torch.Tensor | None:
    """Every label of a map-style dataset whose labels can be read without its samples:
    an adapted Hugging Face dataset (one column read) or a `TensorDataset` (its last
    tensor), also through a `Subset`."""
    rows = None
    if hasattr(dataset, "indices") and hasattr(dataset, "dataset"):  # a Subset
        rows, dataset = list(dataset.indices), dataset.dataset
    if isinstance(dataset, HFRows):
        if not _one_integer_per_row(dataset.dataset):
            return None  # no labels, or a sequence's (a causal LM's labels = input_ids)
        # datasets 5 gives a lazy Column: read it whole as one numpy array
        labels = torch.as_tensor(np.asarray(dataset.dataset.with_format("numpy")[LABELS]))
    else:
        tensors = getattr(dataset, "tensors", None)
        if not (isinstance(tensors, tuple) and tensors and isinstance(tensors[-1], torch.Tensor)):
            return None
        labels = tensors[-1]
    if labels.is_floating_point() or labels.ndim != 1:
        return None
    return labels if rows is None else labels[torch.as_tensor(rows, dtype=torch.long)]
