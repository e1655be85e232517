"""User code for the task tests: datasets, models and a task of every kind, named on the
command line as `--dataset taskplug:NAME` / `--model taskplug:NAME` / `--task taskplug:NAME`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ddptrain import Task

# ---------------------------------------------------------------- regression / multilabel


def regression(config: Any, n: int = 300, outputs: int = 1) -> TensorDataset:
    """One dataset (ddptrain splits it): y = x @ w + noise, float targets."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 5, generator=g)
    w = torch.randn(5, outputs, generator=g)
    y = x @ w + 0.1 * torch.randn(n, outputs, generator=g)
    return TensorDataset(x, y[:, 0] if outputs == 1 else y)


class _Multi(TensorDataset):
    pass


def multilabel(config: Any) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(250, 6, generator=g)
    y = (x[:, :4] + 0.3 * torch.randn(250, 4, generator=g) > 0).float()
    return _Multi(x[:201], y[:201]), _Multi(x[201:], y[201:])


# ---------------------------------------------------------------- language model
class _Tokens(TensorDataset):
    vocab_size = 11


def tokens(config: Any, n: int = 90, length: int = 12) -> tuple[TensorDataset, TensorDataset]:
    """Sequences of different lengths: inputs padded with 0, targets with -100."""
    g = torch.Generator().manual_seed(5)
    x = torch.zeros(n, length, dtype=torch.long)
    y = torch.full((n, length), -100, dtype=torch.long)
    for i in range(n):
        size = int(torch.randint(3, length + 1, (1,), generator=g))
        seq = torch.randint(1, 11, (size + 1,), generator=g)
        x[i, :size], y[i, :size] = seq[:-1], seq[1:]
    return _Tokens(x[:71], y[:71]), _Tokens(x[71:], y[71:])


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


def tiny_lm(config: Any, vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size)


# ---------------------------------------------------------------- dict batches
class _Dicts(Dataset):
    num_classes = 3

    def __init__(self, x: torch.Tensor, y: torch.Tensor, labels: bool = True) -> None:
        self.x, self.y, self.labels = x, y, labels

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"features": self.x[i], "mask": torch.ones(1)}
        if self.labels:
            item["labels"] = self.y[i]
        return item


def dicts(config: Any, labels: bool = True) -> tuple[Dataset, Dataset]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(160, 4, generator=g)
    y = x[:, :3].argmax(dim=1)
    return _Dicts(x[:128], y[:128], labels), _Dicts(x[128:], y[128:], labels)


class DictNet(nn.Module):
    """Takes keyword inputs and computes its own loss when given labels (HF style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def dict_net(config: Any) -> nn.Module:
    return DictNet()


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def logits_only(config: Any) -> nn.Module:
    return LogitsOnly()


class Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(30, 2)

    def forward(self, x: torch.Tensor) -> dict:
        return {"answer": "not a tensor"}


def chatty(config: Any) -> nn.Module:
    return Chatty()


class SequenceHead(nn.Module):
    """(B, T, V) logits whatever the targets: a model for the wrong task."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(10, 4 * 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1, 4, 7)


def sequence_head(config: Any) -> nn.Module:
    return SequenceHead()


# ---------------------------------------------------------------- iterable data
class Stream(IterableDataset):
    """Samples 0..n-1 in order; feature 0 is the sample id."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.n = start, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.start, self.start + self.n):
            x = torch.tensor([float(i), (i % 7) / 7.0, (i % 3) / 3.0])
            yield x, torch.tensor(i % 2)


def stream(config: Any, n: int = 203) -> tuple[IterableDataset, IterableDataset]:
    train, val = Stream(0, n), Stream(10_000, 37)
    train.num_classes = 2  # type: ignore[attr-defined]
    return train, val


# ---------------------------------------------------------------- tasks and probes
class Huber(Task):
    name, best, mode, metric_names = "huber", "mae", "min", ("abs_err",)

    def __init__(self, delta: float) -> None:
        self.delta = delta

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        per_sample = F.huber_loss(
            prediction.squeeze(-1), targets, reduction="none", delta=self.delta
        )
        return per_sample.sum(), targets.shape[0]

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"abs_err": (prediction.squeeze(-1) - targets).abs().sum()}

    def summarize(self, totals: dict[str, float], count: float) -> dict[str, float]:
        return {"loss": totals["loss"] / count, "mae": totals["abs_err"] / count}


def huber(config: Any, delta: float = 1.0) -> Task:
    return Huber(delta)


class DtypeProbe(nn.Module):
    """Records the dtype its hidden layer computes in (autocast turns it to bfloat16)."""

    def __init__(self, in_features: int = 30, outputs: int = 2) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(in_features, 8), nn.Linear(8, outputs)
        self.seen: set[torch.dtype] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.add(h.dtype)
        return self.b(torch.relu(h))


class StatefulStream(Stream):
    """A stream that can say where it stands and continue from there (exact resume)."""

    def __init__(self, start: int, n: int) -> None:
        super().__init__(start, n)
        self.pos = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        begin, self.pos = self.pos, 0
        for k, item in enumerate(super().__iter__()):
            if k >= begin:
                self.pos = k + 1
                yield item
        self.pos = 0  # the next epoch starts from the beginning

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def stateful_stream(config: Any, n: int = 6000) -> tuple[IterableDataset, IterableDataset]:
    train, val = StatefulStream(0, n), Stream(100_000, 64)
    train.num_classes = 2  # type: ignore[attr-defined]
    return train, val
