"""Streams that shard themselves and can say where each shard stands, for
tests/test_stream_resume.py, named as `--dataset shardstreamplug:NAME` / `--model
shardstreamplug:recorder`: a reader with `shard(num_shards, index)`, `state_dict()` and
`load_state_dict()` (`stream`, or `plain` without the two), and a Hugging Face
`datasets.IterableDataset` of 4 shards built in memory (`hf`).

Every sample carries its id as feature 0 of `x` (as id / 64: exact in float32). Two
environment variables steer the model without changing the run's config, so a killed run
and its resume are the same run:
  GUARD_KILL_AT=N    the process of rank GUARD_KILL_RANK (default 1) SIGKILLs itself at
                     its N-th training forward
  GUARD_RECORD=DIR   each training forward appends its batch's ids to DIR/rank<R>.txt
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

SCALE = 64.0  # feature 0 is the id / SCALE: small inputs, and exact


def _sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([i / SCALE, (i % 5) / 5.0, (i % 3) / 3.0]), torch.tensor(i % 2)


class ShardStream(IterableDataset):
    """Samples 0..n-1; shard k of m holds the ids k, k+m, ..., read in an order drawn
    from (seed, epoch, k). Its state is its position in that order."""

    def __init__(self, n: int, seed: int, num_shards: int = 1, index: int = 0) -> None:
        self.n, self.seed, self.num_shards, self.index = n, seed, num_shards, index
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return self.n

    def shard(self, num_shards: int, index: int) -> ShardStream:
        assert self.num_shards == 1, "sharded twice"
        if num_shards > self.n:
            raise ValueError(f"{num_shards} shards of {self.n} samples")
        part = type(self)(self.n, self.seed, num_shards, index)
        part.epoch = self.epoch
        return part

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        ids = list(range(self.index, self.n, self.num_shards))
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch * 10 + self.index)
        return [ids[k] for k in torch.randperm(len(ids), generator=g).tolist()]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        begin, self.pos = self.pos, 0
        for k, i in enumerate(self.order()):
            if k >= begin:
                self.pos = k + 1
                yield _sample(i)
        self.pos = 0


class StatefulShardStream(ShardStream):
    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "shard": self.index, "of": self.num_shards}

    def load_state_dict(self, state: dict[str, int]) -> None:
        assert (state["shard"], state["of"]) == (self.index, self.num_shards), state
        self.pos = state["pos"]


def _val() -> TensorDataset:
    return TensorDataset(torch.stack([_sample(i)[0] for i in range(16)]), torch.arange(16) % 2)


def stream(config: Any, n: int = 64) -> tuple[IterableDataset, TensorDataset]:
    return StatefulShardStream(n, config.seed), _val()


def plain(config: Any, n: int = 64) -> tuple[IterableDataset, TensorDataset]:
    """The same reader without `state_dict`: it shards itself but keeps no position."""
    return ShardStream(n, config.seed), _val()


def hf(config: Any, n: int = 64, shards: int = 4) -> tuple[Any, Any]:
    """A `datasets.IterableDataset` of `shards` shards, columns `x` (feature 0: the id) and
    `labels`, and a map-style validation set."""
    from datasets import Dataset

    rows = [_sample(i) for i in range(n)]
    train = Dataset.from_dict({
        "x": [x.tolist() for x, _ in rows], "labels": [int(y) for _, y in rows],
    }).to_iterable_dataset(num_shards=shards)
    val = Dataset.from_dict({
        "x": [x.tolist() for x, _ in rows[:16]], "labels": [int(y) for _, y in rows[:16]],
    })
    return train, val


class Recorder(nn.Module):
    """A linear model that writes down the sample ids it trains on, with a kill switch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)
        rank = int(os.environ.get("RANK", "0"))
        at = os.environ.get("GUARD_KILL_AT")
        victim = int(os.environ.get("GUARD_KILL_RANK", "1"))
        self.kill_at = int(at) if at and rank == victim else 0
        self.forwards = 0
        where = os.environ.get("GUARD_RECORD")
        self.log = Path(where) / f"rank{rank}.txt" if where else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
            if self.forwards == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(" ".join(str(round(v * SCALE)) for v in x[:, 0].tolist()) + "\n")
        return self.net(x)


def recorder(config: Any) -> nn.Module:
    return Recorder()
