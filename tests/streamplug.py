"""A stream that shards itself (`shard(num_shards, index)`, as Hugging Face `datasets`
does), and writes down every item it reads, so a test can count the reads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, TensorDataset


class CountingStream(IterableDataset):
    def __init__(self, n: int, record: str, num_shards: int = 1, index: int = 0) -> None:
        self.n, self.record, self.num_shards, self.index = n, record, num_shards, index

    def __len__(self) -> int:
        return self.n

    def shard(self, num_shards: int, index: int) -> CountingStream:
        assert self.num_shards == 1, "sharded twice"
        return CountingStream(self.n, self.record, num_shards, index)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        log = Path(self.record) / f"reads-{os.getpid()}.txt"
        with log.open("a") as f:
            for i in range(self.index, self.n, self.num_shards):  # only this shard is read
                f.write(f"{i}\n")
                yield torch.tensor([float(i), 1.0, -1.0]), torch.tensor(i % 2)


def build(config: Any, n: int = 48, record: str = ".") -> tuple[IterableDataset, Any]:
    val = TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
    return CountingStream(n, record), val
