"""Datasets held in (or memory-mapped from) arrays, fetched a whole batch per indexing
operation instead of collated sample by sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    Dataset,
    Subset,
    TensorDataset,
)


class ArrayDataset(Dataset):
    """Samples held in memory (or memory-mapped) arrays.

    `batch(idx)` fetches a whole batch with one indexing operation instead of collating
    `batch_size` single samples: for small models this is most of the data-loading cost of
    a hand-written loop. `__getitems__` lets a DataLoader take the same path.
    """

    def __init__(self, x: Any, y: Any, scale: float | None = None,
                 targets_each: int | None = None) -> None:
        """`targets_each`: token windows whose every target is scored, T of them a sample
        (`data.text.TokenWindows.targets_each`); None: not known."""
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y, self.scale = x, y, scale
        self.targets_each = targets_each

    def __len__(self) -> int:
        return len(self.y)

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().mul_(self.scale) if self.scale is not None else x

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(torch.as_tensor(indices, dtype=torch.long))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.x[idx]), self.y[idx]


class TensorBatches(ArrayDataset):
    """A user's `TensorDataset` (or a `Subset` of one), sliced a batch at a time like an
    `ArrayDataset` instead of collating samples one by one."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], rows: torch.Tensor | None) -> None:
        super().__init__(tensors[0], tensors[-1])
        self.tensors, self.rows = tensors, rows

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.tensors[0])

    def __getitem__(self, i: int) -> Any:
        return tuple(t[0] for t in self.batch(torch.tensor([i])))

    def batch(self, idx: torch.Tensor) -> Any:
        if self.rows is not None:
            idx = self.rows[idx]
        return tuple(t[idx] for t in self.tensors)


def as_sliceable(dataset: Dataset) -> Dataset:
    """The same samples, sliceable in-process when the dataset is a `TensorDataset` or a
    `Subset` of one; any other dataset as it is."""
    rows = None
    base = dataset
    if isinstance(base, Subset) and isinstance(base.dataset, TensorDataset):
        rows, base = torch.as_tensor(list(base.indices), dtype=torch.long), base.dataset
    if type(base) is TensorDataset or (
        isinstance(base, TensorDataset) and type(base).__getitem__ is TensorDataset.__getitem__
    ):
        return TensorBatches(base.tensors, rows)
    return dataset


class MemmapDataset(ArrayDataset):
    """Rows of memory-mapped `.npy` arrays: a batch reads only its own rows from disk."""

    def __init__(self, x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> None:
        super().__init__(rows, rows)
        self.mx, self.my = x, y

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.x[idx.numpy()]
        order = np.argsort(rows)  # sorted reads are sequential on disk
        x, y = np.empty((len(rows), *self.mx.shape[1:]), self.mx.dtype), self.my[rows]
        x[order] = self.mx[rows[order]]
        return torch.from_numpy(as_float(x)), torch.from_numpy(as_targets(y))


def as_float(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def as_targets(y: np.ndarray) -> np.ndarray:
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def pass_through(batch: Any) -> Any:
    """Collate for datasets whose `__getitems__` already returns a batch."""
    return batch
