"""Datasets read by DataLoader workers, for tests/test_hangs.py, named as
`--dataset hangplug:NAME`: 256 learnable samples of 8 features in 4 classes.

  HANG_AT=N         sample N raises ValueError on rank HANG_RANK (default 1), which first
                    writes HANG_STARTED/failed
  HANG_STARTED=DIR  each DataLoader worker writes DIR/r<rank>-<pid> when it first reads, so a
                    test can find (and kill) the workers of a rank
  HANG_SLOW_EXIT=S  rank HANG_RANK takes S seconds more to exit (an `atexit` sleep): it closed
                    its sockets, its peers see it gone, its process still runs
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class _Samples(Dataset):
    num_classes = 4

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :4].argmax(1)
        self.bad = int(os.environ.get("HANG_AT", "-1"))
        self.rank = os.environ.get("RANK", "0")
        self.fails = self.rank == os.environ.get("HANG_RANK", "1")
        self.seen = 0  # the pid that wrote its mark (workers get copies of the dataset)
        if self.fails and os.environ.get("HANG_SLOW_EXIT"):
            atexit.register(time.sleep, float(os.environ["HANG_SLOW_EXIT"]))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.seen != os.getpid() and get_worker_info() is not None:
            self.seen = os.getpid()
            where = os.environ.get("HANG_STARTED")
            if where:
                (Path(where) / f"r{self.rank}-{os.getpid()}").touch()
        if i == self.bad and self.fails:
            where = os.environ.get("HANG_STARTED")
            if where:
                (Path(where) / "failed").touch()
            raise ValueError(f"row {i} has a truncated record")
        return self.x[i], self.y[i]


def samples(config: Any) -> Dataset:
    return _Samples()


def slow(config: Any) -> Dataset:
    """Takes two minutes to load, after writing HANG_STARTED/loading."""
    (Path(os.environ["HANG_STARTED"]) / "loading").touch()
    time.sleep(120)
    return _Samples()


class _Stream(IterableDataset):
    """The samples as a stream that raises at its row HANG_AT (each worker reads a share)."""

    num_classes = 4

    def __iter__(self) -> Iterator[Any]:
        rows = _Samples()
        for i in range(len(rows)):
            if i == rows.bad:
                raise ValueError(f"row {i} has a truncated record")
            yield rows.x[i], rows.y[i]


def stream(config: Any) -> dict[str, Dataset]:
    return {"train": _Stream(), "val": _Samples(64)}
